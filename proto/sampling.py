"""The rules for sampling options, in one place: every check of "is this a valid temperature / top_p /
... " in maskroll calls `problems` or `temperature_problem` (pure; imports nothing beyond the stdlib).

Callers: `SamplingOptions.problems()` (the SDK's early check, before a round trip or a queued job), the
server's `validation.sampling_params` (with its limits; it answers INVALID_ARGUMENT with the first
problem), the engines' own guard (`contract.check_request`, on the engine's parameters of one sample as
they are: `Options` is any object with the option fields) and the trainer adapter's semantics check
(temperature only).

Each broken rule is one message "<field> <why>", the field named as in `SamplingOptions`: the server
prefixes "options." so that its message names the wire field. A limit left as None is one the caller
does not know (the SDK does not know the replica's vocabulary); the rule then checks only what holds
for every server, and the server checks the rest.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Protocol

MAX_STOP_TOKENS = 1024
MAX_SEED = 2**63 - 1  # engines seed signed 64-bit generators; seed + n - 1 must fit


def _finite(x: object) -> bool:
    # numbers.Real: numpy scalars count (a trainer's records may carry np.float32 temperatures).
    return isinstance(x, numbers.Real) and math.isfinite(x)


def temperature_problem(t: object) -> str | None:
    """Why `t` cannot be a sampling temperature (None: it can). Records' μ must be a distribution, and
    engines treat temperature → 0 as greedy with unscaled logprobs, so there is no greedy mode."""
    if _finite(t) and t > 0:
        return None
    return (
        f"temperature must be finite and > 0, got {t} (there is no greedy mode: "
        "the record's logprobs must describe a distribution)"
    )


class Options(Protocol):
    """The fields the rules read: a `records.SamplingOptions`, or an engine's parameters of one sample."""

    @property
    def max_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def logprobs_k(self) -> int: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def stop_token_ids(self) -> Sequence[int]: ...


def problems(
    o: Options,
    *,
    n: int,
    vocab_size: int | None = None,
    max_tokens: int | None = None,
    max_logprobs: int | None = None,
    max_n: int | None = None,
    prompt_len: int | None = None,
    max_model_len: int | None = None,
) -> list[str]:
    """Every rule `o` breaks, in a fixed order (the server reports the first), given the limits known.

    n: the samples asked for (a SamplingOptions' `n`; an engine's parameters are of one sample).
    vocab_size bounds top_k and the stop ids; max_tokens, max_logprobs and max_n are the server's caps;
    prompt_len with max_model_len checks that the completion fits the model's context."""
    out = []
    t = temperature_problem(o.temperature)
    if t:
        out.append(t)
    if not (_finite(o.top_p) and 0 < o.top_p <= 1):
        out.append(f"top_p must be in (0, 1], got {o.top_p}")
    if vocab_size is None:
        if o.top_k < -1:
            out.append(f"top_k must be >= -1 (-1 and 0 mean off), got {o.top_k}")
    elif o.top_k < -1 or o.top_k > vocab_size:
        out.append(f"top_k must be in [1, {vocab_size}] (vocabulary size), or 0 / -1 for off; got {o.top_k}")
    if o.max_tokens < 1:
        out.append(f"max_tokens must be >= 1, got {o.max_tokens}")
    elif max_tokens is not None and o.max_tokens > max_tokens:
        out.append(f"max_tokens = {o.max_tokens} exceeds the server's limit {max_tokens}")
    elif prompt_len is not None and max_model_len is not None and prompt_len + o.max_tokens > max_model_len:
        out.append(
            f"max_tokens = {o.max_tokens} with a {prompt_len}-token prompt exceeds the model's context: "
            f"{prompt_len} + {o.max_tokens} > max_model_len {max_model_len}"
        )
    if max_logprobs is None:
        if o.logprobs_k < 0:
            out.append(f"logprobs_k must be >= 0, got {o.logprobs_k}")
    elif not 0 <= o.logprobs_k <= max_logprobs:
        out.append(f"logprobs_k must be in [0, {max_logprobs}], got {o.logprobs_k}")
    if max_n is None:
        if n < 1:
            out.append(f"n must be >= 1, got {n}")
    elif not 1 <= n <= max_n:
        out.append(f"n must be in [1, {max_n}] (0 means 1), got {n}")
    if o.seed is not None and o.seed + n - 1 > MAX_SEED:
        out.append(f"seed = {o.seed}: seed + n - 1 must be <= {MAX_SEED}")
    if len(o.stop_token_ids) > MAX_STOP_TOKENS:
        out.append(f"stop_token_ids has {len(o.stop_token_ids)} ids; at most {MAX_STOP_TOKENS}")
    else:
        top = math.inf if vocab_size is None else vocab_size
        bad = next(((i, t) for i, t in enumerate(o.stop_token_ids) if not 0 <= t < top), None)
        if bad is not None:
            where = "is negative" if vocab_size is None else f"is outside the vocabulary [0, {vocab_size})"
            out.append(f"stop_token_ids[{bad[0]}] = {bad[1]} {where}")
    return out
