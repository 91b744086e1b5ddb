"""Checks a Generate request against the server's limits and turns it into engine requests.

Pure functions on domain objects (no gRPC, no engine calls): every rule of "bad input never crashes or
wedges the server" lives here, and each failure is an `InvalidArgument` whose message starts with the
offending field's wire name, e.g. "options.temperature must be finite and > 0, got nan".
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

import numpy as np

from maskroll.client.records import SamplingOptions

from .engine import EngineLimits, EngineRequest, SamplingParams
from .errors import InvalidArgument

MAX_ID_CHARS = 256  # request / job / group ids end up in Redis keys, logs and metrics
MAX_STOP_TOKENS = 1024
MAX_SEED = 2**63 - 1  # engines seed signed 64-bit generators; seed + n - 1 must fit


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


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def check_ids(request_id: str, job_id: str, group_id: str) -> None:
    for name, value in (("request_id", request_id), ("job_id", job_id), ("group_id", group_id)):
        if len(value) > MAX_ID_CHARS:
            raise InvalidArgument(f"{name} has {len(value)} characters; at most {MAX_ID_CHARS}")
        if not value.isprintable():
            raise InvalidArgument(f"{name} {value!r} contains non-printable characters")


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_prompt(prompt: np.ndarray, caps: Caps) -> None:  # prompt: int32 [P]
    if prompt.size == 0:
        raise InvalidArgument("prompt_token_ids is empty; a prompt needs at least one token")
    bad = np.flatnonzero((prompt < 0) | (prompt >= caps.vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgument(
            f"prompt_token_ids[{i}] = {int(prompt[i])} is outside the vocabulary [0, {caps.vocab_size})"
            f" ({bad.size} such ids)"
        )
    if prompt.size >= caps.max_model_len:
        raise InvalidArgument(
            f"prompt_token_ids has {prompt.size} tokens; the model's context (max_model_len "
            f"{caps.max_model_len}) leaves no room for a completion"
        )


def sampling_params(prompt: np.ndarray, o: SamplingOptions, caps: Caps) -> SamplingParams:
    """Validate `o` for `prompt` (int32 [P], already checked) and return the engine's parameters."""
    if not (_finite(o.temperature) and o.temperature > 0):
        raise InvalidArgument(
            f"options.temperature must be finite and > 0, got {o.temperature} (there is no greedy mode: "
            "the record's logprobs must describe a distribution)"
        )
    if not (_finite(o.top_p) and 0 < o.top_p <= 1):
        raise InvalidArgument(f"options.top_p must be in (0, 1], got {o.top_p}")
    if o.top_k < -1 or o.top_k > caps.vocab_size:
        raise InvalidArgument(
            f"options.top_k must be in [1, {caps.vocab_size}] (vocabulary size), or 0 / -1 for off; "
            f"got {o.top_k}"
        )
    if o.max_tokens < 1:
        raise InvalidArgument(f"options.max_tokens must be >= 1, got {o.max_tokens}")
    if o.max_tokens > caps.max_tokens:
        raise InvalidArgument(
            f"options.max_tokens = {o.max_tokens} exceeds the server's limit {caps.max_tokens}"
        )
    if prompt.size + o.max_tokens > caps.max_model_len:
        raise InvalidArgument(
            f"options.max_tokens = {o.max_tokens} with a {prompt.size}-token prompt exceeds the model's "
            f"context: {prompt.size} + {o.max_tokens} > max_model_len {caps.max_model_len}"
        )
    if not 0 <= o.logprobs_k <= caps.max_logprobs:
        raise InvalidArgument(f"options.logprobs_k must be in [0, {caps.max_logprobs}], got {o.logprobs_k}")
    if not 1 <= o.n <= caps.max_n:
        raise InvalidArgument(f"options.n must be in [1, {caps.max_n}] (0 means 1), got {o.n}")
    if o.seed is not None and o.seed + o.n - 1 > MAX_SEED:
        raise InvalidArgument(f"options.seed = {o.seed}: seed + n - 1 must be <= {MAX_SEED}")
    if len(o.stop_token_ids) > MAX_STOP_TOKENS:
        raise InvalidArgument(
            f"options.stop_token_ids has {len(o.stop_token_ids)} ids; at most {MAX_STOP_TOKENS}"
        )
    for i, t in enumerate(o.stop_token_ids):
        if not 0 <= t < caps.vocab_size:
            raise InvalidArgument(
                f"options.stop_token_ids[{i}] = {t} is outside the vocabulary [0, {caps.vocab_size})"
            )
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


def engine_requests(
    request_id: str, prompt: np.ndarray, params: SamplingParams, n: int
) -> list[EngineRequest]:
    """One engine request per sample: sample i is f"{request_id}-{i}" and uses seed + i."""
    out = []
    for i in range(n):
        seed = None if params.seed is None else params.seed + i
        p = params if seed == params.seed else SamplingParams(**{**params.__dict__, "seed": seed})
        out.append(EngineRequest(request_id=f"{request_id}-{i}", prompt_ids=prompt, params=p))
    return out
