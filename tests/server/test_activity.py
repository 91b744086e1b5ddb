"""The replica's activity line: counts and rates between two snapshots of its own metrics."""

from __future__ import annotations

import asyncio
import logging

from maskroll.server.activity import activity_line, log_activity, snapshot
from maskroll.server.metrics import Metrics


def test_the_line_counts_what_happened_between_two_snapshots():
    m = Metrics()
    m.tokens.inc(100)  # before the first snapshot: not counted
    m.jobs.labels("ok").inc(4)
    before = snapshot(m, at=10.0)
    m.tokens.inc(1500)
    m.jobs.labels("ok").inc(11)
    m.jobs.labels("rejected").inc()
    m.jobs_active.set(3)
    m.in_flight.inc(2)
    m.published.inc(24)
    line = activity_line(before, snapshot(m, at=40.0), policy_version=7)
    assert line == (
        "activity: 12 jobs done (11 ok, 1 rejected), 3 running; 2 Generate in flight; 1500 tokens, "
        "50.0 tok/s; 24 records published; policy version 7"
    )


def test_an_idle_replica_writes_no_line_and_a_busy_one_does():
    m = Metrics()
    before = snapshot(m, at=0.0)
    assert activity_line(before, snapshot(m, at=60.0), policy_version=0) is None
    m.in_flight.inc()  # a long request still running is activity
    assert "1 Generate in flight; 0 tokens, 0.0 tok/s" in activity_line(before, snapshot(m, at=60.0), 0)


def test_the_logger_writes_a_line_per_period_while_busy(caplog):
    m = Metrics()
    caplog.set_level(logging.INFO, logger="maskroll.activity")

    async def run():
        task = asyncio.create_task(log_activity(m, lambda: 5, 0.05))
        await asyncio.sleep(0.01)
        m.tokens.inc(10)
        await asyncio.sleep(0.08)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.name == "maskroll.activity"]
    assert lines and "10 tokens" in lines[0] and "policy version 5" in lines[0]
