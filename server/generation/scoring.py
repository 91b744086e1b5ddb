"""The scoring path (the Score RPC, and /v1/score through it): a `ScoreJob` checked against the replica's
limits, one engine call, the result with its semantics.

Every rule is the SDK's (`proto.scoring`: the prompt rule, non-empty completions in the vocabulary that fit
the context, the sampling rules for temperature / top_p / top_k / K) asked with the replica's limits; a
broken one is an `InvalidArgument` naming the wire field ("completion_token_ids[1][3] = 70000 is outside
the vocabulary [0, 259)"). Also bounded here: the number of completions per call (the server's max_n, as
a Generate's samples). Knows nothing of gRPC or HTTP.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from maskroll.proto.records import Semantics
from maskroll.proto.scoring import ScoredTokens, ScoreJob, ScoreResult

from ..engines.contract import AdapterRef, Engine, SamplingParams, ScoreRequest
from ..errors import InvalidArgument, Unimplemented
from . import validation


def engine_request(job: ScoreJob, caps: validation.Caps) -> ScoreRequest:
    """Validate `job` against `caps` and return the engine's request (a fresh request id if it has none)."""
    validation.check_ids(job.request_id, "", "")
    problems = job.problems(vocab_size=caps.vocab_size, max_model_len=caps.max_model_len)
    problems += job.options.problems(vocab_size=caps.vocab_size, max_logprobs=caps.max_logprobs)
    if problems:
        raise InvalidArgument(problems[0])
    if len(job.completions) > caps.max_n:
        raise InvalidArgument(
            f"completion_token_ids has {len(job.completions)} completions; at most {caps.max_n} "
            "(max_n) per call"
        )
    o = job.options
    return ScoreRequest(
        request_id=job.request_id or validation.new_request_id(),
        prompt_ids=np.asarray(job.prompt_ids, np.int32),
        completions=tuple(np.asarray(c, np.int32) for c in job.completions),
        params=SamplingParams(
            max_tokens=max(int(c.size) for c in job.completions),
            temperature=float(o.temperature),
            top_p=float(o.top_p),
            top_k=max(o.top_k, 0),  # -1 and 0 both mean off; engines and semantics use 0
            logprobs_k=o.logprobs_k,
        ),
    )


async def score(
    engine: Engine, job: ScoreJob, caps: validation.Caps, adapter: AdapterRef | None = None
) -> ScoreResult:
    """Validate, score every completion in one engine call, and say which μ the numbers describe.
    adapter: score under base + this LoRA adapter (the caller holds it in use: `AdapterTable.use`)."""
    request = engine_request(job, caps)
    if adapter is not None:
        request = replace(request, adapter=adapter)
    try:
        out = await engine.score(request)
    except NotImplementedError as e:
        raise Unimplemented(str(e)) from e
    except ValueError as e:  # the engine's own guard (vLLM: a temperature it cannot score at), as fanout's
        raise InvalidArgument(f"the {engine.name} engine refused the request: {e}") from e
    p = request.params
    return ScoreResult(
        request_id=request.request_id,
        completions=[
            ScoredTokens(lp, r, i, v)
            for lp, r, i, v in zip(out.logprobs, out.ranks, out.topk_ids, out.topk_logprobs, strict=True)
        ],
        semantics=Semantics(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            logprobs_k=p.logprobs_k,
            engine=engine.name,
            engine_version=engine.version,
            model=engine.model_id,
        ),
        policy_version=out.policy_version,
    )
