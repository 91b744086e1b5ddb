"""The demo's verifiable toy task: make a tiny byte-level model (`maskroll init-model`) write digits.

reward = (number of digit bytes in the completion) / max_tokens. A freshly initialised model writes a
digit by chance a few percent of the time, so reward starts near that chance level and a working RL
loop drives it up within a few minutes on two CPU cores. Prompts are short random phrases; a fixed
held-out set measures the policy before and after training.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np

DIGITS = frozenset(range(ord("0"), ord("9") + 1))  # byte ids (the tokenizer maps byte b to id b)
WORDS = (
    "count",
    "number",
    "sum",
    "digits",
    "total",
    "score",
    "value",
    "amount",
    "code",
    "pin",
    "year",
    "price",
    "age",
    "size",
    "index",
    "step",
    "level",
    "rank",
    "page",
    "line",
)
TEMPLATES = ("{w}:", "the {w} is", "{w} =", "my {w}", "{w}? ", "write the {w}", "{w} -> ", "{w} of {v}")


def digit_reward(completion_ids: np.ndarray, max_tokens: int) -> float:
    """Fraction of the token budget spent on digit bytes."""
    return float(sum(int(t) in DIGITS for t in completion_ids)) / max_tokens


def digit_reward_fn(inp) -> float:
    """digit_reward for the reward stage (`maskroll reward --reward maskroll.recipes.digits:digit_reward_fn`):
    `inp` is a maskroll.rewards.RewardInput; the job's metadata carries max_tokens (grpo.train sets it)."""
    return digit_reward(inp.completion_ids, int(inp.metadata["max_tokens"]))


def prompts(rng: random.Random, count: int) -> list[str]:
    return [rng.choice(TEMPLATES).format(w=rng.choice(WORDS), v=rng.choice(WORDS)) for _ in range(count)]


def encoder(model_dir: str | Path) -> Callable[[str], list[int]]:
    """Text → token ids with the model directory's tokenizer (<bos> first), as the replicas tokenize."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=True).ids


def held_out(count: int = 16, seed: int = 12345) -> list[str]:
    """Prompts the trainer never samples (a different seed; overlaps by chance are harmless)."""
    return prompts(random.Random(seed), count)
