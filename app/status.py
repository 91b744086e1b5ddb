"""`maskroll status` and `maskroll dead-letters`: what a namespace looks like in Redis, for people.

The data comes from `maskroll.client.status` (read with bounded Redis calls); this module parses the
flags, opens Redis as every maskroll process does (`open_redis`: a cluster detected) and prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from maskroll.client.replicas import replicas_elsewhere
from maskroll.client.status import (
    drop_dead_letters,
    list_dead_letters,
    namespace_keys,
    namespace_status,
    requeue_dead_letters,
)
from maskroll.proto.redaction import redact
from maskroll.proto.redis_conn import QueueUnavailable, open_redis
from maskroll.proto.run_record import ago


def _ago(seconds: float | None) -> str:
    return "?" if seconds is None else ago(seconds)


def format_status(st: dict) -> str:
    lines = [f"namespace {st['namespace']!r} ({st['partitions']} partition{'s' * (st['partitions'] > 1)})"]
    run = st["run"]
    if run is None:
        lines.append("run: none (no trainer has opened this namespace)")
    else:
        lines.append(
            f"run: {run['run_id']}  version {run['version']}  started by {run['started_by'] or 'unknown'}  "
            f"updated {_ago(run['updated_ago_s'])} ago  checkpoint {run['checkpoint'] or '-'}"
        )
    reps = st["replicas"]
    lines.append(f"replicas: {len(reps)} live")
    for rep in reps:
        expires = rep["heartbeat_expires_in_s"]
        lines.append(
            f"  {rep['replica_id']}  {rep['address']}  engine {rep['engine'] or '?'}"
            f"  model {rep['model'] or '?'}"
            f"  v{rep['policy_version']} of run {rep.get('run_id') or '-'}"
            + (f"  active jobs {rep['active_jobs']}" if rep.get("pulls", True) else "  no --pull")
            + f"  in flight {rep.get('in_flight', 0)}  {rep.get('tokens_per_s', 0.0):.1f} tok/s"
            + (f"  heartbeat expires in {expires:.1f} s" if expires is not None else "")
        )
    if not reps and "namespaces_with_replicas" in st:
        lines.append(f"  {replicas_elsewhere(st['namespace'], st['namespaces_with_replicas'])}")
    p, r = st["prompts"], st["rollouts"]
    lines.append(f"prompts:  {p['length']} queued ({p['waiting']} waiting, {p['pending']} being generated)")
    lines.append(
        f"rollouts: {r['length']} unconsumed ({r['waiting']} waiting, {r['pending']} delivered, not acked)"
    )
    f, workers = st.get("finished"), st.get("reward_workers", [])
    if workers or (f and f["length"]):
        lines.append(
            f"reward stage: {len(workers)} live workers; {f['length']} records to score "
            f"({f['pending']} being scored)"
        )
        for w in workers:
            lines.append(
                f"  {w.get('worker_id')}  {w.get('reward')}  scored {w.get('scored', 0)}  failed "
                f"{w.get('failed', 0)}  duplicates {w.get('duplicates', 0)}  scoring {w.get('active', 0)}"
                + (f"  hung {w['hung']}" if w.get("hung") else "")
            )
    if st["partitions"] > 1:
        for part in st["by_partition"]:
            pp, rr = part["prompts"], part["rollouts"]
            lines.append(
                f"  partition {part['index']}: prompts {pp['length']} ({pp['pending']} pending), "
                f"rollouts {rr['length']} ({rr['pending']} pending), dead letters {part['dead_letters']}"
            )
    dead = st["dead_letters"]
    lines.append(
        f"dead letters: {dead['total']}"
        + (f" (reasons of the newest {dead['read']})" if dead["read"] < dead["total"] else "")
    )
    for reason, n in list(dead["by_reason"].items())[:10]:
        lines.append(f"  {n:6d}  {reason}")
    if len(dead["by_reason"]) > 10:
        lines.append(f"  ... and {len(dead['by_reason']) - 10} other reasons")
    return "\n".join(lines)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", required=True, help="the Redis the trainer and replicas share")
    p.add_argument("--namespace", required=True, help="the run's namespace")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


async def _with_redis(url: str, namespace: str, work):
    r, cluster = await open_redis(url, retries=2)
    try:
        return await work(r, await namespace_keys(r, namespace, cluster))
    finally:
        await r.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="maskroll status",
        description="A namespace at a glance: its run, live replicas, backlogs and dead letters.",
    )
    _common(p)
    p.add_argument("--watch", type=float, metavar="SECONDS", help="print again every SECONDS (Ctrl-C stops)")
    args = p.parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        p.error("--watch must be > 0")
    try:
        while True:
            st = asyncio.run(_with_redis(args.redis_url, args.namespace, namespace_status))
            print(json.dumps(st) if args.json else format_status(st), flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
            if not args.json:
                print()
    except KeyboardInterrupt:
        return 0
    except QueueUnavailable as e:
        print(f"maskroll status: {redact(str(e))}", file=sys.stderr)
        return 1


def dead_letters_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="maskroll dead-letters",
        description="List a namespace's newest dead letters (id, reason, age); --drop deletes those listed, "
        "--requeue puts them back on the stream they came from.",
    )
    _common(p)
    p.add_argument("--limit", type=int, default=50, help="how many, newest first (default 50)")
    act = p.add_mutually_exclusive_group()
    act.add_argument("--drop", action="store_true", help="delete the dead letters listed")
    act.add_argument(
        "--requeue",
        action="store_true",
        help="put the dead letters listed back on their stream (a prompt job, a record); a record refused "
        "for what it is (another run) is refused again",
    )
    p.add_argument("--reason", default="", help="only the dead letters whose reason contains this text")
    args = p.parse_args(argv)
    if args.limit < 1:
        p.error("--limit must be >= 1")
    requeued: dict[str, str] = {}

    async def work(r, keys):
        letters = await list_dead_letters(r, keys, args.limit)
        letters = [d for d in letters if args.reason in d["reason"]]
        dropped = await drop_dead_letters(r, keys, letters) if args.drop else 0
        if args.requeue:
            requeued.update(await requeue_dead_letters(r, keys, letters))
        return letters, dropped

    try:
        letters, dropped = asyncio.run(_with_redis(args.redis_url, args.namespace, work))
    except QueueUnavailable as e:
        print(f"maskroll dead-letters: {redact(str(e))}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"dead_letters": letters, "dropped": dropped, "requeued": requeued}))
        return 0
    for d in letters:
        done = f"  [{requeued[d['id']]}]" if d["id"] in requeued else ""
        print(f"{d['id']}  {_ago(d['age_s']):>7} ago  {d['stream']} {d['entry']}  {d['reason']}{done}")
    print(
        f"{len(letters)} dead letters"
        + (f", {dropped} dropped" if args.drop else "")
        + (f", {sum(v == 'requeued' for v in requeued.values())} requeued" if args.requeue else "")
    )
    return 0
