"""The torch reference engine: a transformers causal LM behind the `Engine` contract, with batched decoding.

Owns one decode thread. At every step it applies pending weight updates and cancellations, admits newly
arrived requests (each prefilled alone, then merged into the batch's KV cache), and runs ONE forward
for all active sequences: a left-padded batch whose 2-D attention mask hides the padding and whose
explicit position ids count only a row's real tokens, so a row's logits do not depend on which other
rows share its batch (to float rounding). Sampling uses the processed distribution μ of docs/math.md §6 —
`processed_chunk` (temperature, then top-k, then top-p, as vLLM) and log_softmax — with one
`torch.Generator` per request, so a seed fixes the tokens whatever the batch. Results cross to the
asyncio side through `loop.call_soon_threadsafe` into a per-request queue.

Failure isolation: a request whose prefill, sampling or bookkeeping fails ends with that error and the
others go on (a sampling group that fails is retried row by row to find the culprit; a row whose μ is
not a distribution — NaN logits — fails alone). A failed batched forward ends the batch's requests and
the engine serves on. Only an error outside any request (a weight copy that fails halfway, a bug in the
loop itself) or a forward stuck for `stall_timeout_s` ends the engine: `failure()` then says why, and
every in-flight and later request fails with EngineDead. Sampling parameters the float32 arithmetic of
μ cannot represent (a temperature so small that ℓ / T overflows) are refused up front, and checkpoints
with non-finite tensors are refused before any weight changes.

The batch's KV cache bookkeeping (merging a prefilled row in, trimming padding) is `torch_batch`'s; μ and
the draw from it `torch_sampling`'s; what the two sides hand each other (a request's handle, a score job,
an update) `torch_jobs`'; loading the model and reading and checking new weights (the weight rules of
`weights.tensor_rules`) is `torch_weights`'s; applying LoRA adapters per row is `torch_lora`'s (a request
with an adapter is sampled with it from its first token to its last, all its outputs at the adapter's
version); scoring `torch_score`'s. The model forward never runs on the event loop. This module knows
nothing of gRPC, Redis or protobuf.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import torch

from maskroll.trainer_adapter.processed import Workspace

from . import torch_lora, torch_sampling, torch_score, torch_weights
from .contract import (
    AdapterRef,
    Engine,
    EngineDead,
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineSettings,
    LoraWeights,
    ScoreOutput,
    ScoreRequest,
    WeightCapabilities,
    check_request,
    check_score_request,
    eos_token_ids,
)
from .torch_batch import Batch
from .torch_jobs import EngineClosed, Handle, ScoreJob, Update
from .torch_sampling import SampledToken, SamplingError, merged

Tensor = torch.Tensor
log = logging.getLogger(__name__)

# A forward that takes longer than this means the decode loop is stuck (a hung device, a deadlock): the
# engine declares itself dead so that health turns NOT_SERVING and an orchestrator restarts the replica.
STALL_TIMEOUT_S = 300.0


class TorchEngine(Engine):
    """transformers model + one decode thread that batches every active request into one forward per step.

    `threads` sets torch's intra-op threads for the decode thread (None: torch's default). On a small
    shared CPU box 1 is much faster than letting OpenMP spin on busy cores (6 ms vs 0.1 ms for a
    [16, 128] x [128, 512] matmul on the 2-core CI machine).
    """

    name = "torch"
    # a push loads from memory (no spool file); a delta is checked, then written into the parameters
    weight_capabilities = WeightCapabilities(tensors=True, patches=True)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_logprobs: int = 20,
        max_batch: int = 64,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        threads: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        max_lora_rank: int = 0,
        max_loras: int = 4,
    ) -> None:
        import transformers

        self.version = transformers.__version__
        self.model_dir = Path(model_dir)
        self.model_id = str(model_dir)
        config = transformers.AutoConfig.from_pretrained(self.model_dir).get_text_config()
        model_len = int(config.max_position_embeddings)
        if max_model_len is not None and not 2 <= max_model_len <= model_len:
            raise ValueError(
                f"max_model_len={max_model_len} must be in [2, {model_len}] (the model's "
                "max_position_embeddings: the torch engine does not extend a model's context)"
            )
        self._limits = EngineLimits(
            vocab_size=int(config.vocab_size),
            max_model_len=model_len if max_model_len is None else int(max_model_len),
            max_logprobs=int(max_logprobs),
            eos_token_ids=eos_token_ids(self.model_dir),
        )
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._max_batch = max_batch
        if max_lora_rank < 0 or max_loras < 1:
            raise ValueError(f"max_lora_rank {max_lora_rank} must be >= 0 and max_loras {max_loras} >= 1")
        self._max_lora_rank, self._max_loras = int(max_lora_rank), int(max_loras)
        self._lora: torch_lora.LoraLayers | None = None  # with the model, at start
        self._dtype, self._device, self._threads = dtype, torch.device(device), threads
        # Draws the seed of every request that brings none, as vLLM's engine seed does: the same requests
        # in the same order sample the same tokens after a restart. Used on the event loop thread only.
        self._seed = int(seed)
        self._seeder = torch.Generator().manual_seed(self._seed)
        self._model = None
        self._cache_kw = "cache"
        self._thread: threading.Thread | None = None
        self._cv = threading.Condition()
        # Guarded by _cv: what the asyncio side hands to the decode thread.
        self._pending: collections.deque[Handle] = collections.deque()
        self._cancelled: set[Handle] = set()
        self._updates: list[Update] = []
        self._scores: collections.deque[ScoreJob] = collections.deque()
        self._stopping = False
        self._num_active = 0
        self._dead: str | None = None  # why the engine serves no more; set once, never cleared
        # Every request not yet released and every update not yet answered, wherever it is (queued, in
        # the decode thread's hands, in the batch): what a dying engine must fail. Guarded by _cv.
        self._live: set[Handle] = set()
        self._live_updates: list[Update] = []
        self._live_scores: set[ScoreJob] = set()
        self._stall_timeout_s = float(stall_timeout_s)
        # Written by the decode thread, read by failure(): when the running iteration last made progress
        # (a forward finished); None while the thread waits for work.
        self._beat: float | None = None
        # Owned by the decode thread.
        self._batch = Batch(self._device)  # the _Handles being decoded and their KV cache
        self._work = Workspace()
        self._score_work = Workspace()  # scoring's chunks: a buffer of their own, not the batch's
        self._version = 0
        self.forward_calls = 0  # prefills + decode steps
        self.decode_steps = 0  # batched forwards over the active rows

    # ---- contract -------------------------------------------------------------------------------

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def settings(self) -> EngineSettings:
        return EngineSettings(
            dtype=str(self._dtype).removeprefix("torch."), seed=self._seed, max_batch=self._max_batch
        )

    @property
    def max_lora_rank(self) -> int:
        return self._max_lora_rank

    @property
    def num_active(self) -> int:
        """Requests the engine holds (waiting for admission or in the batch); 0 once all are freed."""
        with self._cv:
            return self._num_active

    def failure(self) -> str | None:
        if self._dead is not None:
            return self._dead
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopping:
            self._die("the decode thread exited")
        beat = self._beat
        if beat is not None and time.monotonic() - beat > self._stall_timeout_s:
            self._die(f"the decode loop is stuck: no forward finished for {self._stall_timeout_s:g} s")
        return self._dead

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._model, self._cache_kw = await asyncio.to_thread(
            torch_weights.load_model, self.model_dir, device=self._device, dtype=self._dtype
        )
        self._lora = torch_lora.LoraLayers(
            self._model, max_rank=self._max_lora_rank, max_loras=self._max_loras
        )
        self._thread = threading.Thread(target=self._run, name="maskroll-torch-decode", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            # A stuck thread (a dead engine) may never return: it is a daemon, so do not wait for it.
            await asyncio.to_thread(self._thread.join, 5.0 if self._dead else None)
            self._thread = None
        err = EngineClosed("engine closed")
        with self._cv:
            for handle in [*self._pending, *self._batch.clear()]:
                self._finish(handle, err)
            for update in self._updates:
                update.future.set_exception(err)
            for job in self._scores:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    job.future.set_exception(err)
            self._pending.clear()
            self._updates.clear()
            self._scores.clear()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self._validate(request)
        self._check_running(dead_too=False)  # a dead engine refuses under the lock, below
        gen = torch.Generator()
        if request.params.seed is None:
            gen.manual_seed(int(torch.randint(0, 1 << 62, (), generator=self._seeder)))
        else:
            gen.manual_seed(int(request.params.seed))
        handle = Handle(request, asyncio.get_running_loop(), asyncio.Queue(), gen)
        with self._cv:
            if self._dead is not None:
                raise self._dead_error()
            self._live.add(handle)
            self._pending.append(handle)
            self._num_active += 1
            self._cv.notify_all()
        finished = False
        buf: collections.deque = collections.deque()
        try:
            while True:
                if not buf:
                    buf.append(await handle.queue.get())
                while not handle.queue.empty():  # coalesce what is ready: fewer, larger outputs
                    buf.append(handle.queue.get_nowait())
                if isinstance(buf[0], BaseException):
                    finished = True
                    raise buf[0]
                group = [buf.popleft()]
                # One output never spans two policy versions.
                while buf and isinstance(buf[0], SampledToken) and buf[0].version == group[0].version:
                    group.append(buf.popleft())
                finished = group[-1].finish is not None
                yield merged(group)
                if finished:
                    return
        finally:
            if not finished:  # cancelled or closed by the consumer: free the row at the next step
                self._abort(handle)

    async def score(self, request: ScoreRequest) -> ScoreOutput:
        """Scored on the decode thread between two steps (a forward per completion, like a prefill): the
        weights cannot change under it, and every completion sees the same version."""
        check_score_request(request, self._limits)
        torch_sampling.check_temperature(request.params.temperature)
        self._check_running(dead_too=False)
        self._check_adapter(request.adapter)
        job = ScoreJob(request)
        with self._cv:
            if self._dead is not None:
                raise self._dead_error()
            self._live_scores.add(job)
            self._scores.append(job)
            self._cv.notify_all()
        # Cancelling the caller cancels the job's future: the decode thread then skips it.
        return await asyncio.wrap_future(job.future)

    async def update_weights(self, version: int, checkpoint_dir: Path) -> int:
        self._check_running()
        tensors = await asyncio.to_thread(self._read_checkpoint, checkpoint_dir)
        return await self._submit_update(version, tensors)

    async def update_weights_from_tensors(self, version: int, tensors: dict[str, Tensor], label: str) -> int:
        """update_weights for tensors already in memory (a push received by server/weights/stream.py),
        with the same checks; `label` names them in errors. The dict is consumed: its tensors become
        the checked (and cast) ones, so the update holds one copy of the weights, not two."""
        self._check_running()
        checked = await asyncio.to_thread(self._checked, tensors, label)
        return await self._submit_update(version, checked)

    async def apply_weight_patches(
        self, version: int, patches: list, digests: dict[str, str], label: str
    ) -> int:
        """Checked off the decode thread (every tensor's result against its digest: nothing changes on a
        refusal), then written in place between two steps."""
        self._check_running()
        check = torch_weights.prepared_patches
        prepared = await asyncio.to_thread(check, self._model, patches, digests, label)
        return await self._submit_update(version, {}, lambda: torch_weights.apply_patches(prepared))

    async def add_adapter(self, ref: AdapterRef, weights: LoraWeights) -> None:
        """Checked and cast off the decode thread, installed on it between two steps (nothing pauses)."""
        if self._lora is None:
            raise RuntimeError("engine not started")
        pairs = await asyncio.to_thread(self._lora.prepare, ref, weights)
        await self._submit_update(-1, {}, lambda: self._lora.install(ref, pairs))

    async def remove_adapter(self, ref: AdapterRef) -> None:
        if self._lora is None:
            raise RuntimeError("engine not started")
        self._lora.check(ref)
        await self._submit_update(-1, {}, lambda: self._remove_adapter(ref))

    async def _submit_update(self, version: int, tensors: dict[str, Tensor], call=None) -> int:
        update = Update(int(version), tensors, call)
        with self._cv:
            if self._dead is not None:
                raise self._dead_error()
            self._live_updates = [u for u in self._live_updates if not u.future.done()] + [update]
            self._updates.append(update)
            self._cv.notify_all()
        return await asyncio.wrap_future(update.future)

    # ---- asyncio side helpers -------------------------------------------------------------------

    def _validate(self, request: EngineRequest) -> None:
        """Cheap checks that keep a bad request from failing inside the shared batch (the pipeline has
        already validated; this is the engine's own guard)."""
        check_request(request, self._limits)
        torch_sampling.check_temperature(request.params.temperature)
        self._check_adapter(request.adapter)

    def _check_adapter(self, ref: AdapterRef | None) -> None:
        if ref is not None and self._lora is not None:  # not started: the caller says so next
            self._lora.check(ref)

    def _check_running(self, dead_too: bool = True) -> None:
        if self._thread is None:
            raise RuntimeError("engine not started")
        if dead_too and self._dead is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDead:
        return EngineDead(f"the torch engine is out of service ({self._dead}); restart the replica")

    def _die(self, reason: str) -> None:
        """The engine serves no more: fail everything queued or running, refuse what comes. Callable from
        either side (a stuck decode thread is declared dead from the event loop)."""
        with self._cv:
            if self._dead is not None:
                return
            self._dead = reason
            self._pending.clear()
            self._updates.clear()
            self._scores.clear()
            handles, updates = list(self._live), list(self._live_updates)
            scores = list(self._live_scores)
            self._cv.notify_all()
        log.error("torch engine: %s; failing %d requests, refusing new ones", reason, len(handles))
        err = self._dead_error()
        for handle in handles:
            self._finish(handle, err)
        for job in [*updates, *scores]:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                job.future.set_exception(err)

    def _abort(self, handle: Handle) -> None:
        with self._cv:
            if handle in self._pending:
                self._pending.remove(handle)
                self._release([handle])
            elif not handle.done:
                self._cancelled.add(handle)
                self._cv.notify_all()

    # ---- checkpoint loading (torch_weights) ------------------------------------------------------

    def _read_checkpoint(self, checkpoint) -> dict[str, Tensor]:
        """All tensors of the checkpoint (a `weights.Checkpoint`, or a trusted directory), checked. Runs
        off the decode thread and changes nothing, so a bad checkpoint leaves the model as it was."""
        return self._checked(*torch_weights.read_checkpoint(checkpoint))

    def _checked(self, tensors: dict[str, Tensor], label: str) -> dict[str, Tensor]:
        return torch_weights.checked(self._model, tensors, label, self._device)

    # ---- decode thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._threads:
                torch.set_num_threads(self._threads)
            with torch.no_grad():
                self._loop()
        except BaseException as exc:  # outside any one request: the engine cannot go on
            log.critical("torch engine: the decode loop died", exc_info=True)
            self._die(f"the decode loop died: {type(exc).__name__}: {exc}")
        finally:
            self._beat = None

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._beat = None  # waiting for work is not a stall
                while not (
                    self._stopping
                    or self._dead is not None
                    or self._updates
                    or self._cancelled
                    or self._scores
                    or self._batch.rows
                    or (self._pending and len(self._batch) < self._max_batch)
                ):
                    self._cv.wait()
                if self._stopping or self._dead is not None:
                    return
                self._beat = time.monotonic()
                updates, self._updates = self._updates, []
                cancelled, self._cancelled = self._cancelled, set()
                scores = list(self._scores)
                self._scores.clear()
                room = self._max_batch - len(self._batch) + len(cancelled & set(self._batch.rows))
                admit = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            for update in updates:
                self._apply_update(update)
            for job in scores:
                self._score(job)
            if cancelled:
                try:
                    self._drop(cancelled)
                except Exception as exc:  # the batch's cache is in an unknown state: end its requests
                    self._fail_batch(exc)
            for handle in admit:
                self._admit(handle)
            if self._batch.rows:
                try:
                    self._step()
                except Exception as exc:  # the thread/asyncio boundary: fail the batch, keep serving
                    self._fail_batch(exc)

    def _fail_batch(self, exc: Exception) -> None:
        log.warning("torch engine: a batch of %d requests failed: %r", len(self._batch), exc)
        for handle in self._batch.clear():
            self._finish(handle, exc)

    def _apply_update(self, update: Update) -> None:
        if update.call is not None and update.version < 0:  # an adapter added or removed: its own failure
            if update.future.set_running_or_notify_cancel():  # False: the caller went away first
                try:
                    result = update.call()
                except Exception as exc:
                    update.future.set_exception(exc)
                else:
                    update.future.set_result(result)
            return
        # Between steps: every token sampled after this line sees the new weights and version. The
        # tensors were checked (names, shapes, dtypes, finite) and cast to the parameters' dtype and
        # device when read, and each is a tensor of its own: it becomes the parameter's data (no copy
        # of the model, the old storage is freed). Tied parameters are one Parameter object, so they
        # stay tied. One that fails anyway leaves the weights half-updated, so the engine must stop.
        try:
            if update.call is not None:  # a delta's checked patches, written in place
                update.call()
            params = self._model.state_dict(keep_vars=True)
            for key, t in update.tensors.items():
                params[key].data = t
            # The update stays listed in _live_updates until the next one: without this it would keep a
            # second copy of the weights alive between updates (the steady state would hold two models).
            update.tensors.clear()
        except BaseException as exc:
            update.future.set_exception(EngineDead(f"the weight update failed halfway: {exc}"))
            raise
        self._version = update.version
        with self._cv:
            in_flight = self._num_active
        update.future.set_result(in_flight)

    def _remove_adapter(self, ref: AdapterRef) -> None:
        # Rows still naming it are cancelled ones that the next drop would take out (their streams ended
        # before the adapter table let go of it), or a caller's bug: end them now, so that no forward ever
        # runs a row without its adapter.
        stale = {h for h in self._batch.rows if h.request.adapter == ref}
        for h in stale:
            self._finish(h, ValueError(f"adapter {ref.name!r} was removed while the request sampled"))
        try:
            self._drop(stale)
        except Exception as exc:  # the batch's cache is in an unknown state: end its requests
            self._fail_batch(exc)
        self._lora.remove(ref)

    def _score(self, job: ScoreJob) -> None:
        """Score one request (torch_score); its failure is its own, the engine serves on."""
        try:
            if job.future.cancelled():  # the caller went away before its turn
                return
            r = job.request
            rows = torch_score.score_request(
                self._model, r, self._lora.rows, self._score_work, self._forwarded
            )
            version = self._version if r.adapter is None else r.adapter.version
            out = ScoreOutput(*(list(a) for a in zip(*rows, strict=True)), policy_version=version)
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile
                job.future.set_result(out)
        except Exception as exc:
            log.warning("torch engine: score request %s failed: %r", job.request.request_id, exc)
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                job.future.set_exception(exc)
        finally:
            with self._cv:
                self._live_scores.discard(job)

    def _forward(self, *, rows: list[Handle], **kwargs) -> Tensor:  # [B, V] float32 logits, last positions
        cache = kwargs.pop("cache")
        with self._lora.rows([h.request.adapter for h in rows]):  # each row with its own adapter
            out = self._model(**kwargs, **{self._cache_kw: cache}, use_cache=True)
        self._forwarded()
        return out.logits[:, -1, :].float()

    def _forwarded(self) -> None:  # after each forward: counted, and the loop is not stuck
        self.forward_calls += 1
        self._beat = time.monotonic()

    def _admit(self, handle: Handle) -> None:
        """Prefill alone (no padding, so no fully-masked query rows), sample the first token, then merge
        the row's KV into the batch cache by left-padding whichever side is shorter."""
        try:
            self._admit_one(handle)
        except Exception as exc:  # only this request fails; the batch state is assigned last
            log.warning("torch engine: request %s failed at admission: %r", handle.request.request_id, exc)
            self._finish(handle, exc)

    def _admit_one(self, handle: Handle) -> None:
        from transformers import DynamicCache

        prompt = np.asarray(handle.request.prompt_ids, np.int64)
        ids = torch.as_tensor(prompt, device=self._device)[None]  # [1, P]
        cache = DynamicCache()
        logits = self._forward(rows=[handle], input_ids=ids, cache=cache)  # [1, V]
        handle.cached = ids.shape[1]
        if self._emit([handle], logits):
            return
        self._batch.add(handle, cache, ids.shape[1])

    def _step(self) -> None:
        """One batched decode forward over all rows: input = each row's last sampled token."""
        rows = self._batch.rows
        ids = torch.tensor([[h.next_token] for h in rows], device=self._device)  # [B, 1]
        # [B, 1]: a row's position counts only its real tokens, never the left padding
        positions = torch.tensor([[h.cached] for h in rows], device=self._device)
        mask = self._batch.step_mask()  # [B, S + 1]
        logits = self._forward(
            rows=rows, input_ids=ids, attention_mask=mask, position_ids=positions, cache=self._batch.cache
        )
        self._batch.mask = mask
        self.decode_steps += 1
        for h in rows:
            h.cached += 1
        finished = self._emit(rows, logits)
        if finished:
            self._drop(finished)

    def _emit(self, rows: list[Handle], logits: Tensor) -> set[Handle]:
        """Sample each row from μ = log_softmax(processed(logits)), deliver the token, and return the rows
        that finished (or failed). Rows are grouped by (top_k, top_p) because processed_chunk takes them
        as scalars; every operation is per row, so grouping does not change a row's numbers. A group that
        fails is sampled again row by row: only the row that fails alone ends with the error."""
        groups: dict[tuple[int, float], list[int]] = {}
        for i, h in enumerate(rows):
            groups.setdefault((h.params.top_k, h.params.top_p), []).append(i)
        finished: set[Handle] = set()
        for (top_k, top_p), idx in groups.items():
            try:
                finished |= self._sample(rows, idx, logits, top_k, top_p)
                continue
            except Exception as exc:
                if len(idx) == 1:
                    self._fail_row(rows[idx[0]], exc, finished)
                    continue
            for i in idx:
                try:
                    finished |= self._sample(rows, [i], logits, top_k, top_p)
                except Exception as exc:
                    self._fail_row(rows[i], exc, finished)
        return finished

    def _fail_row(self, handle: Handle, exc: Exception, finished: set[Handle]) -> None:
        log.warning("torch engine: request %s failed while sampling: %r", handle.request.request_id, exc)
        self._finish(handle, exc)
        finished.add(handle)

    def _sample(
        self, rows: list[Handle], idx: list[int], logits: Tensor, top_k: int, top_p: float
    ) -> set[Handle]:
        """Sample rows `idx` (one (top_k, top_p) group) and deliver their tokens; returns the rows that
        finished or failed. Nothing of a row's state changes before every tensor operation succeeded, so
        a group that raises can be sampled again row by row (those rows then draw again from their
        generators: after a failure a seeded row's tokens may differ from a run without it)."""
        temps = [rows[i].params.temperature for i in idx]
        mu, ok = torch_sampling.processed_mu(logits[idx], temps, top_k, top_p, self._work)  # [c, V]
        finished: set[Handle] = set()
        for j, i in enumerate(idx):
            if not ok[j]:
                h = rows[i]
                self._fail_row(
                    h,
                    SamplingError(
                        f"request {h.request.request_id}: the next-token distribution is not finite at "
                        f"completion token {h.generated} (NaN or inf logits: broken weights or "
                        f"activations, or temperature {h.params.temperature:g} overflowing float32)"
                    ),
                    finished,
                )
        good = [j for j in range(len(idx)) if ok[j]]
        if not good:
            return finished
        if len(good) < len(idx):
            idx, mu = [idx[j] for j in good], mu[good]
        kmax = max(rows[i].params.logprobs_k for i in idx)
        d = torch_sampling.draw(mu, [rows[i].generator for i in idx], kmax)
        # Delivery: plain Python, after every tensor operation succeeded.
        for j, i in enumerate(idx):
            h = rows[i]
            k = h.params.logprobs_k
            h.generated += 1
            h.next_token = d.tokens[j]
            finish = None
            if d.tokens[j] in h.params.stop_token_ids:
                finish = "stop"
            elif h.generated >= h.params.max_tokens or h.cached + 1 >= self._limits.max_model_len:
                finish = "length"  # cached + 1 = prompt + completion tokens so far
            tok = SampledToken(
                d.tokens[j],
                d.logprobs[j],
                d.ranks[j],
                d.topk_ids[j, :k].copy(),
                d.topk_logprobs[j, :k].copy(),
                h.version(self._version),
                finish,
            )
            if finish is not None:
                finished.add(h)
                self._finish(h, tok)
            else:
                self._deliver(h, tok)
        return finished

    def _finish(self, handle: Handle, last: SampledToken | BaseException) -> None:
        self._release([handle])  # before delivering: once the consumer sees the end, num_active is down
        self._deliver(handle, last)

    def _release(self, handles: list[Handle]) -> None:
        """Count requests out of num_active exactly once (finish, cancel or failure)."""
        with self._cv:
            for h in handles:
                if not h.done:
                    h.done = True
                    self._num_active -= 1
                    self._live.discard(h)

    def _drop(self, handles: set[Handle]) -> None:
        """Remove rows from the batch (counted out of num_active first) and trim its padding."""
        gone = [h for h in self._batch.rows if h in handles]
        if gone:
            self._release(gone)
            self._batch.remove(handles)

    @staticmethod
    def _deliver(handle: Handle, item: SampledToken | BaseException) -> None:
        # RuntimeError: the consumer's event loop is closed, so nobody is left to read it.
        with contextlib.suppress(RuntimeError):
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)
