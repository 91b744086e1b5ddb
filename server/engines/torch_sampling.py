"""The torch engine's sampler: μ of a decode step's rows, the tokens drawn from it, their logprobs, ranks
and top-K, and the sampled tokens merged into the contract's outputs.

μ = log_softmax(processed_chunk(ℓ, T, top_k, top_p)) (docs/math.md §6: temperature, then top-k, then top-p,
as vLLM), the very operations `torch_score` runs to score given tokens. Plain functions on tensors; the
engine calls them on its decode thread (`torch_engine.TorchEngine._sample`), groups its rows by (top_k,
top_p) because processed_chunk takes them as scalars, and decides what a failing row means. Knows nothing
of requests, queues or transports.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from maskroll.trainer_adapter.processed import Workspace, processed_chunk

from .contract import EngineOutput

Tensor = torch.Tensor

# μ is computed in float32 whatever the model's dtype (the engine upcasts the logits): ℓ / T must stay
# finite for every logit a model produces. Logits beyond ±1e4 do not occur in practice, so a temperature
# below 1e4 / float32 max (≈ 2.9e-35) is refused; a row that overflows anyway fails alone (SamplingError).
MAX_LOGIT = 1e4
MIN_TEMPERATURE = MAX_LOGIT / torch.finfo(torch.float32).max


class SamplingError(RuntimeError):
    """One request's next-token distribution is not a distribution (NaN or +inf logits)."""


def check_temperature(t: float) -> None:
    if t < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature must be >= {MIN_TEMPERATURE:.3g} for the torch engine, got {t:g}: it computes the "
            f"processed logits ℓ / T in float32, where a smaller T overflows for logits up to ±{MAX_LOGIT:g}"
        )


def processed_mu(
    logits: Tensor, temperatures: list[float], top_k: int, top_p: float, work: Workspace
) -> tuple[Tensor, list[bool]]:
    """(μ [c, V] of the rows' logits [c, V], whether each row's μ is a distribution). A valid row's
    largest log μ is finite (≥ -log V); NaN or +inf logits make it NaN (amax propagates NaN): such a row
    must fail alone rather than make multinomial fail the whole group."""
    temp = torch.tensor(temperatures, dtype=torch.float64, device=logits.device)  # [c]
    x = processed_chunk(logits, temp, top_k, top_p, work)  # [c, V], reused buffer
    mu = x.log_softmax(dim=-1)  # [c, V]
    return mu, torch.isfinite(mu.amax(dim=-1)).tolist()


@dataclass
class Draw:
    """The tokens drawn from c rows of μ, as plain values (the delivery is plain Python)."""

    tokens: list[int]  # [c]
    logprobs: list[float]  # [c]: log μ of each sampled token
    ranks: list[int]  # [c]: vLLM's convention, tokens with μ at least the sampled one's (ties rank lower)
    topk_ids: np.ndarray  # int32 [c, kmax], sorted by rank
    topk_logprobs: np.ndarray  # float32 [c, kmax]


def draw(mu: Tensor, generators: list[torch.Generator], kmax: int) -> Draw:
    """One token per row of μ [c, V] (each row with its own generator, so a seed fixes its tokens whatever
    the batch), with its logprob, rank and the top `kmax` of its row."""
    probs = mu.exp()
    tokens = torch.cat([torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(generators)])  # [c]
    sampled = mu.gather(1, tokens[:, None])  # [c, 1]
    ranks = (mu >= sampled).sum(dim=1)  # [c]
    top = mu.topk(kmax, dim=-1, sorted=True)  # [c, kmax]
    return Draw(
        tokens.tolist(),
        sampled[:, 0].tolist(),
        ranks.tolist(),
        top.indices.to(torch.int32).cpu().numpy(),
        top.values.cpu().numpy(),
    )


@dataclass
class SampledToken:
    """One sampled token as the decode thread hands it to the request's stream."""

    token: int
    logprob: float
    rank: int
    topk_ids: np.ndarray  # int32 [K]
    topk_logprobs: np.ndarray  # float32 [K]
    version: int
    finish: str | None


def merged(rows: list[SampledToken]) -> EngineOutput:
    """Consecutive tokens of one policy version as one output."""
    return EngineOutput(
        token_ids=np.array([r.token for r in rows], np.int32),
        sampled_logprobs=np.array([r.logprob for r in rows], np.float32),
        sampled_ranks=np.array([r.rank for r in rows], np.int32),
        topk_ids=np.stack([r.topk_ids for r in rows]),  # [t, K], also for K = 0
        topk_logprobs=np.stack([r.topk_logprobs for r in rows]),
        policy_version=rows[0].version,
        finish_reason=rows[-1].finish,
    )
