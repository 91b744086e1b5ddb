"""The replica's activity line: every `activity_log_s`, one log line saying what it did since the last.

    activity: 12 jobs done (11 ok, 1 rejected), 3 running; 2 Generate in flight; 1534 tokens, 51.1 tok/s;
    24 records published; policy version 7

Read from the replica's own Prometheus registry (`metrics.py`), so the line and /metrics never disagree.
An idle replica (nothing done, nothing running) writes no line. Knows nothing of front ends or engines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from .metrics import JOB_OUTCOMES, Metrics

log = logging.getLogger("maskroll.activity")


@dataclass(frozen=True)
class Snapshot:
    at: float  # monotonic seconds
    tokens: float
    published: float
    jobs: dict[str, float]  # outcome -> count
    jobs_running: float
    in_flight: float


def snapshot(metrics: Metrics, at: float | None = None) -> Snapshot:
    # One pass over the registry: `get_sample_value` collects all of it (histograms included) for each
    # value read, ~1 ms a time here, and GetInfo takes a snapshot per call.
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.registry.collect()
        for s in family.samples
    }

    def read(name: str, labels: dict | None = None) -> float:
        return samples.get((name, tuple(sorted((labels or {}).items()))), 0.0)

    return Snapshot(
        at=time.monotonic() if at is None else at,
        tokens=read("maskroll_generated_tokens_total"),
        published=read("maskroll_published_records_total"),
        jobs={o: read("maskroll_pull_jobs_total", {"outcome": o}) for o in JOB_OUTCOMES},
        jobs_running=read("maskroll_pull_jobs_active"),
        in_flight=read("maskroll_generate_in_flight"),
    )


def activity_line(before: Snapshot, now: Snapshot, policy_version: int) -> str | None:
    """What happened between two snapshots, as one line; None when the replica was idle throughout."""
    jobs = {o: int(now.jobs[o] - before.jobs[o]) for o in JOB_OUTCOMES}
    tokens = int(now.tokens - before.tokens)
    published = int(now.published - before.published)
    running, in_flight = int(now.jobs_running), int(now.in_flight)
    if not (sum(jobs.values()) or tokens or published or running or in_flight):
        return None
    seconds = max(now.at - before.at, 1e-9)
    outcomes = ", ".join(f"{n} {o}" for o, n in jobs.items() if n)
    done = f"{sum(jobs.values())} jobs done" + (f" ({outcomes})" if outcomes else "")
    return (
        f"activity: {done}, {running} running; {in_flight} Generate in flight; {tokens} tokens, "
        f"{tokens / seconds:.1f} tok/s; {published} records published; policy version {policy_version}"
    )


async def log_activity(metrics: Metrics, policy_version, period_s: float) -> None:
    """Until cancelled: an activity line every `period_s` (policy_version: a callable, read each time)."""
    before = snapshot(metrics)
    while True:
        await asyncio.sleep(period_s)
        now = snapshot(metrics)
        line = activity_line(before, now, policy_version())
        if line:
            log.info("%s", line)
        before = now
