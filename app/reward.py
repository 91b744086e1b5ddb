"""`maskroll reward`: the reward stage as its own fleet — worker processes that score a namespace's
finished records with a reward function and publish them where the trainer reads (docs/rewards.md,
"The reward stage"). Its flags are RewardStageConfig's fields (app/flags.py), checked before redis or a
tokenizer is imported.
"""

from __future__ import annotations

import logging

from maskroll.stages.config import RewardStageConfig

from .flags import parse_stage_config

FLAGS = (
    "redis_url",
    "namespace",
    "reward",
    "workers",
    "concurrency",
    "tokenizer",
    "timeout_s",
    "partitions",
    "claim_idle_s",
    "max_deliveries",
    "max_len",
    "dedupe_ttl_s",
    "heartbeat_ttl_s",
    "log_every_s",
    "worker_id",
)


def parse(argv: list[str]) -> RewardStageConfig:
    """The stage's config from its flags; an invalid value exits 2 with the config's message."""
    return parse_stage_config(RewardStageConfig, "maskroll reward", __doc__.split("\n\n")[0], FLAGS, argv)


def main(argv: list[str]) -> int:
    cfg = parse(argv)
    if cfg.tokenizer is not None and not cfg.tokenizer.is_dir():  # here, not in the config: a manifest's
        print(f"maskroll reward: --tokenizer {cfg.tokenizer} is not a directory")  # path exists in its pod
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from maskroll.stages import run_stage

    try:
        from maskroll.stages.scoring import load_reward

        load_reward(cfg.reward)  # a wrong path fails here, once, not in every worker
    except ValueError as e:
        print(f"maskroll reward: {e}")
        return 2
    return run_stage(cfg)
