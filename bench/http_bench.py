"""The HTTP / OpenAI front end against gRPC on one replica: tokens/s of streaming the same load both ways,
and the bytes per token of OpenAI-style JSON against the packed gRPC record.

One engine (torch by default, `--engine vllm` for vLLM on CPU) behind one replica with both front ends
(maskroll.server.app.start with http_port 0). Each measurement is R concurrent requests x T tokens
(ignore_eos, so every request makes exactly T tokens; sample seeds 0..R-1 on both paths, so both
generate the same tokens), with K top-K logprobs, timed from the first request to the last token by a
client in a child process, as a trainer or an agent would be:

    gRPC   maskroll.client.RolloutClient.generate (chunks of packed arrays)
    HTTP   POST /v1/completions with the prompt's token ids, stream=true, logprobs=K, return_token_ids:
           Server-Sent Events read with httpx, each event parsed with json.loads (what a lean client does;
           the official openai client adds its own parsing on top, on the client's CPU)

Repetitions alternate the order of the two paths; the ratio is the median of per-repetition ratios of
back-to-back runs, so slow drifts in background load cancel. The serving process's CPU time per token is
reported too: unlike tokens/s it does not depend on what else the machine runs.

Bytes per token at K: the SSE bytes the HTTP client received (every `data:` line: token text, logprob,
bytes, top-K entries, token ids), the same content as one non-streaming OpenAI JSON response, the gRPC
chunks re-serialised (plus gRPC's 5-byte prefix), and the finished RolloutRecord as published to Redis
(`wire.encode_record`). HTTP/1.1 and HTTP/2 framing are left out of both sides. Chat JSON: one
non-streaming chat completion's body (logprobs.content entries carry `bytes` and K entries each).

    python bench/http_bench.py                   # torch engine, R = 8, T = 64, K = 20, 5 repetitions
    python bench/http_bench.py --engine vllm --requests 16 --tokens 128
    python bench/http_bench.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from common import GRPC_PREFIX_BYTES, prompts

TARGET_HTTP_RATIO = 0.8  # tokens/s through HTTP streaming over gRPC streaming
TOKEN = "bench-token-0123456789abcdef"


# ---- clients (child processes) ------------------------------------------------------------------------


async def grpc_client(address: str, n: int, tokens: int, k: int) -> dict:
    from maskroll.client import RolloutClient, SamplingOptions
    from maskroll.proto import wire

    async with RolloutClient(address, token=TOKEN) as client:
        await client.info()  # connected before the clock starts

        async def one(i: int, prompt: list[int]) -> list:
            options = SamplingOptions(max_tokens=tokens, logprobs_k=k, seed=i, ignore_eos=True)
            return [c async for c in client.generate(prompt, options, include_record_arrays=True)]

        t0 = time.perf_counter()
        streams = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts(n))])
        seconds = time.perf_counter() - t0
    chunks = [c for s in streams for c in s]
    records = [c.record for c in chunks if c.record is not None]
    for c in chunks:  # the wire size of the streamed chunks themselves, without the repeated arrays
        c.record = None
    return {
        "tokens": sum(len(c.token_ids) for c in chunks),
        "seconds": seconds,
        "chunks": len(chunks),
        "wire_bytes": sum(len(wire.chunk_to_pb(c).SerializeToString()) + GRPC_PREFIX_BYTES for c in chunks),
        "record_bytes": sum(len(wire.encode_record(r)) for r in records),
        "ids": [r.completion_ids.tolist() for r in records],
    }


async def http_client(base: str, n: int, tokens: int, k: int) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}"}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600, limits=limits) as client:
        # n connections open before the clock starts (as the gRPC client's one channel is); the model's name
        warm = await asyncio.gather(*[client.get("/v1/models") for _ in range(n)])
        model = warm[0].json()["data"][0]["id"]

        async def one(i: int, prompt: list[int]) -> tuple[int, int, list[int]]:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": tokens,
                "seed": i,
                "logprobs": k,
                "stream": True,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            size, ids = 0, []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    size += len(line.encode()) + 1
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0]["token_ids"]
            return size, len(ids), ids

        t0 = time.perf_counter()
        results = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts(n))])
        seconds = time.perf_counter() - t0
    return {
        "tokens": sum(t for _, t, _ in results),
        "seconds": seconds,
        "sse_bytes": sum(s for s, _, _ in results),
        "ids": [ids for _, _, ids in results],
    }


async def http_sizes(base: str, n: int, tokens: int, k: int) -> dict:
    """One non-streaming completions and one chat response of `tokens` tokens: their bytes (after the
    timed runs, so their engine work is not counted against either path)."""
    import httpx

    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600
    ) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        common = {
            "model": model,
            "max_tokens": tokens,
            "seed": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        whole = await c.post("/v1/completions", json={**common, "prompt": prompts(1)[0], "logprobs": k})
        messages = [{"role": "user", "content": "request 0"}]
        chat = await c.post(
            "/v1/chat/completions", json={**common, "messages": messages, "logprobs": True, "top_logprobs": k}
        )
    return {
        "json_bytes_one": len(whole.content),
        "json_tokens_one": whole.json()["usage"]["completion_tokens"],
        "chat_json_bytes_one": len(chat.content),
        "chat_json_tokens_one": chat.json()["usage"]["completion_tokens"],
    }


def run_client(kind: str, target: str, n: int, tokens: int, k: int) -> dict:
    cmd = [sys.executable, __file__, "--client", kind, target]
    cmd += ["--requests", str(n), "--tokens", str(tokens), "--k", str(k)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    # the client's CPU (start-up included): on a small machine it competes with the server for cores
    row["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return row


# ---- orchestration ----------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, model_dir: Path) -> dict:
    from maskroll.server.app import start
    from maskroll.server.config import EngineConfig, ServerConfig

    n, t, k = args.requests, args.tokens, args.k
    args.load_start = common.load_1m()
    config = ServerConfig(
        model=model_dir,
        engine=args.engine,
        engine_config=EngineConfig(enforce_eager=True) if args.engine == "vllm" else EngineConfig(),
        port=0,
        http_port=0,
        auth_token=TOKEN,
        max_logprobs=k,
        max_batch=n,
        threads=args.threads,
        replica_id="bench",
    )
    t0 = time.perf_counter()
    replica = await start(config)
    startup = time.perf_counter() - t0
    grpc_target, http_target = replica.address, f"http://127.0.0.1:{replica.http.port}"
    runs: list[dict] = []
    try:
        await asyncio.to_thread(run_client, "http", http_target, n, 4, k)  # warm both paths up
        await asyncio.to_thread(run_client, "grpc", grpc_target, n, 4, k)
        for rep in range(args.reps):
            for path in ("grpc", "http") if rep % 2 == 0 else ("http", "grpc"):
                cpu0 = time.process_time()
                row = await asyncio.to_thread(
                    run_client, path, grpc_target if path == "grpc" else http_target, n, t, k
                )
                row["server_cpu_s"] = time.process_time() - cpu0
                runs.append({"rep": rep, "path": path, **row})
            last = runs[-2:]
            print(
                f"  rep {rep}: "
                + ", ".join(f"{r['path']} {r['tokens'] / r['seconds']:.0f} tok/s" for r in last),
                file=sys.stderr,
                flush=True,
            )
        sizes = await asyncio.to_thread(run_client, "sizes", http_target, n, t, k)
    finally:
        await replica.drain(timeout_s=0)
    return summarise(runs, sizes, args, model_dir, replica.engine, startup)


def summarise(runs: list[dict], sizes: dict, args, model_dir: Path, engine, startup: float) -> dict:
    by = {(r["rep"], r["path"]): r for r in runs}
    reps = range(args.reps)

    def tps(r: dict) -> float:
        return r["tokens"] / r["seconds"]

    g, h = by[(args.reps - 1, "grpc")], by[(args.reps - 1, "http")]
    result = {
        "engine": f"{engine.name} {engine.version}",
        "model": str(model_dir),
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "k": args.k,
        "reps": args.reps,
        "startup_s": round(startup, 1),
        "load_average_1m": [getattr(args, "load_start", None), common.load_1m()],
        "same_tokens": g["ids"] == h["ids"],
        "tokens_per_s": {
            p: round(statistics.median(tps(by[(i, p)]) for i in reps), 1) for p in ("grpc", "http")
        },
        "server_cpu_us_per_token": {
            p: round(
                1e6 * statistics.median(by[(i, p)]["server_cpu_s"] / by[(i, p)]["tokens"] for i in reps), 1
            )
            for p in ("grpc", "http")
        },
        "client_cpu_us_per_token": {
            p: round(
                1e6 * statistics.median(by[(i, p)]["client_cpu_s"] / by[(i, p)]["tokens"] for i in reps), 1
            )
            for p in ("grpc", "http")
        },
        "http_vs_grpc": round(
            common.median_ratio([tps(by[(i, "http")]) for i in reps], [tps(by[(i, "grpc")]) for i in reps]), 3
        ),
        # median [min, max] of the per-repetition ratios and of each path's tokens/s
        "http_vs_grpc_range": {
            stat: round(v, 3)
            for stat, v in common.spread(tps(by[(i, "http")]) / tps(by[(i, "grpc")]) for i in reps).items()
        },
        "tokens_per_s_range": {
            p: {stat: round(v, 1) for stat, v in common.spread(tps(by[(i, p)]) for i in reps).items()}
            for p in ("grpc", "http")
        },
        "bytes_per_token": {
            "openai_sse": round(h["sse_bytes"] / h["tokens"], 1),
            "openai_json": round(sizes["json_bytes_one"] / sizes["json_tokens_one"], 1),
            "openai_chat_json": round(sizes["chat_json_bytes_one"] / sizes["chat_json_tokens_one"], 1),
            "grpc_chunks": round(g["wire_bytes"] / g["tokens"], 1),
            "grpc_record": round(g["record_bytes"] / g["tokens"], 1),
        },
        "runs": [{k: v for k, v in r.items() if k != "ids"} for r in runs],
    }
    b = result["bytes_per_token"]
    result["record_vs_openai_json"] = round(b["grpc_record"] / b["openai_json"], 3)
    result["record_vs_openai_chat_json"] = round(b["grpc_record"] / b["openai_chat_json"], 3)
    result["targets_met"] = {f"HTTP/gRPC >= {TARGET_HTTP_RATIO}": result["http_vs_grpc"] >= TARGET_HTTP_RATIO}
    return result


def table(r: dict) -> str:
    k, cpu, b = r["k"], r["server_cpu_us_per_token"], r["bytes_per_token"]
    ccpu = r["client_cpu_us_per_token"]
    rows = [
        f"{r['engine']}, {r['requests']} concurrent x {r['tokens_per_request']} tokens, K = {k}, "
        f"median of {r['reps']} reps (start-up {r['startup_s']} s, "
        f"1-min load average {r['load_average_1m'][0]} -> {r['load_average_1m'][1]}; "
        f"both paths sampled the same tokens: {r['same_tokens']})",
        "",
        f"{'path':<34}{'tok/s median [min, max]':>26}{'server cpu µs/tok':>20}{'client cpu µs/tok':>20}",
        *(
            f"{name:<34}{common.fmt_spread(r['tokens_per_s_range'][p], 0):>26}{cpu[p]:>20.0f}{ccpu[p]:>20.0f}"
            for p, name in (
                ("grpc", "gRPC streaming (RolloutClient)"),
                ("http", "HTTP streaming (SSE completions)"),
            )
        ),
        "",
        f"HTTP/gRPC tokens/s: {common.fmt_spread(r['http_vs_grpc_range'], 3)} (median [min, max] of "
        f"per-repetition ratios; target >= {TARGET_HTTP_RATIO})",
        f"bytes/token at K={k}: OpenAI completions SSE {b['openai_sse']:.0f}, completions JSON "
        f"{b['openai_json']:.0f}, chat JSON {b['openai_chat_json']:.0f}; gRPC chunks {b['grpc_chunks']:.0f}, "
        f"packed record {b['grpc_record']:.0f} (record / completions JSON {r['record_vs_openai_json']:.3f}, "
        f"/ chat JSON {r['record_vs_openai_chat_json']:.3f})",
        "",
        "targets: "
        + ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in r["targets_met"].items()),
    ]
    return "\n".join(rows)


def headline(r: dict) -> dict[str, float]:
    """The figures `--baseline` compares, from one run's JSON."""
    return {
        "HTTP/gRPC tokens/s": r["http_vs_grpc"],
        "gRPC tokens/s": r["tokens_per_s"]["grpc"],
        "HTTP tokens/s": r["tokens_per_s"]["http"],
        "HTTP server µs/token": r["server_cpu_us_per_token"]["http"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_model(p)
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch")
    p.add_argument("--requests", type=int, default=8, help="concurrent requests R")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request T")
    p.add_argument("--k", type=int, default=20, help="top-K logprobs")
    common.add_reps(p, 5)
    common.add_baseline(p)
    p.add_argument("--threads", type=int, default=None, help="torch engine threads")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--client", nargs=2, metavar=("KIND", "TARGET"), help=argparse.SUPPRESS)  # child
    args = p.parse_args(argv)

    if args.client:
        kind, target = args.client
        fn = {"grpc": grpc_client, "http": http_client, "sizes": http_sizes}[kind]
        print(json.dumps(asyncio.run(fn(target, args.requests, args.tokens, args.k))))
        return 0

    if args.baseline:
        return common.run_baseline(__file__, argv, args, headline, digits=3)
    with tempfile.TemporaryDirectory(prefix="maskroll-bench-http-") as tmp:
        if args.engine == "vllm":
            common.vllm_run_env(Path(tmp))
        result = asyncio.run(bench(args, common.model_dir(args.model, Path(tmp))))
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":  # vLLM's engine-core process re-imports this module: keep the guard
    sys.exit(main())
