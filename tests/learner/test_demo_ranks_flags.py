"""`maskroll demo --trainer-ranks N`: the flag, its checks (before anything starts), and the torchrun
command the demo and tests run the ranks with. The demo end to end on 2 ranks is run by hand (README)."""

from __future__ import annotations

import re
import sys

import pytest

from maskroll.app.demo import parse
from maskroll.recipes.launch import torchrun_command


def test_trainer_ranks_flag_default_and_value():
    assert parse([])[0].trainer_ranks == 1
    assert parse(["--trainer-ranks", "2"])[0].trainer_ranks == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trainer-ranks", "0"], r"trainer_ranks=0; expected an int in \[1, 64\]"),
        (
            ["--trainer-ranks", "3", "--prompts-per-step", "2"],
            r"--trainer-ranks 3 needs --prompts-per-step >= 3",
        ),
    ],
)
def test_trainer_ranks_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_torchrun_command():
    assert torchrun_command(2, "maskroll.recipes.grpo_launch", ["--config", "run.json"], max_restarts=1) == [
        sys.executable,
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"),
        *("-m", "maskroll.recipes.grpo_launch", "--config", "run.json"),
    ]
    assert torchrun_command(2, "/x/ranks_script.py")[-1] == "/x/ranks_script.py"  # a script, not -m
    with pytest.raises(ValueError, match="ranks=0"):
        torchrun_command(0, "m")
