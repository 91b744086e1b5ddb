"""The run record: one hash per namespace, `maskroll:<ns>:run` (`StreamKeys.run`; docs/records.md, "Runs").

    run_id      32 hex characters, new for every run
    version     the last policy version published in the run (0: the weights the run started from)
    checkpoint  where that version's weights are (a directory under the replicas' weights root, or
                "stream" when the trainer pushes them over gRPC, "collective" over NCCL);
                "" while the run has published nothing
    started_at, updated_at   unix seconds
    started_by  the consumer name of the trainer that started the run

Both sides read it: a trainer opens, resumes and advances its run (`maskroll.client.runs`), a replica
joins the run at its current version (`maskroll.server.weights.join`). This module owns its fields and
their encoding, nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .streams import StreamKeys


@dataclass(frozen=True)
class RunInfo:
    """A run as recorded in Redis (the hash fields, typed)."""

    run_id: str
    version: int = 0
    checkpoint: str = ""
    started_at: float = 0.0
    updated_at: float = 0.0
    started_by: str = ""

    @classmethod
    def from_hash(cls, h: dict) -> RunInfo:
        """From HGETALL's reply (bytes keys and values, as the queue's client returns them)."""
        text = {_text(k): _text(v) for k, v in h.items()}
        return cls(
            run_id=text.get("run_id", ""),
            version=int(text.get("version") or 0),
            checkpoint=text.get("checkpoint", ""),
            started_at=float(text.get("started_at") or 0),
            updated_at=float(text.get("updated_at") or 0),
            started_by=text.get("started_by", ""),
        )

    def describe(self) -> str:
        ago = max(0.0, time.time() - (self.updated_at or self.started_at))
        return (
            f"run {self.run_id} (policy version {self.version}, updated {_ago(ago)} ago, "
            f"started by {self.started_by or 'unknown'})"
        )


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _mapping(run: RunInfo) -> dict[str, str]:
    return {
        "run_id": run.run_id,
        "version": str(run.version),
        "checkpoint": run.checkpoint,
        "started_at": repr(run.started_at),
        "updated_at": repr(run.updated_at),
        "started_by": run.started_by,
    }


async def read_run(r, keys: StreamKeys) -> RunInfo | None:
    """The namespace's current run, or None if it has none."""
    h = await r.hgetall(keys.run)
    return RunInfo.from_hash(h) if h else None


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
