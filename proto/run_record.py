"""The run record: one hash per namespace, `maskroll:<ns>:run` (`StreamKeys.run`; docs/records.md, "Runs").

    run_id      32 hex characters, new for every run
    version     the last policy version published in the run (0: the weights the run started from)
    checkpoint  where that version's weights are (a directory under the replicas' weights root, or
                STREAM_CHECKPOINT when the trainer pushes them over gRPC, NCCL_CHECKPOINT over NCCL);
                "" while the run has published nothing
    started_at, updated_at   unix seconds
    started_by  the consumer name of the trainer that started the run

Both sides read it: a trainer opens, resumes and advances its run (`maskroll.client.runs`), a replica
joins the run at its current version (`maskroll.server.weights.join`). This module owns its fields and
their encoding, nothing else.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .streams import StreamKeys

MAX_RUN_ID_CHARS = 256  # as every other id a record carries (server validation.MAX_ID_CHARS)
MAX_CHECKPOINT_CHARS = 4096  # PATH_MAX
MAX_VERSION = (1 << 63) - 1  # policy versions are int64 on the wire

# `checkpoint` for a version no replica can read from a directory: the trainer pushes it (the stream
# transport) or broadcasts it to an NCCL group (the nccl transport). These are stored values, not names:
# they stay "stream" and "collective" (the NCCL transport's earlier name) so that replicas of older
# releases keep reading new trainers' records and new replicas old ones.
STREAM_CHECKPOINT = "stream"
NCCL_CHECKPOINT = "collective"


class RunRecordError(ValueError):
    """The run record in Redis does not hold a valid run (a field of the wrong type or out of range):
    no replica may join it."""


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
    def from_hash(cls, h: dict, key: str = "the run record") -> RunInfo:
        """From HGETALL's reply (bytes keys and values, as the queue's client returns them). Every field
        is checked: RunRecordError, naming `key` and the field, when one is not what a trainer writes."""
        text = {_text(k): _text(v) for k, v in h.items()}
        run_id = _bounded(text, "run_id", MAX_RUN_ID_CHARS, key)
        if not run_id:
            raise RunRecordError(f"{key} has no run_id")
        return cls(
            run_id=run_id,
            version=_version(text.get("version"), key),
            checkpoint=_bounded(text, "checkpoint", MAX_CHECKPOINT_CHARS, key),
            started_at=_seconds(text, "started_at", key),
            updated_at=_seconds(text, "updated_at", key),
            started_by=_bounded(text, "started_by", MAX_RUN_ID_CHARS, key),
        )

    def describe(self) -> str:
        since = max(0.0, time.time() - (self.updated_at or self.started_at))
        return (
            f"run {self.run_id} (policy version {self.version}, updated {ago(since)} ago, "
            f"started by {self.started_by or 'unknown'})"
        )


def ago(seconds: float) -> str:
    """A duration as a person reads it: "45 s", "12 min", "3.5 h" (run records, `maskroll status`)."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _shown(value: str) -> str:
    return repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} characters)"


def _bounded(text: dict[str, str], field: str, limit: int, key: str) -> str:
    value = text.get(field, "")
    if len(value) > limit or not value.isprintable():
        raise RunRecordError(f"{key}: {field} = {_shown(value)} is not at most {limit} printable characters")
    return value


def _version(raw: str | None, key: str) -> int:
    try:
        version = int(raw or 0)
    except ValueError:
        version = -1
    if not 0 <= version <= MAX_VERSION:
        raise RunRecordError(
            f"{key}: version = {_shown(raw or '')} is not a policy version (an integer in [0, 2^63))"
        )
    return version


def _seconds(text: dict[str, str], field: str, key: str) -> float:
    raw = text.get(field) or "0"
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise RunRecordError(f"{key}: {field} = {_shown(raw)} is not a time (unix seconds)")
    return value


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
    """The namespace's current run, or None if it has none; RunRecordError if it is not a valid run."""
    h = await r.hgetall(keys.run)
    return RunInfo.from_hash(h, keys.run) if h else None


def _text(v: bytes | str) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
