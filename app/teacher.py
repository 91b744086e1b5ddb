"""`maskroll teacher`: the teacher stage as its own fleet — worker processes that score a namespace's
finished records on teacher replicas (the Score RPC), attach the teacher's top-K and the logprob of each
completion token, and publish them where the trainer reads (docs/rewards.md, "The teacher stage"). With
--reward they also score the reward first (one stage does both). Its flags are TeacherStageConfig's
fields (app/flags.py), checked before redis or grpc is imported.
"""

from __future__ import annotations

import logging

from maskroll.stages.config import TeacherStageConfig

from .flags import parse_stage_config

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
    "partitions",
    "claim_idle_s",
    "max_deliveries",
    "max_len",
    "dedupe_ttl_s",
    "heartbeat_ttl_s",
    "log_every_s",
    "worker_id",
)


def parse(argv: list[str]) -> TeacherStageConfig:
    """The stage's config from its flags; an invalid value exits 2 with the config's message."""
    return parse_stage_config(TeacherStageConfig, "maskroll teacher", __doc__.split("\n\n")[0], FLAGS, argv)


def main(argv: list[str]) -> int:
    cfg = parse(argv)
    if cfg.tokenizer is not None and not cfg.tokenizer.is_dir():
        print(f"maskroll teacher: --tokenizer {cfg.tokenizer} is not a directory")
        return 2
    if cfg.tls_ca is not None and not cfg.tls_ca.is_file():
        print(f"maskroll teacher: --tls-ca {cfg.tls_ca} is not a file")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.reward:
        from maskroll.stages.scoring import load_reward

        try:
            load_reward(cfg.reward)  # a wrong path fails here, once, not in every worker
        except ValueError as e:
            print(f"maskroll teacher: {e}")
            return 2
    from maskroll.stages import run_stage

    return run_stage(cfg)
