"""Is a replica's memory bounded under cancelled streams? RSS of a `maskroll serve` process (torch engine)
over rounds of N streams that each read a few chunks and hang up.

Issue 11 saw RSS grow from 491 to 684 MB after 200 cancelled streams, flattening over rounds. This
measures it round by round: a leak grows by about the same amount every round; allocator high-water
growth (glibc arenas, the KV cache and workspace buffers sized by the largest batch) rises in the first
rounds and then stays flat. After each round the script waits until the server reports no request in
flight (the `maskroll_generate_in_flight` gauge), then one more second, then reads VmRSS from /proc.

    python bench/rss_cancel.py                              # 16 rounds x 200 streams, tiny model
    python bench/rss_cancel.py --rounds 12 --streams 200 --json
    python bench/rss_cancel.py --model DIR --max-tokens 2000

RSS between rounds moves by ±40 MB with the allocator's timing, so the verdict compares medians: the
first quarter of the rounds (at least 2) is the warm-up (allocator arenas and buffers reaching their
high-water mark) and is left out; the rest is split in two halves; "bounded" when the median RSS of the
later half exceeds the earlier half's by less than `--tolerance-mb` (default 20 MB) — a leak moves the
whole band up, a bounded process stays in it — else "growing". Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import common
from common import rss_mb


def in_flight(metrics: str) -> float:
    body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    line = next(x for x in body.splitlines() if x.startswith("maskroll_generate_in_flight "))
    return float(line.split()[-1])


async def one_round(address: str, streams: int, chunks: int, max_tokens: int) -> int:
    """`streams` concurrent Generate calls, each cancelled after `chunks` chunks; returns tokens read."""
    from maskroll.client import RolloutClient, SamplingOptions

    options = SamplingOptions(max_tokens=max_tokens, logprobs_k=20, ignore_eos=True)

    async def one(c: RolloutClient, i: int) -> int:
        got = 0
        async with c.generate([256, *(b"cancel me %d" % i)], options) as stream:
            async for chunk in stream:
                got += len(chunk.token_ids)
                if chunks <= 1:
                    break  # leaving the block cancels the call: the server aborts the engine request
                chunks_left[i] -= 1
                if chunks_left[i] <= 0:
                    break
        return got

    chunks_left = [chunks] * streams
    async with RolloutClient(address) as c:
        return sum(await asyncio.gather(*(one(c, i) for i in range(streams))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model(p)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--streams", type=int, default=200, help="cancelled streams per round")
    p.add_argument("--chunks", type=int, default=3, help="chunks each stream reads before hanging up")
    p.add_argument("--max-tokens", type=int, default=1000)
    p.add_argument("--tolerance-mb", type=float, default=20.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra `maskroll serve` flag")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from maskroll.local.replica import LocalReplica

    with tempfile.TemporaryDirectory(prefix="maskroll-rss-") as tmp:
        model = common.model_dir(args.model, Path(tmp), "tiny")
        serve = ["--model", model, "--engine", "torch", "--threads", "1"]
        serve += ["--port", "0", "--metrics-port", "0", *args.server_arg]
        env, log = {"OMP_NUM_THREADS": "1"}, Path(tmp) / "serve.log"
        with LocalReplica(serve, env=env, log=log) as replica:
            address, metrics = replica.address, replica.metrics
            rows = [{"round": 0, "rss_mb": round(rss_mb(replica.pid), 1), "tokens": 0, "seconds": 0.0}]
            for r in range(1, args.rounds + 1):
                t0 = time.monotonic()
                tokens = asyncio.run(one_round(address, args.streams, args.chunks, args.max_tokens))
                deadline = time.monotonic() + 60
                while in_flight(metrics) > 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError("requests still in flight 60 s after the round")
                    time.sleep(0.1)
                time.sleep(1.0)
                rows.append(
                    {
                        "round": r,
                        "rss_mb": round(rss_mb(replica.pid), 1),
                        "tokens": tokens,
                        "seconds": round(time.monotonic() - t0, 1),
                    }
                )
                if not args.json:
                    row = rows[-1]
                    print(f"round {r:2d}: RSS {row['rss_mb']:7.1f} MB  ({tokens} tokens, {row['seconds']} s)")
    rss = [row["rss_mb"] for row in rows[1:]]  # after each round
    warm = max(2, len(rss) // 4)
    rest = rss[warm:]
    if len(rest) < 2:
        raise SystemExit(f"--rounds {args.rounds} leaves no rounds after the {warm} warm-up rounds")
    early, late = rest[: len(rest) // 2], rest[len(rest) // 2 :]
    growth = statistics.median(late) - statistics.median(early)
    verdict = "bounded" if growth < args.tolerance_mb else "growing"
    summary = {
        "streams_per_round": args.streams,
        "chunks_per_stream": args.chunks,
        "rounds": args.rounds,
        "rss_start_mb": rows[0]["rss_mb"],
        "rss_after_round_1_mb": rows[1]["rss_mb"],
        "rss_end_mb": rows[-1]["rss_mb"],
        "rss_max_mb": max(rss),
        "warm_up_rounds": warm,
        "median_early_mb": statistics.median(early),
        "median_late_mb": statistics.median(late),
        "verdict": verdict,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        a, b = warm + 1, warm + len(early)
        print(
            f"RSS {rows[0]['rss_mb']} MB at start, {rows[1]['rss_mb']} MB after round 1, at most "
            f"{max(rss)} MB; median {statistics.median(early):.1f} MB in rounds {a}-{b}, "
            f"{statistics.median(late):.1f} MB in rounds {b + 1}-{args.rounds} ({growth:+.1f} MB) "
            f"-> {verdict}"
        )
    return 0 if verdict == "bounded" else 1


if __name__ == "__main__":
    sys.exit(main())
