"""Rollout serving with vLLM on CPU: tokens/s with and without top-K logprobs, through gRPC vs in-process,
and the bytes per token of the wire format vs the same content as OpenAI-style JSON logprobs.

One VllmEngine on the tiny model (`maskroll init-model`, eager mode). Each measurement is R concurrent
requests x T tokens (stop tokens off, so every request makes exactly T tokens), timed from the first
request to the last token; tokens/s = R*T / seconds. Repetitions alternate K = 0 and K = K_max so that
drifting background load hits both alike; ratios are medians of per-repetition ratios of back-to-back
runs. The serving process's CPU time per token is reported too: unlike tokens/s it does not depend on
what else the machine runs.

    in-process   the engine's `generate` consumed in the engine's own event loop
    gRPC         a real replica (maskroll.server.app.start) around the same engine; the client
                 (maskroll.client.RolloutClient) runs in a child process, as a trainer would
    gRPC 1-proc  the same with the client on the server's event loop (client CPU counted against it)

Wire bytes: each GenerateChunk the client received, re-serialised (`maskroll.client.wire.chunk_to_pb`,
deterministic) plus gRPC's 5-byte message prefix; HTTP/2 framing is left out of both sides. JSON: the
`logprobs.content[i]` entries the OpenAI chat-completions API returns for the same tokens (token string,
logprob, UTF-8 bytes, and `top_logprobs` of K such entries), serialised compactly as vLLM's OpenAI
server does (pydantic, no spaces, float32 widened to a Python float).

    python bench/server.py                       # R = 16, T = 128, K = 20, 5 repetitions
    python bench/server.py --reps 5 --json
    python bench/server.py --model DIR --requests 8 --tokens 64
    python bench/server.py --stream-interval 8      # vLLM streams every 8th token: fewer, larger chunks
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `python bench/server.py` puts bench/ first on sys.path, where a sibling named like a standard module
# (bench/queue.py) would shadow it for torch and grpc; nothing here imports a sibling.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

TARGET_K_RATIO = 0.85  # tokens/s with K = K_max over K = 0
TARGET_GRPC_RATIO = 0.85  # tokens/s through gRPC over in-process
TARGET_BYTES_RATIO = 1 / 5  # wire bytes over JSON bytes
GRPC_PREFIX_BYTES = 5  # gRPC length-prefixed message: 1 flag byte + 4 length bytes


def prompts(n: int) -> list[list[int]]:
    """Distinct short byte prompts after <bos> (256), 8..23 tokens."""
    return [[256, *(b"request %d: " % i), *(b"abc" * (i % 6))] for i in range(n)]


# ---- measurements -----------------------------------------------------------------------------------


async def run_inprocess(engine, n: int, tokens: int, k: int) -> tuple[int, float]:
    import numpy as np

    from maskroll.server.engine import EngineRequest, SamplingParams

    async def one(i: int, prompt: list[int]) -> int:
        params = SamplingParams(max_tokens=tokens, temperature=1.0, logprobs_k=k, seed=i)
        req = EngineRequest(f"bench-{time.monotonic_ns()}-{i}", np.asarray(prompt, np.int32), params)
        return sum([len(o.token_ids) async for o in engine.generate(req)])

    t0 = time.perf_counter()
    counts = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts(n))])
    return sum(counts), time.perf_counter() - t0


def openai_logprobs_json(chunks, vocab: list[tuple[str, list[int]]]) -> int:
    """Bytes of the OpenAI `logprobs.content` entries for the chunks' tokens (compact JSON)."""

    def entry(tok: int, lp: float) -> dict:
        text, raw = vocab[tok]
        return {"token": text, "logprob": float(lp), "bytes": raw}

    total = 0
    for c in chunks:
        content = []
        for i, tok in enumerate(c.token_ids.tolist()):
            e = entry(tok, c.sampled_logprobs[i])
            e["top_logprobs"] = [
                entry(t, v) for t, v in zip(c.topk_ids[i].tolist(), c.topk_logprobs[i].tolist(), strict=True)
            ]
            content.append(e)
        total += len(json.dumps({"content": content}, separators=(",", ":"), ensure_ascii=False).encode())
    return total


def token_table(model_dir: Path) -> list[tuple[str, list[int]]]:
    """id -> (token string, UTF-8 bytes) as an OpenAI server would report them for the byte tokenizer:
    a lone byte that is not valid UTF-8 is shown as the replacement character, its bytes are exact."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    table = []
    for i in range(tok.get_vocab_size()):
        if i < 256:
            table.append((bytes([i]).decode("utf-8", errors="replace"), [i]))
        else:
            text = tok.id_to_token(i)
            table.append((text, list(text.encode())))
    return table


async def run_grpc_client(
    address: str, model_dir: Path, n: int, tokens: int, k: int, sizes: bool = True
) -> dict:
    from maskroll.client import RolloutClient, SamplingOptions
    from maskroll.client.wire import chunk_to_pb

    async with RolloutClient(address) as client:
        await client.info()  # connect before the clock starts

        async def one(i: int, prompt: list[int]) -> list:
            options = SamplingOptions(max_tokens=tokens, temperature=1.0, logprobs_k=k, seed=i)
            return [c async for c in client.generate(prompt, options)]

        t0 = time.perf_counter()
        streams = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts(n))])
        seconds = time.perf_counter() - t0
    chunks = [c for s in streams for c in s]
    out = {"tokens": sum(len(c.token_ids) for c in chunks), "seconds": seconds, "chunks": len(chunks)}
    if sizes:  # after the clock: re-serialising and building JSON is the measurement, not the workload
        out["wire_bytes"] = sum(len(chunk_to_pb(c).SerializeToString()) + GRPC_PREFIX_BYTES for c in chunks)
        out["json_bytes"] = openai_logprobs_json(chunks, token_table(model_dir)) if k else 0
    return out


def run_grpc_subprocess(address: str, model_dir: Path, n: int, tokens: int, k: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--client",
        address,
        "--model",
        str(model_dir),
        "--requests",
        str(n),
        "--tokens",
        str(tokens),
        "--k",
        str(k),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- orchestration ----------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, model_dir: Path) -> dict:
    from maskroll.server.app import start
    from maskroll.server.config import EngineConfig, ServerConfig
    from maskroll.server.vllm_engine import VllmEngine

    n, t, kmax = args.requests, args.tokens, args.k
    engine = VllmEngine(
        model_dir,
        max_logprobs=kmax,
        max_batch=n,
        config=EngineConfig(enforce_eager=True, vllm_args={"stream_interval": str(args.stream_interval)}),
    )
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    await engine.start()
    startup = time.perf_counter() - t0
    replica = None
    runs: list[dict] = []  # one entry per (rep, path, K)
    try:
        await run_inprocess(engine, n, 8, kmax)  # first requests pay one-off initialisation
        config = ServerConfig(
            model=model_dir, engine="vllm", port=0, max_logprobs=kmax, max_batch=n, replica_id="bench"
        )
        replica = await start(config, engine)
        for rep in range(args.reps):
            for k in (0, kmax) if rep % 2 == 0 else (kmax, 0):
                cpu0 = time.process_time()
                tokens, seconds = await run_inprocess(engine, n, t, k)
                row = {"tokens": tokens, "seconds": seconds, "server_cpu_s": time.process_time() - cpu0}
                runs.append({"rep": rep, "k": k, "path": "inprocess", **row})
                cpu0 = time.process_time()
                row = await asyncio.to_thread(run_grpc_subprocess, replica.address, model_dir, n, t, k)
                row["server_cpu_s"] = time.process_time() - cpu0
                runs.append({"rep": rep, "k": k, "path": "grpc", **row})
                cpu0 = time.process_time()
                row = await run_grpc_client(replica.address, model_dir, n, t, k, sizes=False)
                row["server_cpu_s"] = time.process_time() - cpu0
                runs.append({"rep": rep, "k": k, "path": "grpc_1proc", **row})
                print(
                    f"  rep {rep} K={k:>2}: "
                    + ", ".join(f"{r['path']} {r['tokens'] / r['seconds']:.0f} tok/s" for r in runs[-3:]),
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if replica is not None:
            await replica.drain(timeout_s=0)
        await engine.close()
    return summarise(runs, args, model_dir, engine.version, startup, (load_before, os.getloadavg()[0]))


def summarise(runs: list[dict], args, model_dir: Path, version: str, startup: float, load: tuple) -> dict:
    kmax, paths = args.k, ("inprocess", "grpc", "grpc_1proc")
    by = {(r["rep"], r["path"], r["k"]): r for r in runs}

    def tps(r: dict) -> float:
        return r["tokens"] / r["seconds"]

    def median_ratio(num: tuple[str, int], den: tuple[str, int]) -> float:
        # Per-repetition ratios of back-to-back runs, then the median: background load drifts slowly,
        # so pairing cancels most of it.
        return statistics.median(tps(by[(i, *num)]) / tps(by[(i, *den)]) for i in range(args.reps))

    last = by[(args.reps - 1, "grpc", kmax)]
    last0 = by[(args.reps - 1, "grpc", 0)]
    result = {
        "engine": f"vllm {version}",
        "model": str(model_dir),
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "k": kmax,
        "stream_interval": args.stream_interval,
        "reps": args.reps,
        "startup_s": round(startup, 1),
        "load_average_1m": [round(x, 2) for x in load],
        "tokens_per_s": {
            p: {
                str(k): round(statistics.median(tps(by[(i, p, k)]) for i in range(args.reps)), 1)
                for k in (0, kmax)
            }
            for p in paths
        },
        # CPU of the serving process per token (µs): vLLM front end + gRPC server (+ client in 1-proc).
        "server_cpu_us_per_token": {
            p: {
                str(k): round(
                    1e6
                    * statistics.median(
                        by[(i, p, k)]["server_cpu_s"] / by[(i, p, k)]["tokens"] for i in range(args.reps)
                    ),
                    1,
                )
                for k in (0, kmax)
            }
            for p in paths
        },
        "wire_bytes_per_token": round(last["wire_bytes"] / last["tokens"], 1),
        "json_bytes_per_token": round(last["json_bytes"] / last["tokens"], 1),
        "tokens_per_chunk": round(last["tokens"] / last["chunks"], 2),
        "wire_bytes_per_token_k0": round(last0["wire_bytes"] / last0["tokens"], 1),
        "ratios": {
            "k_vs_k0_inprocess": round(median_ratio(("inprocess", kmax), ("inprocess", 0)), 3),
            "k_vs_k0_grpc": round(median_ratio(("grpc", kmax), ("grpc", 0)), 3),
            "grpc_vs_inprocess_k": round(median_ratio(("grpc", kmax), ("inprocess", kmax)), 3),
            "grpc_vs_inprocess_k0": round(median_ratio(("grpc", 0), ("inprocess", 0)), 3),
            "grpc_1proc_vs_inprocess_k": round(median_ratio(("grpc_1proc", kmax), ("inprocess", kmax)), 3),
            "wire_vs_json": round(last["wire_bytes"] / last["json_bytes"], 3),
        },
        "runs": runs,
    }
    ratios = result["ratios"]
    result["targets_met"] = {
        f"K={kmax}/K=0 >= {TARGET_K_RATIO}": ratios["k_vs_k0_inprocess"] >= TARGET_K_RATIO,
        f"gRPC/in-process >= {TARGET_GRPC_RATIO}": ratios["grpc_vs_inprocess_k"] >= TARGET_GRPC_RATIO,
        "wire <= JSON/5": ratios["wire_vs_json"] <= TARGET_BYTES_RATIO,
    }
    return result


def table(r: dict) -> str:
    k, tps, cpu, ratios = r["k"], r["tokens_per_s"], r["server_cpu_us_per_token"], r["ratios"]
    rows = [
        f"vLLM on CPU ({r['engine']}), {r['requests']} concurrent x {r['tokens_per_request']} tokens, "
        f"stream_interval {r['stream_interval']}, median of {r['reps']} reps "
        f"(engine start-up {r['startup_s']} s, 1-min load average "
        f"{r['load_average_1m'][0]} -> {r['load_average_1m'][1]})",
        "",
        f"{'path':<26}{'K=0 tok/s':>11}{f'K={k} tok/s':>12}{'K=0 cpu µs/tok':>16}{f'K={k} cpu µs/tok':>17}",
    ]
    names = {
        "inprocess": "in-process",
        "grpc": "gRPC (client process)",
        "grpc_1proc": "gRPC (client in server)",
    }
    for path, name in names.items():
        rows.append(
            f"{name:<26}{tps[path]['0']:>11.0f}{tps[path][str(k)]:>12.0f}"
            f"{cpu[path]['0']:>16.0f}{cpu[path][str(k)]:>17.0f}"
        )
    rows += [
        "",
        f"K={k}/K=0: in-process {ratios['k_vs_k0_inprocess']:.3f}, gRPC {ratios['k_vs_k0_grpc']:.3f}",
        f"gRPC/in-process: K={k} {ratios['grpc_vs_inprocess_k']:.3f}, "
        f"K=0 {ratios['grpc_vs_inprocess_k0']:.3f} "
        f"(client in the server process: {ratios['grpc_1proc_vs_inprocess_k']:.3f})",
        f"bytes/token at K={k}: wire {r['wire_bytes_per_token']:.0f} (protobuf + gRPC prefix, "
        f"{r['tokens_per_chunk']:.2f} tokens/chunk), OpenAI JSON logprobs {r['json_bytes_per_token']:.0f}: "
        f"ratio {ratios['wire_vs_json']:.3f}; at K=0 the wire carries {r['wire_bytes_per_token_k0']:.0f}",
        "",
        "targets: "
        + ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in r["targets_met"].items()),
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="model directory (default: a fresh `maskroll init-model`)")
    p.add_argument("--requests", type=int, default=16, help="concurrent requests R")
    p.add_argument("--tokens", type=int, default=128, help="tokens per request T")
    p.add_argument("--k", type=int, default=20, help="top-K logprobs in the K > 0 runs")
    p.add_argument("--reps", type=int, default=5, help="repetitions (median)")
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="vLLM stream_interval: tokens per streamed output (1 = every token, vLLM's default)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)  # child: one gRPC measurement
    args = p.parse_args(argv)

    if args.client:
        print(
            json.dumps(
                asyncio.run(run_grpc_client(args.client, args.model, args.requests, args.tokens, args.k))
            )
        )
        return 0

    with tempfile.TemporaryDirectory(prefix="maskroll-bench-") as tmp:
        from maskroll.server.vllm_engine import default_cache_env

        default_cache_env(Path(tmp) / "vllm-env")  # caches and IPC sockets of this run only
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the result
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        model_dir = args.model
        if model_dir is None:
            from maskroll.server.model_init import init_model

            model_dir = init_model(Path(tmp) / "model", seed=0)
        result = asyncio.run(bench(args, model_dir))
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":  # vLLM's engine-core process re-imports this module: keep the guard
    sys.exit(main())
