"""One reward call: load the function by path, decode a record for it, call it under a timeout, and turn
what it returns into a RewardResult — or a RewardError that says why there is no reward.

The stage never invents a reward: a function that raises, hangs past the timeout, or returns something
that is not a finite number (NaN, None, a string, a bool) gives a RewardError, and the worker
dead-letters that record with the error's reason (docs/rewards.md "The reward stage"). Knows nothing of
Redis or streams (worker.py).

Sync functions run in a thread pool; a thread cannot be killed, so a sync call that hangs keeps its
thread after its record was dead-lettered. Those are counted (`Scorer.hung`) and bounded: once
`max_hung` threads are stuck the worker stops (StageWedged) so that its supervisor restarts the process,
rather than scoring ever slower. Functions that can hang (running generated code) belong in a sandbox
(maskroll.rewards.sandbox) or should be async, which a timeout does cancel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import math
import numbers
from collections.abc import Callable
from pathlib import Path

import numpy as np

from maskroll.proto.records import RolloutRecord
from maskroll.rewards.types import RewardInput, RewardResult


class StageError(Exception):
    """A stage cannot score this record; the message is the reason that goes with its dead letter, after
    `what` (what the record goes without)."""

    what = "not scored"


class RewardError(StageError):
    """No reward for this record; the message is the reason that goes with its dead letter."""

    what = "no reward"


class StageWedged(RuntimeError):
    """Too many sync reward calls are stuck in their threads: restart the process."""


def load_reward(spec: str) -> tuple[Callable, str]:
    """(function, its name) from "MODULE:FUNCTION"; ValueError naming what is missing."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no callable {attr!r}")
    return fn, attr


class Decoder:
    """Token ids → text with the run's tokenizer: `tokenizer` if given, else the one in each record's
    model directory (semantics.model), loaded once per directory. Special tokens are left out."""

    def __init__(self, tokenizer: Path | None = None) -> None:
        self.fixed = tokenizer
        self._cache: dict[str, Callable] = {}

    def _load(self, where: str) -> Callable:
        if where in self._cache:
            return self._cache[where]
        path = Path(where)
        if (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path / "tokenizer.json"))

            def decode(ids) -> str:
                return tok.decode(np.asarray(ids).tolist(), skip_special_tokens=True)
        elif path.is_dir():
            from transformers import AutoTokenizer

            auto = AutoTokenizer.from_pretrained(str(path))

            def decode(ids) -> str:
                return auto.decode(np.asarray(ids).tolist(), skip_special_tokens=True)
        else:
            raise RewardError(
                f"no tokenizer for model {where!r} (not a local directory): "
                "start the stage with --tokenizer DIR"
            )
        self._cache[where] = decode
        return decode

    def __call__(self, rec: RolloutRecord) -> RewardInput:
        decode = self._load(str(self.fixed) if self.fixed is not None else rec.semantics.model)
        return RewardInput(
            prompt=decode(rec.prompt_ids),
            completion=decode(rec.completion_ids),
            prompt_ids=rec.prompt_ids,
            completion_ids=rec.completion_ids,
            metadata=dict(rec.metadata),
            finish_reason=rec.finish_reason,
            rollout_id=rec.rollout_id,
            group_id=rec.group_id,
            sample_index=rec.sample_index,
        )


def as_result(value: object, name: str) -> RewardResult:
    """What a reward function returned, as a RewardResult; RewardError for anything but a finite number."""
    if isinstance(value, RewardResult):
        return value if value.verifier else RewardResult(value.reward, name, value.reason)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        reward = float(value)
        if math.isfinite(reward):
            return RewardResult(reward, name)
        raise RewardError(f"reward function {name} returned {reward}, not a finite number")
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise RewardError(
        f"reward function {name} returned {type(value).__name__} {shown}; expected a finite number or a "
        "RewardResult"
    )


class Scorer:
    """Calls one reward function, at most `concurrency` at once per worker (the worker bounds that), each
    call within `timeout_s`."""

    def __init__(self, fn: Callable, name: str, *, timeout_s: float, concurrency: int) -> None:
        self.fn, self.name, self.timeout_s = fn, name, timeout_s
        self.max_hung = concurrency
        # spare threads for calls that hang: the live ones still get `concurrency` threads
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2 * concurrency, thread_name_prefix="reward-call"
        )
        self._stuck: set[concurrent.futures.Future] = set()
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 (a callable object with an async __call__)
        )

    @property
    def hung(self) -> int:
        """Sync calls that outlived their timeout and still hold a thread."""
        return len(self._stuck)

    async def score(self, inp: RewardInput) -> RewardResult:
        if len(self._stuck) >= self.max_hung:
            raise StageWedged(
                f"{len(self._stuck)} calls of reward function {self.name} are stuck past their "
                f"{self.timeout_s:g} s timeout in threads that cannot be stopped; restarting the worker"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            if self._is_async:
                value = await asyncio.wait_for(self.fn(inp), self.timeout_s)
            else:
                call = self._pool.submit(self.fn, inp)
                try:
                    value = await asyncio.wait_for(asyncio.wrap_future(call), self.timeout_s)
                except asyncio.TimeoutError:
                    if not call.cancel():  # already running: it keeps its thread
                        self._stuck.add(call)
                        call.add_done_callback(self._stuck.discard)
                    raise
                if inspect.isawaitable(value):  # a sync function that returned an awaitable
                    value = await asyncio.wait_for(value, max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise RewardError(
                f"reward function {self.name} did not return within {self.timeout_s:g} s"
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            text = str(e)
            text = text if len(text) <= 300 else text[:297] + "..."
            raise RewardError(f"reward function {self.name} raised {type(e).__name__}: {text}") from e
        return as_result(value, self.name)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RewardStep:
    """What the reward stage does to one record (the StageWorker's `scorer`): set its reward, unless it
    has one. Also the first step of a teacher worker started with --reward (stages/teacher.py)."""

    kind = "reward"
    what = RewardError.what

    def __init__(self, scorer: Scorer, decoder: Decoder, spec: str) -> None:
        self.scorer, self.decoder, self.label = scorer, decoder, spec

    @property
    def hung(self) -> int:
        return self.scorer.hung

    async def __call__(self, rec: RolloutRecord) -> None:
        if rec.reward is None:
            result = await self.scorer.score(self.decoder(rec))
            rec.reward, rec.reward_verifier, rec.reward_reason = (
                result.reward,
                result.verifier,
                result.reason[:1000],
            )

    def close(self) -> None:
        self.scorer.close()
