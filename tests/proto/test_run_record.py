"""proto/run_record.py's transport markers: the stored values of the run record's `checkpoint` that no
directory can be, kept as they were when the NCCL transport was called "collective" (older replicas read
new trainers' records), and read back unchanged."""

from __future__ import annotations

from maskroll.proto.run_record import NCCL_CHECKPOINT, STREAM_CHECKPOINT, RunInfo


def test_the_markers_keep_the_values_older_replicas_read() -> None:
    assert (STREAM_CHECKPOINT, NCCL_CHECKPOINT) == ("stream", "collective")


def test_a_record_with_either_marker_reads_back_as_written() -> None:
    for marker in (STREAM_CHECKPOINT, NCCL_CHECKPOINT):
        h = {b"run_id": b"ab" * 16, b"version": b"7", b"checkpoint": marker.encode(), b"started_at": b"1.5"}
        run = RunInfo.from_hash(h)
        assert (run.run_id, run.version, run.checkpoint, run.started_at) == ("ab" * 16, 7, marker, 1.5)
