"""vLLM's outputs → the engine contract's arrays. Pure numpy: imports no vllm, so it is tested everywhere
(tests/server/test_vllm_conversion.py) on the data vLLM 0.32 produces.

Owns: vLLM's per-position flat logprobs → the sampled token's logprob and rank plus exactly-K top-K
arrays sorted by rank (`logprob_arrays`); vLLM's (weight version, first token) spans → each token's
policy version and the runs of one version an `EngineOutput` may hold (`token_versions`,
`split_by_version`), and so the contract's outputs of a request's new tokens (`versioned_outputs`; the live
spans read off a running request, `live_version_starts`); vLLM's finish reasons → the contract's. Running
the engine is `vllm_engine`'s.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from .contract import EngineOutput


def logprob_arrays(logprobs: Any, n: int, k: int) -> tuple[np.ndarray, ...]:
    """vLLM's logprobs for `n` new tokens -> (sampled [n], ranks [n], topk_ids [n, K], topk_lp [n, K]).

    We ask for `flat_logprobs=True`: a position then holds 1 + K entries, the sampled token first with
    its true rank (the count of logprobs >= its own, so ties rank pessimistically), then the top K by
    descending logprob with positional ranks 1..K (vllm/logprobs.py append_logprobs_for_next_position,
    v1/sample/sampler.py gather_logprobs). The split is positional, so the sampled entry never leaks
    into the top-K arrays.

    Shim: when the consumer lags, vLLM merges DELTA outputs (v1/engine/output_processor.py
    RequestOutputCollector.put -> outputs.py RequestOutput.add), and FlatLogprobs.extend re-appends each
    merged position through a {token_id: Logprob} dict. A sampled token that is also in the top-K then
    collapses into one entry carrying its top-K position as rank: K entries instead of K + 1. Such
    positions are rebuilt from the ranks; the sampled rank is recounted over the top-K, which equals
    vLLM's count unless ties straddle the K-th entry.
    """
    width = k + 1
    if len(logprobs) != n:
        raise RuntimeError(f"vLLM returned logprobs for {len(logprobs)} positions, expected {n}")
    if len(logprobs.token_ids) == n * width:  # every position has 1 + K entries: vectorised
        ids = np.asarray(logprobs.token_ids, np.int32).reshape(n, width)  # [n, 1 + K]
        values = np.asarray(logprobs.logprobs, np.float32).reshape(n, width)  # [n, 1 + K]
        ranks = np.asarray(logprobs.ranks[::width], np.int32)  # [n]
        return (
            values[:, 0].copy(),
            ranks,
            np.ascontiguousarray(ids[:, 1:]),
            np.ascontiguousarray(values[:, 1:]),
        )
    sampled, ranks = np.empty(n, np.float32), np.empty(n, np.int32)
    topk_ids, topk_lp = np.empty((n, k), np.int32), np.empty((n, k), np.float32)
    for i, (a, b) in enumerate(zip(logprobs.start_indices, logprobs.end_indices, strict=True)):
        tok = np.asarray(logprobs.token_ids[a:b], np.int32)
        val = np.asarray(logprobs.logprobs[a:b], np.float32)
        sampled[i] = val[0]
        if b - a == width:
            ranks[i], topk_ids[i], topk_lp[i] = logprobs.ranks[a], tok[1:], val[1:]
        elif b - a == k:  # the sampled entry is one of the top K
            order = np.argsort(np.asarray(logprobs.ranks[a:b]), kind="stable")
            topk_ids[i], topk_lp[i] = tok[order], val[order]
            ranks[i] = int(np.count_nonzero(topk_lp[i] >= val[0]))
        else:
            raise RuntimeError(
                f"vLLM returned {b - a} logprob entries at position {i}, expected {k} or {width}"
            )
    return sampled, ranks, topk_ids, topk_lp


def token_versions(starts: list[tuple[str, int]], first: int, n: int) -> np.ndarray:
    """Policy version of completion tokens [first, first + n) from (version, first token index) spans."""
    out = np.empty(n, np.int64)
    idx = np.arange(first, first + n)
    for version, start in starts:  # spans are in token order; later ones overwrite earlier ones
        out[idx >= start] = int(version)
    if starts and first < starts[0][1]:
        raise RuntimeError(f"vLLM weight-version spans {starts} do not cover token {first}")
    return out


def split_by_version(versions: np.ndarray) -> list[tuple[int, int, int]]:  # versions [n]
    """(start, end, version) runs of equal version: one EngineOutput never spans two versions."""
    cuts = np.flatnonzero(np.diff(versions)) + 1
    bounds = [0, *cuts.tolist(), len(versions)]
    return [(a, b, int(versions[a])) for a, b in itertools.pairwise(bounds)]


def versioned_outputs(
    held: list[tuple[np.ndarray, ...]],
    starts: list[tuple[str, int]] | None,
    done: int,
    fixed: int | None,
    finish: str | None,
    request_id: str,
) -> list[EngineOutput]:
    """The contract's outputs of the tokens `held` (converted deltas, each (ids, sampled, ranks, topk_ids,
    topk_lp)) that follow the `done` tokens already emitted: one per run of one policy version, read from
    vLLM's (version, first token) spans `starts` — or all `fixed` (an adapter's version) —, the last one
    carrying `finish`."""
    # One delta and one weight version are the common case (one token per step, no update): skip the
    # joins and the per-token version array, ~10 µs a token.
    arrays = held[0] if len(held) == 1 else tuple(np.concatenate(a) for a in zip(*held, strict=True))
    total = len(arrays[0])
    if fixed is not None:
        runs = [(0, total, fixed)]
    elif not starts:
        raise RuntimeError(f"vLLM reported no weight version for request {request_id}")
    elif starts[-1][1] <= done:  # the last span covers every new token: one version
        runs = [(0, total, int(starts[-1][0]))]
    else:
        runs = split_by_version(token_versions(starts, done, total))
    return [
        EngineOutput(
            token_ids=arrays[0][a:b],
            sampled_logprobs=arrays[1][a:b],
            sampled_ranks=arrays[2][a:b],
            topk_ids=arrays[3][a:b],
            topk_logprobs=arrays[4][a:b],
            policy_version=version,
            finish_reason=finish if i == len(runs) - 1 else None,
        )
        for i, (a, b, version) in enumerate(runs)
    ]


def live_version_starts(llm: Any, request_id: str) -> list[tuple[str, int]] | None:
    """Shim: the (version, first token index) spans vLLM has recorded so far for a running request.

    vLLM 0.32 stamps each engine step with the weight version (v1/engine/core.py
    _attach_weight_version) and the output processor records per-request spans
    (v1/engine/output_processor.py RequestState.track_weight_version), but a DELTA RequestOutput
    exposes them only on its final output (outputs.py CompletionOutput.weight_versions). Intermediate
    deltas read the live spans; None once the request has left the output processor."""
    op = llm.output_processor
    internal = op.external_req_ids.get(request_id)
    state = op.request_states.get(internal[0]) if internal else None
    return None if state is None else list(state.weight_version_starts)


def finish_reason(reason: str | None) -> str | None:
    if reason is None or reason in ("stop", "length", "abort"):
        return reason
    raise RuntimeError(f"vLLM finished the request with {reason!r}")


def prompt_logprob_arrays(logprobs: Any, first: int, n: int, k: int) -> tuple[np.ndarray, ...]:
    """vLLM's flat prompt logprobs of prompt positions [first, first + n) -> (given [n], ranks [n],
    topk_ids [n, K], topk_lp [n, K]), as `logprob_arrays` for sampled tokens.

    Every prompt position but the first (None: nothing predicts it) holds exactly 1 + K entries, the
    prompt token first with its rank (the count of logprobs >= its own), then the top K: prompt logprobs
    are appended once per position with `append_fast`, never merged through a dict (v1/engine/logprobs.py
    LogprobsProcessor._update_prompt_logprobs -> logprobs.py append_logprobs_for_next_position)."""
    width = k + 1
    if first < 1 or first + n > len(logprobs):
        raise RuntimeError(
            f"vLLM returned prompt logprobs for {len(logprobs)} positions, need [{first}, {first + n})"
        )
    a, b = logprobs.start_indices[first], logprobs.end_indices[first + n - 1]
    if b - a != n * width:
        raise RuntimeError(
            f"vLLM returned {b - a} prompt logprob entries for {n} positions, expected {n * width}"
        )
    ids = np.asarray(logprobs.token_ids[a:b], np.int32).reshape(n, width)  # [n, 1 + K]
    values = np.asarray(logprobs.logprobs[a:b], np.float32).reshape(n, width)  # [n, 1 + K]
    ranks = np.asarray(logprobs.ranks[a:b:width], np.int32)  # [n]
    return values[:, 0].copy(), ranks, np.ascontiguousarray(ids[:, 1:]), np.ascontiguousarray(values[:, 1:])
