"""Redis key names and stream-entry fields shared by replicas (server) and trainers (client).

One namespace per training run. Entries carry protobuf bytes (proto/maskroll/v1/rollout.proto):
prompt stream  {"job": PromptJob}
rollout stream {"r": RolloutRecord} or {"job_error": PromptJob, "reason": text} when a job cannot run
dead letters   {"stream", "id", "reason", "payload"} for entries no consumer could decode
"""

from __future__ import annotations

from dataclasses import dataclass

REPLICA_GROUP = "replicas"  # one consumer group on the prompt stream for all replicas
TRAINER_GROUP = "trainers"  # one consumer group on the rollout stream for the trainer(s)

F_JOB = b"job"
F_RECORD = b"r"
F_JOB_ERROR = b"job_error"
F_REASON = b"reason"


@dataclass(frozen=True)
class StreamKeys:
    namespace: str

    def _k(self, *parts: str) -> str:
        return ":".join(("maskroll", self.namespace, *parts))

    @property
    def prompts(self) -> str:
        return self._k("prompts")

    @property
    def rollouts(self) -> str:
        return self._k("rollouts")

    @property
    def dead_letters(self) -> str:
        return self._k("dead")

    def replica(self, replica_id: str) -> str:
        """Heartbeat key of one replica (JSON with its address; expires when the replica stops)."""
        return self._k("replica", replica_id)

    @property
    def replica_pattern(self) -> str:
        return self._k("replica", "*")

    @property
    def done(self) -> str:
        """Sorted set of acked rollout ids scored by ack time: a later duplicate (a reclaimed, regenerated
        job) is skipped. One ZADD per ack and one ZMSCORE per read, whatever the batch size."""
        return self._k("done")
