"""A task a 135M instruct model can learn on CPU: short arithmetic word problems, generated with answers.

Each problem is one addition or subtraction on numbers up to 10, bare ("What is 7 + 5?") or as a short
word problem ("Mia has 7 pens and gets 5 more. How many pens does Mia have now?"), asked through the
model's chat template with an instruction to answer with the number. The reward is a plain verifier: 1
if the last integer in the completion equals the answer, else 0, so a completion cut off by the token
budget before it states a number scores 0 and the policy is rewarded both for the result and for saying
it early. No data set is downloaded: problems come from a seeded generator; the held-out set comes
from operand pairs training never draws.

Used by `maskroll demo --model smollm2` (`grpo.train(task=QueueTask(...))`) and by the SmolLM2 fidelity
study. Knows nothing of replicas, queues or masks. (The reward issue's `maskroll.rewards.maths` verifier
is more thorough; this one needs only `re`, so the task does not depend on it.)
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NAMES = ("Mia", "Tom", "Ava", "Leo", "Sam", "Zoe", "Max", "Ivy", "Ben", "Amy", "Dan", "Eva")
THINGS = ("apples", "pens", "books", "coins", "cards", "shells", "stickers", "marbles", "eggs", "cookies")
ADD = (
    "What is {a} + {b}?",
    "{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?",
    "{n} had {a} {t}. A friend gave {n} {b} {t}. How many {t} does {n} have?",
    "There are {a} {t} in a box and {b} {t} on the table. How many {t} are there in all?",
)
SUB = (
    "What is {a} - {b}?",
    "{n} has {a} {t} and gives away {b}. How many {t} does {n} have left?",
    "{n} had {a} {t} and lost {b} of them. How many {t} are left?",
)
INSTRUCTION = "Answer with just the number."
SYSTEM = "You are a helpful assistant who solves arithmetic."  # a short system turn: the template's
# default one is ~20 tokens, which every forward pass of the learner would pay for.
NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    text: str
    answer: int


# Operands up to 10: SmolLM2-135M-Instruct (4-bit) answers ~25 % of these greedily within 12 tokens
# (bare "What is a + b?" ~38 %, word problems ~12 %; 16 problems each), so a GRPO group of 4 samples often
# has both a right and a wrong answer, which is what a group advantage needs. With operands to 20 the
# word problems alone were 6 %.
def in_held_out_split(a: int, b: int) -> bool:
    """One operand pair in five belongs to the held-out split; training never draws it. Splitting by the
    numbers, not by the text, keeps "What is 3 + 4?" (only ~150 bare problems exist) out of training."""
    return (7 * a + 3 * b) % 5 == 0


def problem(rng: random.Random, max_operand: int = 10, *, held_out: bool = False) -> Problem:
    while True:
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if in_held_out_split(a, b) == held_out:
            break
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    if rng.random() < 0.5:
        return Problem(rng.choice(ADD).format(n=n, t=t, a=a, b=b), a + b)
    a, b = max(a, b), min(a, b)
    return Problem(rng.choice(SUB).format(n=n, t=t, a=a, b=b), a - b)


def problems(rng: random.Random, count: int) -> list[Problem]:
    return [problem(rng) for _ in range(count)]


HELD_OUT_SEED = 424242


def held_out(count: int = 32, seed: int = HELD_OUT_SEED) -> list[Problem]:
    """A fixed set, drawn with its own seed from the held-out split of operand pairs: disjoint from every
    training problem."""
    rng = random.Random(seed)
    return [problem(rng, held_out=True) for _ in range(count)]


def final_number(text: str) -> int | None:
    found = NUMBER.findall(text)
    return int(found[-1]) if found else None


def verify(completion: str, answer: int) -> float:
    """1.0 if the completion's last integer is the answer, else 0.0."""
    return 1.0 if final_number(completion) == answer else 0.0


class Task:
    """The task bound to one model directory's tokenizer: prompt ids through its chat template, and the
    reward of a completion's token ids."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(self, p: Problem) -> list[int]:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{p.text} {INSTRUCTION}"},
        ]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def reward(self, completion_ids: np.ndarray, p: Problem) -> float:
        return verify(
            self.tokenizer.decode([int(i) for i in completion_ids], skip_special_tokens=True), p.answer
        )

    def rewarder(self, p: Problem) -> Callable[[np.ndarray], float]:
        return lambda ids: self.reward(ids, p)


class QueueTask:
    """The task as the GRPO recipe drives it through the rollout queue (`grpo.train(task=...)`): a prompt
    and the job metadata its records carry (the answer), the reward of a finished record, the held-out
    prompts. The answer travels in the record, so any trainer or reward stage can verify it."""

    def __init__(self, model_dir: str | Path) -> None:
        self.task = Task(model_dir)

    def sample(self, rng: random.Random) -> tuple[list[int], dict[str, str]]:
        p = problem(rng)
        return self.task.encode(p), {"answer": str(p.answer)}

    def reward(self, record) -> float:  # record: a RolloutRecord of a job submitted with sample()'s metadata
        text = self.task.tokenizer.decode([int(i) for i in record.completion_ids], skip_special_tokens=True)
        return verify(text, int(record.metadata["answer"]))

    def held_out(self, count: int) -> list[tuple[list[int], dict[str, str]]]:
        return [(self.task.encode(p), {"answer": str(p.answer)}) for p in held_out(count)]
