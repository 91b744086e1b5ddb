"""Checks a request (Generate, a pull-mode job) against the server's limits; turns it into engine requests.

Pure functions on domain objects (no gRPC, no engine calls): every rule of "bad input never crashes or
wedges the server" lives here, and each failure is an `InvalidArgument` whose message starts with the
offending field's wire name, e.g. "options.temperature must be finite and > 0, got nan". The sampling
option rules themselves are the SDK's (`maskroll.client.sampling`), applied here with the server's limits.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np

from maskroll.client import sampling
from maskroll.client.records import SamplingOptions

from .engine import EngineLimits, EngineRequest, SamplingParams
from .errors import InvalidArgument

MAX_ID_CHARS = 256  # request / job / group ids end up in Redis keys, logs and metrics


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


def check_ids(request_id: str, job_id: str, group_id: str) -> None:
    for name, value in (("request_id", request_id), ("job_id", job_id), ("group_id", group_id)):
        if len(value) > MAX_ID_CHARS:
            raise InvalidArgument(f"{name} has {len(value)} characters; at most {MAX_ID_CHARS}")
        if not value.isprintable():
            raise InvalidArgument(f"{name} {value!r} contains non-printable characters")


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_prompt(prompt: np.ndarray, caps: Caps) -> None:  # prompt: integer [P]
    if prompt.size == 0:
        raise InvalidArgument("prompt_token_ids is empty; a prompt needs at least one token")
    if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):  # a front end's own conversion
        raise InvalidArgument(
            f"prompt_token_ids must be a 1-D array of token ids, got {prompt.dtype} {prompt.shape}"
        )
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
    problems = sampling.problems(
        o,
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
