"""Agent sessions across replicas (issue 27): what a turn costs when the session stays on its replica
(sticky) against when it moved to another (the state loaded from Redis, the whole history prefilled
again), for 1k- and 4k-token histories; and what the session proxy (Caddy, deploy/proxy/Caddyfile) adds
to a call.

Two `maskroll serve` processes (one engine each: torch by default, `--engine vllm` for vLLM on CPU, whose
prefix cache is what stickiness keeps warm; the torch engine has none, so there sticky vs moved is the
Redis load and the state decode only) on one private Redis, a proxy (Caddy, deploy/proxy/Caddyfile) in
front of A. Per repetition and history length H:

    turn 1   POST /v1/completions on replica A, X-Maskroll-Session s, prompt = H token ids, 8 tokens
    sticky   turn 2 of s on A: the prompt extended by its turn and 8 new ids, 8 tokens (A's own copy)
    moved    the same two turns of a fresh session s' with turn 2 on B (B loads s' from Redis and
             prefills H + 16 tokens it has never seen)

timed by the client from request to response (non-streaming, ignore_eos: every turn makes exactly 8
tokens). Proxy overhead: the same call alternately to A directly and through the proxy, `--calls` times
per repetition — GET /healthz (no engine: the proxy's hop alone) and a 1-token completion of an 8-token
prompt; the figure is the median of the per-repetition differences of medians. Printed: median [min,
max] of the repetitions, the load average at start and end.

    python bench/sessions.py                          # torch engine, H = 1024 and 4096, 5 repetitions
    python bench/sessions.py --engine vllm --reps 3
    python bench/sessions.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common

TURN_TOKENS = 8


def timed_post(client, url: str, body: dict, session: str | None = None) -> tuple[float, dict]:
    headers = {"X-Maskroll-Session": session} if session else {}
    t0 = time.perf_counter()
    r = client.post(url, json=body, headers=headers)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
    return dt, r.json()


def history(n: int, seed: int) -> list[int]:
    """n byte ids after <bos> (256): distinct per session, so no session reuses another's prefix."""
    return [256, *((seed * 7919 + i * 31) % 250 + 3 for i in range(n - 1))]


def session_turns(client, a: str, b: str, h: int, sid: str, seed: int) -> tuple[float, float]:
    """Turn 1 on `a`, turn 2 on `b` (a == b: sticky); the two latencies."""
    body = {"model": "model", "max_tokens": TURN_TOKENS, "ignore_eos": True, "return_token_ids": True}
    prompt = history(h, seed)
    t1, one = timed_post(client, a + "/v1/completions", {**body, "prompt": prompt}, sid)
    more = [*prompt, *one["choices"][0]["token_ids"], *range(40, 48)]
    t2, _ = timed_post(client, b + "/v1/completions", {**body, "prompt": more}, sid)
    return t1, t2


def proxy_overhead(client, direct: str, proxied: str, calls: int) -> dict[str, tuple[float, float]]:
    """Median latency of `calls` calls to A directly and through the proxy, alternated: GET /healthz (no
    engine: the proxy's hop alone) and a 1-token completion."""
    body = {"model": "model", "prompt": [256, 10, 11, 12, 13, 14, 15, 16], "max_tokens": 1}
    out = {}
    for name, path, send in (("healthz", "/healthz", None), ("completion", "/v1/completions", body)):
        d, p = [], []
        for _ in range(calls):
            for url, into in ((direct, d), (proxied, p)):
                t0 = time.perf_counter()
                r = client.get(url + path) if send is None else client.post(url + path, json=send)
                into.append(time.perf_counter() - t0)
                r.raise_for_status()
        out[name] = (statistics.median(d), statistics.median(p))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_reps(ap, 5)
    common.add_model(ap)
    ap.add_argument("--engine", choices=("torch", "vllm"), default="torch")
    ap.add_argument("--histories", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--calls", type=int, default=100, help="proxy-overhead calls per repetition and path")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import httpx

    from maskroll.local.proxy import LocalProxy
    from maskroll.local.replica import stop_all

    load0 = common.load_1m()
    with tempfile.TemporaryDirectory(prefix="maskroll-bench-sessions-") as tmp_s:
        tmp = Path(tmp_s)
        max_len = max(args.histories) + 64
        model = common.model_dir(args.model, tmp, max_len=max_len)
        env = {"OMP_NUM_THREADS": "1"}
        if args.engine == "vllm":
            common.vllm_run_env(tmp)
        with common.open_store() as redis:
            flags = ["--engine", args.engine, "--port", "0", "--http-port", "0", "--redis-url", redis.url,
                     "--namespace", "bench-sessions", "--max-model-len", str(max_len)]  # fmt: skip
            if args.engine == "torch":
                flags += ["--threads", "1"]
            reps = common.start_replicas(model, 2, tmp, *flags, env=env)
            try:
                adopt(reps)
                a, b = reps[0].http_url, reps[1].http_url
                # The overhead is measured through a proxy of replica A alone: the same replica both ways.
                with LocalProxy([a]) as proxy, httpx.Client(timeout=600) as client:
                    result = measure(client, a, b, proxy.url, args)
            finally:
                stop_all(reps)
    result |= {"engine": args.engine, "reps": args.reps, "cpu": common.cpu_model(),
               "load_1m": [load0, common.load_1m()]}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(
        f"engine {args.engine}, {args.reps} repetitions, {result['cpu']}, load {load0} -> {common.load_1m()}"
    )
    for h, row in result["turns"].items():
        print(f"history {h:>5} tokens: turn 2 sticky {common.fmt_spread(row['sticky_ms'], 1, 'ms')}, "
              f"moved {common.fmt_spread(row['moved_ms'], 1, 'ms')}, moved/sticky "
              f"{row['moved_over_sticky']:.2f}")  # fmt: skip
    for name, o in result["proxy"].items():
        print(f"proxy, {name}: direct {common.fmt_spread(o['direct_ms'], 2, 'ms')}, through the proxy "
              f"{common.fmt_spread(o['proxied_ms'], 2, 'ms')}, "
              f"overhead {common.fmt_spread(o['overhead_ms'], 2, 'ms')}")  # fmt: skip


def adopt(reps) -> None:
    """Both replicas serve version 0 of one run (session records belong to a run)."""
    import asyncio

    from maskroll.client import RolloutClient

    async def go(address: str) -> None:
        async with RolloutClient(address) as c:
            info = await c.info()
            if not info.run_id:
                await c.adopt_weights(info.weights_fingerprint, run_id="bench-run")

    for r in reps:
        asyncio.run(go(r.address))


def measure(client, a: str, b: str, proxied: str, args) -> dict:
    # Warm-up: each replica's first calls (and vLLM's first shapes) are not measured.
    for url in (a, b):
        session_turns(client, url, url, 64, f"warm-{url[-5:]}", 0)
    turns = {}
    for h in args.histories:
        sticky, moved = [], []
        for rep in range(args.reps):
            # Alternating order: slow drifts in load hit both alike.
            order = (("sticky", b), ("moved", b)) if rep % 2 else (("moved", b), ("sticky", b))
            for kind, other in order:
                seed = h * 1000 + rep * 2 + (kind == "moved")
                _, t2 = session_turns(
                    client, a, a if kind == "sticky" else other, h, f"{kind}-{h}-{rep}", seed
                )
                (sticky if kind == "sticky" else moved).append(t2 * 1e3)
        turns[h] = {"sticky_ms": common.spread(sticky), "moved_ms": common.spread(moved),
                    "moved_over_sticky": common.median_ratio(moved, sticky)}  # fmt: skip
    proxy = {}
    runs = [proxy_overhead(client, a, proxied, args.calls) for _ in range(args.reps)]
    for name in runs[0]:
        direct = [r[name][0] * 1e3 for r in runs]
        through = [r[name][1] * 1e3 for r in runs]
        overhead = [p - d for p, d in zip(through, direct, strict=True)]
        proxy[name] = {"direct_ms": common.spread(direct), "proxied_ms": common.spread(through),
                       "overhead_ms": common.spread(overhead)}  # fmt: skip
    return {"turns": turns, "proxy": proxy, "turn_tokens": TURN_TOKENS}


if __name__ == "__main__":
    sys.exit(main())
