"""The torch engine's Score: given tokens scored under the processed distribution μ, a forward per completion.

μ = log_softmax(processed_chunk(ℓ, T, top_k, top_p)) (docs/math.md §6), the very operations the engine's
sampler runs on a decode step's logits (`torch_sampling`): so the score of a token the
engine sampled is the record's logprob, rank and top-K up to the float rounding of a full forward against
a cached decode. The rank is the sampler's too: the number of tokens whose μ is at least the given one's.

Plain functions on a model and tensors; the engine calls them on its decode thread (the model and its
weights are the decode thread's). Knows nothing of requests, queues or transports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from maskroll.trainer_adapter.processed import Workspace, processed_chunk

from .contract import ScoreRequest

Tensor = torch.Tensor

# Rows of [rows, V] processed at a time: bounds the workspace to CHUNK_ROWS × V floats (151 936 × 256 ×
# 4 B ≈ 156 MB at Qwen's vocabulary) whatever the completion's length.
CHUNK_ROWS = 256


def completion_logits(model: torch.nn.Module, prompt: np.ndarray, completion: np.ndarray) -> Tensor:
    """[T, V] float32 raw logits predicting each completion token: one forward over prompt + completion
    minus its last token (no KV cache), keeping only the last T positions' logits.

    Args:
        prompt: int [P], P >= 1.
        completion: int [T], T >= 1.
    """
    device = next(model.parameters()).device
    ids = np.concatenate([np.asarray(prompt, np.int64), np.asarray(completion, np.int64)[:-1]])
    x = torch.as_tensor(ids, device=device)[None]  # [1, P + T - 1]
    t = int(completion.size)
    out = model(input_ids=x, use_cache=False, logits_to_keep=t)
    return out.logits[0, -t:, :].float()  # [T, V]


def score_logits(
    logits: Tensor,  # [T, V] raw logits, float
    targets: Tensor,  # [T] int64, the given tokens
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    k: int,
    work: Workspace,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(log μ of each target [T] float32, its rank [T] int32, top-K ids [T, K] int32, top-K log μ [T, K]
    float32) under μ = log_softmax(ℓ / T, then top-k, then top-p), K sorted by rank. A target truncation
    removed has log μ = -inf and rank V (every token's μ is at least 0)."""
    n = logits.shape[0]
    targets = targets.to(logits.device)
    lps, ranks, ids, vals = [], [], [], []
    for a in range(0, n, CHUNK_ROWS):
        sub = logits[a : a + CHUNK_ROWS]  # [c, V]
        temp = torch.full((sub.shape[0],), float(temperature), dtype=torch.float64, device=sub.device)
        mu = processed_chunk(sub, temp, top_k, top_p, work).log_softmax(dim=-1)  # [c, V]
        given = mu.gather(1, targets[a : a + CHUNK_ROWS, None])  # [c, 1]
        ranks.append((mu >= given).sum(dim=1))  # [c]
        lps.append(given[:, 0])
        top = mu.topk(k, dim=-1, sorted=True)  # [c, K]
        ids.append(top.indices)
        vals.append(top.values)
    return (
        torch.cat(lps).cpu().numpy().astype(np.float32),
        torch.cat(ranks).cpu().numpy().astype(np.int32),
        torch.cat(ids).cpu().numpy().astype(np.int32).reshape(n, k),
        torch.cat(vals).cpu().numpy().astype(np.float32).reshape(n, k),
    )


def score_completion(
    model: torch.nn.Module,
    prompt: np.ndarray,  # int [P]
    completion: np.ndarray,  # int [T]
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    k: int,
    work: Workspace,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`score_logits` of one completion's forward (shapes there). μ of a row that is not a distribution
    (NaN or inf logits) raises, as sampling such a row does."""
    logits = completion_logits(model, prompt, completion)  # [T, V]
    if not bool(torch.isfinite(logits.amax(dim=-1)).all()):  # amax propagates NaN
        raise RuntimeError("the next-token distribution is not finite (NaN or +inf logits)")
    targets = torch.as_tensor(np.asarray(completion, np.int64))
    return score_logits(logits, targets, temperature=temperature, top_k=top_k, top_p=top_p, k=k, work=work)


def score_request(
    model: torch.nn.Module,
    request: ScoreRequest,
    adapter_rows: Callable[[list], contextlib.AbstractContextManager],
    work: Workspace,
    forwarded: Callable[[], None],
) -> list[tuple[np.ndarray, ...]]:
    """Every completion of `request` scored (`score_completion`), each forward under the request's adapter
    (`adapter_rows([adapter])`: the engine's LoRA hooks for a batch of that one row), `forwarded()` called
    after each one (the engine counts forwards and watches for a stuck loop)."""
    p = request.params
    rows = []
    for completion in request.completions:
        with adapter_rows([request.adapter]):
            rows.append(
                score_completion(
                    model,
                    request.prompt_ids,
                    completion,
                    temperature=p.temperature,
                    top_k=p.top_k,
                    top_p=p.top_p,
                    k=p.logprobs_k,
                    work=work,
                )
            )
        forwarded()
    return rows
