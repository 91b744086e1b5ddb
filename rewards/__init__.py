"""Reward functions and verifiers for the reward stage (docs/rewards.md): the types every reward function
speaks (`types`), maths answers (`math`), code in a sandbox (`sandbox`, `code`), an LLM judge (`judge`).

Importing this package loads nothing heavy; each verifier imports its own library on first use.
"""

from .types import RewardFn, RewardInput, RewardResult

__all__ = ["RewardFn", "RewardInput", "RewardResult"]
