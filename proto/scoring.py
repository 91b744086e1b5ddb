"""Scoring given tokens (the Score RPC, a teacher): the plain-numpy request and result both sides use.

A score describes the same distribution as a record's logprobs (docs/records.md "Scoring"): μ =
softmax(ℓ / T), then top-k, then top-p, renormalised, at the request's temperature / top_k / top_p; per
completion token the given token's log μ and 1-based rank (the number of tokens whose μ is at least its
own, as a record's sampled rank) and the top-K of μ sorted by rank. Nothing is sampled.

The option rules are `sampling`'s (a score is a sample's options without the sampling): `problems` names
the fields as the wire does. Pure numpy; knows nothing of transports or engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import sampling
from .prompts import prompt_problem
from .records import Semantics


@dataclass(frozen=True)
class ScoreOptions:
    """Which μ to score under, and K. Keeps `sampling.Options` (max_tokens 1, no seed, no stop ids:
    scoring samples nothing), so the one rule set checks it."""

    logprobs_k: int = 20  # K top-K entries per token
    temperature: float = 1.0  # > 0
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 / -1 = off

    max_tokens = 1
    seed = None
    stop_token_ids: tuple[int, ...] = ()

    def problems(self, *, vocab_size: int | None = None, max_logprobs: int | None = None) -> list[str]:
        """Every rule broken, each "<field> <why>" with the wire field's name (n, max_tokens and the
        stop ids are not a score's and always pass)."""
        return sampling.problems(self, n=1, vocab_size=vocab_size, max_logprobs=max_logprobs)


@dataclass(frozen=True)
class ScoreJob:
    """Completions of one prompt to score."""

    prompt_ids: np.ndarray  # int32 [P]
    completions: tuple[np.ndarray, ...]  # int32 [T_i] each
    options: ScoreOptions = field(default_factory=ScoreOptions)
    request_id: str = ""

    def problems(self, *, vocab_size: int | None = None, max_model_len: int | None = None) -> list[str]:
        """The token rules: the prompt rule, non-empty completions of token ids in the vocabulary, and
        P + T_i <= max_model_len (a sequence the model could have produced). Limits left None are not
        checked (the SDK does not know them)."""
        out = []
        p = prompt_problem(np.asarray(self.prompt_ids), vocab_size=vocab_size, max_model_len=max_model_len)
        if p:
            out.append(p)
        if not self.completions:
            out.append("completion_token_ids is empty; give at least one completion to score")
        for i, c in enumerate(self.completions):
            name = f"completion_token_ids[{i}]"
            c = np.asarray(c)
            if c.size == 0:
                out.append(f"{name} is empty; a completion to score needs at least one token")
                continue
            problem = prompt_problem(c, vocab_size=vocab_size, name=name)
            if problem:
                out.append(problem)
            elif max_model_len is not None and self.prompt_ids.size + c.size > max_model_len:
                out.append(
                    f"{name} has {c.size} tokens: with the {self.prompt_ids.size}-token prompt, "
                    f"{self.prompt_ids.size + c.size} > max_model_len {max_model_len}"
                )
        return out


@dataclass
class ScoredTokens:
    """One completion's scores under μ (module docstring)."""

    logprobs: np.ndarray  # float32 [T] log μ of the given token; -inf where truncation removed it
    ranks: np.ndarray  # int32 [T] 1-based
    topk_ids: np.ndarray  # int32 [T, K], sorted by rank
    topk_logprobs: np.ndarray  # float32 [T, K]

    @property
    def num_tokens(self) -> int:
        return int(self.logprobs.shape[0])


@dataclass
class ScoreResult:
    request_id: str
    completions: list[ScoredTokens]  # in the request's order
    semantics: Semantics  # logprobs_mode "processed", the temperature / truncation / K scored under
    policy_version: int  # the weights that scored every completion
