"""The Score half of the protobuf ⇄ domain converter (`wire` re-exports it, so callers import one
converter): a Score request (`score_request` / `score_from_pb`: the prompt and completions as packed int32
ids, the scoring options with protobuf's unset fields at their defaults) and its response
(`score_result_to_pb` / `score_result_from_pb`: per completion its tokens' logprobs, ranks and top-K, with
the Semantics they were computed under). Decoding validates lengths and shapes (`WireError`).
"""

from __future__ import annotations

import numpy as np

from ._generated import rollout_pb2 as pb
from .scoring import ScoredTokens, ScoreJob, ScoreOptions, ScoreResult
from .wire_base import _F32, _I32, WireError, pack, semantics_from_pb, semantics_to_pb, unpack


def _int32_ids(data: bytes, what: str) -> np.ndarray:  # -> int32 [n]
    if len(data) % 4:
        raise WireError(f"{what}: {len(data)} bytes is not a whole number of int32")
    return unpack(data, _I32, (len(data) // 4,), what)


def score_request(job: ScoreJob, namespace: str = "") -> pb.ScoreRequest:
    """namespace: score under that namespace's current LoRA adapter ("": the replica's own namespace)."""
    o = job.options
    return pb.ScoreRequest(
        prompt_token_ids=pack(np.asarray(job.prompt_ids), _I32),
        completion_token_ids=[pack(np.asarray(c), _I32) for c in job.completions],
        logprobs_k=o.logprobs_k,
        temperature=o.temperature,
        top_p=o.top_p,
        top_k=o.top_k,
        request_id=job.request_id,
        namespace=namespace,
    )


def score_from_pb(m: pb.ScoreRequest) -> ScoreJob:
    return ScoreJob(
        prompt_ids=_int32_ids(m.prompt_token_ids, "prompt_token_ids"),
        completions=tuple(
            _int32_ids(c, f"completion_token_ids[{i}]") for i, c in enumerate(m.completion_token_ids)
        ),
        options=ScoreOptions(
            logprobs_k=m.logprobs_k,
            temperature=m.temperature if m.HasField("temperature") else 1.0,
            top_p=m.top_p if m.HasField("top_p") else 1.0,
            top_k=m.top_k if m.HasField("top_k") else 0,
        ),
        request_id=m.request_id,
    )


def score_result_to_pb(r: ScoreResult) -> pb.ScoreResponse:
    return pb.ScoreResponse(
        request_id=r.request_id,
        completions=[
            pb.ScoredCompletion(
                logprobs=pack(c.logprobs, _F32),
                ranks=pack(c.ranks, _I32),
                topk_ids=pack(c.topk_ids, _I32),
                topk_logprobs=pack(c.topk_logprobs, _F32),
                num_tokens=c.num_tokens,
            )
            for c in r.completions
        ],
        semantics=semantics_to_pb(r.semantics),
        policy_version=r.policy_version,
    )


def score_result_from_pb(m: pb.ScoreResponse) -> ScoreResult:
    k = m.semantics.logprobs_k
    completions = []
    for i, c in enumerate(m.completions):
        t, what = c.num_tokens, f"completions[{i}]"
        completions.append(
            ScoredTokens(
                logprobs=unpack(c.logprobs, _F32, (t,), f"{what}.logprobs"),
                ranks=unpack(c.ranks, _I32, (t,), f"{what}.ranks"),
                topk_ids=unpack(c.topk_ids, _I32, (t, k), f"{what}.topk_ids"),
                topk_logprobs=unpack(c.topk_logprobs, _F32, (t, k), f"{what}.topk_logprobs"),
            )
        )
    return ScoreResult(
        request_id=m.request_id,
        completions=completions,
        semantics=semantics_from_pb(m.semantics),
        policy_version=m.policy_version,
    )
