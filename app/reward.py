"""`maskroll reward`: the reward stage as its own fleet — worker processes that score a namespace's
finished records with a reward function and publish them where the trainer reads (docs/rewards.md,
"The reward stage"). Its flags are RewardStageConfig's fields (app/flags.py), checked before redis or a
tokenizer is imported.
"""

from __future__ import annotations

from maskroll.stages.config import RewardStageConfig

from . import stage_cli
from .flags import parse_stage_config

PROG = "maskroll reward"
FLAGS = (
    "redis_url",
    "namespace",
    "reward",
    "workers",
    "concurrency",
    "tokenizer",
    "timeout_s",
    *stage_cli.SHARED_FLAGS,
)


def parse(argv: list[str]) -> RewardStageConfig:
    """The stage's config from its flags; an invalid value exits 2 with the config's message."""
    return parse_stage_config(RewardStageConfig, PROG, __doc__.split("\n\n")[0], FLAGS, argv)


def main(argv: list[str]) -> int:
    return stage_cli.run(parse(argv), PROG)
