"""Checks a request (Generate, a pull-mode job) against the server's limits; turns it into engine requests.

Pure functions on domain objects (no gRPC, no engine calls): every rule of "bad input never crashes or
wedges the server" lives here, and each failure is an `InvalidArgument` whose message starts with the
offending field's wire name, e.g. "options.temperature must be finite and > 0, got nan". The sampling
option rules themselves are the SDK's (`maskroll.proto.sampling`), applied here with the server's limits.
Also bounded here: metadata (copied into every record of the request) and the Redis stream a request
may publish to (only the replica's own namespace's rollout streams).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from maskroll.proto import sampling
from maskroll.proto.prompts import prompt_problem
from maskroll.proto.records import SamplingOptions
from maskroll.proto.streams import StreamKeys

from ..engines.contract import EngineLimits, EngineRequest, SamplingParams
from ..errors import InvalidArgument

MAX_ID_CHARS = 256  # request / job / group ids end up in Redis keys, logs and metrics
# Metadata is copied into every sample's record (n of them) and into Redis: a few labels, not a payload.
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_VALUE_CHARS = 4096
MAX_METADATA_CHARS = 16384  # keys and values together
# A rollout_stream other than the namespace's own is one below it: maskroll:<ns>:rollouts:<suffix>.
_STREAM_SUFFIX = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class Caps:
    """What a request may ask for: the engine's limits narrowed by the server's configuration."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    max_tokens: int
    max_n: int
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, engine: EngineLimits, *, max_logprobs: int, max_tokens: int, max_n: int) -> Caps:
        return cls(
            vocab_size=engine.vocab_size,
            max_model_len=engine.max_model_len,
            max_logprobs=min(max_logprobs, engine.max_logprobs, engine.vocab_size),
            max_tokens=max_tokens,
            max_n=max_n,
            eos_token_ids=tuple(engine.eos_token_ids),
        )


def check_ids(request_id: str, job_id: str, group_id: str, run_id: str = "") -> None:
    """Ids are copied into every record, Redis key, log line and error message that names the request:
    at most MAX_ID_CHARS printable characters each."""
    for name, value in (
        ("request_id", request_id),
        ("job_id", job_id),
        ("group_id", group_id),
        ("run_id", run_id),
    ):
        if len(value) > MAX_ID_CHARS:
            raise InvalidArgument(f"{name} has {len(value)} characters; at most {MAX_ID_CHARS}")
        if not value.isprintable():
            raise InvalidArgument(f"{name} {value!r} contains non-printable characters")


def check_run_id(run_id: str) -> None:
    """The run id of a weight update (UpdateWeights, PushWeights): the run every later record carries."""
    check_ids("", "", "", run_id)


def check_metadata(metadata: Mapping[str, str]) -> None:
    """Bounded metadata: it is copied into each of a request's n records, so 1 MB in is n MB out."""
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(f"metadata has {len(metadata)} entries; at most {MAX_METADATA_ENTRIES}")
    total = 0
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidArgument(
                f"metadata key {key[:32]!r}... has {len(key)} characters; at most {MAX_METADATA_KEY_CHARS}"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidArgument(
                f"metadata[{key!r}] has {len(value)} characters; at most {MAX_METADATA_VALUE_CHARS}"
            )
        total += len(key) + len(value)
    if total > MAX_METADATA_CHARS:
        raise InvalidArgument(f"metadata has {total} characters in all; at most {MAX_METADATA_CHARS}")


def rollout_stream(name: str, keys: StreamKeys) -> str:
    """The Redis stream a request's records go to: "" = the namespace's rollout stream; otherwise `name`
    must be that stream or one below it (f"{keys.rollouts}:<suffix>", suffix [A-Za-z0-9_.-]{1,64}), or
    a partition's finished stream (the reward stage's input: RolloutQueue(reward_stage=True)).
    Another run's streams, the prompt stream, the dead letters, the done set, a replica's heartbeat or
    any key outside maskroll's are refused: a request must not make a replica write anywhere else."""
    if not name:
        return keys.rollouts
    own = keys.rollouts
    shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
    if name == own or name in (p.finished for p in keys.parts):  # finished: for the reward stage
        return name
    prefix = own + ":"
    if not (name.startswith(prefix) and _STREAM_SUFFIX.fullmatch(name[len(prefix) :])):
        raise InvalidArgument(
            f"rollout_stream {shown} is not one of this replica's rollout streams: give {own!r} or "
            f"{prefix}<name> (name: 1-64 of A-Z a-z 0-9 _ . -), or leave it empty"
        )
    return name


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_prompt(prompt: np.ndarray, caps: Caps) -> None:  # prompt: integer [P]
    problem = prompt_problem(prompt, vocab_size=caps.vocab_size, max_model_len=caps.max_model_len)
    if problem:
        raise InvalidArgument(problem)


def sampling_params(prompt: np.ndarray, o: SamplingOptions, caps: Caps) -> SamplingParams:
    """Validate `o` for `prompt` (int32 [P], already checked) and return the engine's parameters."""
    problems = sampling.problems(
        o,
        n=o.n,
        vocab_size=caps.vocab_size,
        max_tokens=caps.max_tokens,
        max_logprobs=caps.max_logprobs,
        max_n=caps.max_n,
        prompt_len=int(prompt.size),
        max_model_len=caps.max_model_len,
    )
    if problems:
        raise InvalidArgument(f"options.{problems[0]}")
    return SamplingParams(
        max_tokens=o.max_tokens,
        temperature=float(o.temperature),
        top_p=float(o.top_p),
        top_k=max(o.top_k, 0),  # -1 and 0 both mean off; engines and records use 0
        logprobs_k=o.logprobs_k,
        seed=o.seed,
        # One rule for both engines: they stop only on these ids, so the model's EOS is added here.
        stop_token_ids=tuple(
            dict.fromkeys((*o.stop_token_ids, *(() if o.ignore_eos else caps.eos_token_ids)))
        ),
    )


def sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sample i's parameters: seed + i (`sampling_params` checked that seed + n - 1 fits)."""
    return params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)


def engine_requests(
    request_id: str, prompt: np.ndarray, params: SamplingParams, n: int
) -> list[EngineRequest]:
    """One engine request per sample: sample i is f"{request_id}-{i}" with `sample_params(params, i)`."""
    return [
        EngineRequest(request_id=f"{request_id}-{i}", prompt_ids=prompt, params=sample_params(params, i))
        for i in range(n)
    ]
