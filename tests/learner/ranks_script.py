"""What each trainer rank of tests/learner runs under torchrun: `grpo_launch.main` with a step hook that
appends every StepEvent to `$LEARNER_TRACE/rank<r>.jsonl` (with its life: the torchrun restart count)
and, in the first life, SIGKILLs this rank at `$LEARNER_KILL` = "rank:step:point" once it is written."""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from maskroll.recipes import grpo_launch
from maskroll.recipes.launch import exit_rank

TRACE = Path(os.environ["LEARNER_TRACE"])
KILL = os.environ.get("LEARNER_KILL", "")


def hook(event) -> None:
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(TRACE / f"rank{event.rank}.jsonl", "a") as f:
        f.write(json.dumps({"life": life, **asdict(event)}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if life == 0 and f"{event.rank}:{event.step}:{event.point}" == KILL:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    exit_rank(grpo_launch.main(sys.argv[1:], step_hook=hook))
