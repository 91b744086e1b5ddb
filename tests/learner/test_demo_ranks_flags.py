"""`maskroll demo --trainer-ranks N`: the flag, its checks (before anything starts), and the torchrun
command the demo and tests run the ranks with. The demo end to end on 2 ranks is run by hand (README)."""

from __future__ import annotations

import re
import subprocess
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


def test_exit_rank_flushes_its_output_and_exits_with_the_code():
    # a rank skips the interpreter's shutdown (launch.exit_rank says why): what it printed, buffered in
    # a pipe, and its logging still come out, and the exit code is the one given
    script = (
        "import atexit, logging, sys\n"
        "from maskroll.recipes.launch import exit_rank\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
        "print('summary written', end='')\n"
        "logging.getLogger('x').warning('a warning')\n"
        "exit_rank(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr.strip()) == (3, "summary written", "a warning")
