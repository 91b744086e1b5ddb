"""The arithmetic task of `maskroll demo --model smollm2`: generated problems carry the right answers, the
verifier reads the last integer, prompts go through the chat template, and the demo's flags pick the
SmolLM2 defaults."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from maskroll.recipes import arithmetic as ar


def test_generated_answers_are_the_arithmetic_of_their_text() -> None:
    rng = random.Random(0)
    for p in ar.problems(rng, 500):
        a, b = map(int, re.findall(r"\d+", p.text)[:2])
        plus = " + " in p.text or any(w in p.text for w in ("more", "gave", "in all"))
        assert p.answer == (a + b if plus else a - b), p
        assert p.answer >= 0 and 1 <= a <= 10 and 1 <= b <= 10


def test_held_out_is_fixed_and_differs_from_training_draws() -> None:
    assert ar.held_out(8) == ar.held_out(8)
    train = {p.text for p in ar.problems(random.Random(0), 2000)}
    held = {p.text for p in ar.held_out(64)}
    assert not train & held  # split by operand pair, so not even a bare "What is a + b?" is shared
    assert {t for t in held if t.startswith("What is")} and {t for t in train if t.startswith("What is")}


@pytest.mark.parametrize(
    ("text", "answer", "reward"),
    [
        ("12", 12, 1.0),
        ("The answer is 12.", 12, 1.0),
        ("7 + 5 = 12", 12, 1.0),
        ("7 + 5 = 13", 12, 0.0),  # the last number is the answer given
        ("12 apples, then 3", 12, 0.0),
        ("Let me think about", 12, 0.0),  # cut off before a number
        ("-3", -3, 1.0),
    ],
)
def test_verifier_reads_the_last_integer(text: str, answer: int, reward: float) -> None:
    assert ar.verify(text, answer) == reward


def test_prompt_is_the_chat_template_and_reward_decodes_ids(smollm2_dir: Path) -> None:
    task = ar.Task(smollm2_dir)
    p = ar.Problem("What is 3 + 4?", 7)
    text = task.tokenizer.decode(task.encode(p))
    assert text.startswith("<|im_start|>system\n" + ar.SYSTEM)
    assert text.endswith(f"What is 3 + 4? {ar.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    ids = [*task.tokenizer(" It is 7.").input_ids, task.tokenizer.eos_token_id]
    assert task.reward(np.array(ids), p) == 1.0
    q = ar.QueueTask(smollm2_dir)
    prompt, meta = q.sample(random.Random(1))
    assert meta["answer"].lstrip("-").isdigit() and prompt[-3:] == task.encode(p)[-3:]


def test_demo_model_smollm2_takes_its_own_defaults_and_flags_still_override() -> None:
    from maskroll.app.demo import SMOLLM2_DEFAULTS, parse

    cfg, _ = parse(["--model", "smollm2"])
    assert cfg.is_smollm2 and cfg.grpo == SMOLLM2_DEFAULTS
    cfg, _ = parse(["--model=smollm2", "--lr", "1e-5", "--steps", "3"])
    assert (cfg.grpo.lr, cfg.grpo.steps, cfg.grpo.n) == (1e-5, 3, SMOLLM2_DEFAULTS.n)
    tiny, _ = parse([])
    assert not tiny.is_smollm2 and tiny.grpo.lr == 2e-3
    with pytest.raises(SystemExit):
        parse(["--model", "smollm2", "--trainer", "trl"])
