"""`maskroll teacher`: the teacher stage as its own fleet — worker processes that score a namespace's
finished records on teacher replicas (the Score RPC), attach the teacher's top-K and the logprob of each
completion token, and publish them where the trainer reads (docs/rewards.md, "The teacher stage"). With
--reward they also score the reward first (one stage does both). Its flags are TeacherStageConfig's
fields (app/flags.py), checked before redis or grpc is imported.
"""

from __future__ import annotations

from maskroll.stages.config import TeacherStageConfig

from . import stage_cli
from .flags import parse_stage_config

PROG = "maskroll teacher"
FLAGS = (
    "redis_url",
    "namespace",
    "teacher",
    "teacher_k",
    "teacher_temperature",
    "token",
    "tls_ca",
    "reward",
    "workers",
    "concurrency",
    "group_wait_s",
    "tokenizer",
    "timeout_s",
    "retry_s",
    "student_wait_s",
    *stage_cli.SHARED_FLAGS,
)


def parse(argv: list[str]) -> TeacherStageConfig:
    """The stage's config from its flags; an invalid value exits 2 with the config's message."""
    return parse_stage_config(TeacherStageConfig, PROG, __doc__.split("\n\n")[0], FLAGS, argv)


def main(argv: list[str]) -> int:
    return stage_cli.run(parse(argv), PROG)
