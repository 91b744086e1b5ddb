"""Stages between "record finished" and "record available to the trainer" (docs/rewards.md, "The reward
stage"): the reward stage scores finished records with a reward function and publishes them to the
rollout stream the trainer reads. Run by `maskroll reward` (its own fleet) or inside a replica
(`maskroll serve --reward`). The teacher stage (`maskroll teacher`, "The teacher stage") is the same worker
with a teacher fleet's Score (and optionally the reward first) as its step.

`config` (RewardStageConfig, TeacherStageConfig, stdlib only), `reward_call` (one reward call: load, decode,
timeout, checks), `teacher` (the teacher fleet's step and the vocabulary check), `worker` (StageWorker: the
finished stream → scored records, dead letters, heartbeats), `run` (worker processes, and `make_worker`
for a replica). Importing this package loads nothing heavy: the modules
below `config` import redis, numpy and a tokenizer on first use.
"""

from .config import RewardStageConfig, TeacherStageConfig

__all__ = ["RewardStageConfig", "TeacherStageConfig", "make_worker", "run_stage"]


def __getattr__(name: str):
    if name in ("make_worker", "run_stage"):
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
