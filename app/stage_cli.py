"""A stage command's life, the same for `maskroll reward` and `maskroll teacher`: the paths its config
names checked, logging, the reward function imported once, then the stage's worker processes
(`stages.run_stage`). Each command keeps its own flags (its config's fields, parsed by
`flags.parse_stage_config`) and its own words; the flags every stage shares come last in both.
"""

from __future__ import annotations

import logging
from pathlib import Path

from maskroll.stages.config import StageConfig

# StageConfig's fields after each stage's own, in --help order (both commands end with them)
SHARED_FLAGS = (
    "partitions",
    "claim_idle_s",
    "max_deliveries",
    "max_len",
    "dedupe_ttl_s",
    "heartbeat_ttl_s",
    "log_every_s",
    "worker_id",
)
# Paths a stage's config may name, checked here and not in the config: a manifest's path exists in its
# pod, not where the config was written.
_PATHS = (("tokenizer", Path.is_dir, "a directory"), ("tls_ca", Path.is_file, "a file"))


def run(cfg: StageConfig, prog: str) -> int:
    """Run the stage of `cfg` (a validated RewardStageConfig or TeacherStageConfig) as command `prog`:
    its exit status; 2, with a line saying why, for a path that is not there or a reward function that
    does not import — found here once, not in every worker."""
    for name, present, kind in _PATHS:
        path = getattr(cfg, name, None)
        if path is not None and not present(path):
            print(f"{prog}: --{name.replace('_', '-')} {path} is not {kind}")
            return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.reward:  # the teacher stage's is optional
        from maskroll.stages.reward_call import load_reward

        try:
            load_reward(cfg.reward)
        except ValueError as e:
            print(f"{prog}: {e}")
            return 2
    from maskroll.stages import run_stage

    return run_stage(cfg)
