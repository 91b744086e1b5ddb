"""What a reward function receives and returns: the one interface between the reward stage
(`maskroll.stages`, `maskroll reward`, `maskroll serve --reward`) and the verifiers of this package.

A reward function is `fn(RewardInput) -> float | RewardResult`, sync or async (an `async def` or a
function returning an awaitable). It scores one finished sample. A verifier's verdict ("wrong answer",
"tests failed", "timed out in the sandbox") is a reward with a reason, not an error; an error means the
function itself failed (it raised, hung past the stage's timeout, or returned something that is not a
finite number) and the stage refuses to invent a reward for that record.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RewardInput:
    """One finished sample, as a reward function sees it.

    prompt / completion: decoded text (the stage decodes with the run's tokenizer, special tokens kept
    out of the completion); prompt_ids [P] / completion_ids [T]: int32 token ids, exactly as sampled;
    metadata: the job's metadata (strings), e.g. the reference answer ("answer") or the tests ("tests");
    finish_reason: "stop" | "length" | "abort"; rollout_id, group_id, sample_index: the record's identity.
    """

    prompt: str
    completion: str
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    metadata: Mapping[str, str] = field(default_factory=dict)
    finish_reason: str = "stop"
    rollout_id: str = ""
    group_id: str = ""
    sample_index: int = 0


@dataclass(frozen=True)
class RewardResult:
    """A reward with its details. verifier: which verifier scored it ("math", "code", "judge", or the
    function's name); reason: why this value (short, human-readable, e.g. "expected 3/4, got 0.75: equal")."""

    reward: float
    verifier: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)):
            raise TypeError(f"RewardResult.reward={self.reward!r}; expected a finite number")
        if not math.isfinite(self.reward):
            raise ValueError(f"RewardResult.reward={self.reward!r}; expected a finite number")


RewardFn = Callable[[RewardInput], "float | RewardResult | Awaitable[float | RewardResult]"]
