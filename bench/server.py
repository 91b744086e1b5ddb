"""Rollout serving with vLLM on CPU: tokens/s with and without top-K logprobs, through gRPC vs in-process,
and the bytes per token of the wire format vs the same content as OpenAI-style JSON logprobs.

One VllmEngine on the tiny model (`maskroll init-model`, eager mode). Each measurement is R concurrent
requests x T tokens (stop tokens off, so every request makes exactly T tokens), timed from the first
request to the last token; tokens/s = R*T / seconds. Repetitions alternate K = 0 and K = K_max so that
drifting background load hits both alike; ratios are medians of per-repetition ratios of back-to-back
runs. The serving process's CPU time per token is reported too: unlike tokens/s it does not depend on
what else the machine runs. The serving path's own CPU per token is the gRPC run's less the in-process
run's (the engine's share), the median over back-to-back pairs; the child's start-up and connection
are outside its window (it reports "ready", starts on "go", says "done" at its last chunk). The replica
runs at its default settings (chunks gathered for up to `chunk_interval_ms`) unless --chunk-interval-ms
/ --chunk-max-tokens are given. First-token latency: each request's start to its first token.

    in-process   the engine's `generate` consumed in the engine's own event loop
    gRPC         a real replica (maskroll.server.app.start) around the same engine; the client
                 (maskroll.client.RolloutClient) runs in a child process, as a trainer would
    gRPC 1-proc  the same with the client on the server's event loop (client CPU counted against it)

--scripted measures the serving path alone, in seconds and without a model: the same comparison around
a scripted engine (precomputed outputs on a fixed step clock, `--step-ms`, whose own CPU is the
in-process run's), so the engine's cost is close to nothing and the difference is the serving path's.
Each repetition runs every path `--rounds` times (8) and sums CPU and tokens: one 16 x 128-token run is
~0.5 s, and a figure taken from one such run moved by ±30 % between repetitions; the engine alone
(in-process) runs both before and after the gRPC run, and its CPU is the mean of the two, so that slow
drift cancels. Even the engine alone moved by ±15 % between runs of 0.5 s on a quiet 2-core VM
(mostly the cost of waking from idle between steps), and the serving figure is a difference of two such
figures: at 3 rounds a median of 3 repetitions of the same code ranged 16-21 µs (2026-12-02).

Wire bytes: each GenerateChunk the client received, re-serialised (`maskroll.proto.wire.chunk_to_pb`,
deterministic) plus gRPC's 5-byte message prefix; HTTP/2 framing is left out of both sides. JSON: the
`logprobs.content[i]` entries the OpenAI chat-completions API returns for the same tokens (token string,
logprob, UTF-8 bytes, and `top_logprobs` of K such entries), serialised compactly as vLLM's OpenAI
server does (pydantic, no spaces, float32 widened to a Python float).

    python bench/server.py                       # R = 16, T = 128, K = 20, 5 repetitions
    python bench/server.py --reps 5 --json
    python bench/server.py --model DIR --requests 8 --tokens 64
    python bench/server.py --stream-interval 8      # vLLM streams every 8th token: fewer, larger chunks
    python bench/server.py --chunk-interval-ms 0    # every engine output its own chunk (the old behaviour)
    python bench/server.py --scripted --reps 5      # serving CPU per token without vLLM (seconds)
    python bench/server.py --scripted --reps 3 --baseline /tmp/base   # old tree vs this one, interleaved

Every figure over repetitions is reported as median [min, max], with the 1-minute load average at the
start and the end. `--baseline PATH` runs the same command (--reps 1) against another checkout and this
tree in alternation (bench/common.py `interleave`), so that before / after figures come from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from common import GRPC_PREFIX_BYTES, prompts

TARGET_K_RATIO = 0.85  # tokens/s with K = K_max over K = 0
TARGET_GRPC_RATIO = 0.9  # tokens/s through gRPC over in-process, at K = 0 and K = K_max (issue 14)
TARGET_SERVING_US = 20.0  # serving CPU per token at K = K_max, the engine's excluded (issue 14)
TARGET_BYTES_RATIO = 1 / 5  # wire bytes over JSON bytes


# ---- measurements -----------------------------------------------------------------------------------


async def run_inprocess(engine, n: int, tokens: int, k: int) -> dict:
    """R requests straight into the engine: tokens, seconds and each request's first-token latency."""
    import numpy as np

    from maskroll.server.engines.contract import EngineRequest, SamplingParams

    first_token: list[float] = []

    async def one(i: int, prompt: list[int]) -> int:
        params = SamplingParams(max_tokens=tokens, temperature=1.0, logprobs_k=k, seed=i)
        req = EngineRequest(f"bench-{time.monotonic_ns()}-{i}", np.asarray(prompt, np.int32), params)
        start, made = time.perf_counter(), 0
        async for o in engine.generate(req):
            if not made and len(o.token_ids):
                first_token.append(time.perf_counter() - start)
            made += len(o.token_ids)
        return made

    t0 = time.perf_counter()
    counts = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts(n))])
    seconds = time.perf_counter() - t0
    return {
        "tokens": sum(counts),
        "seconds": seconds,
        "first_token_ms": [round(1e3 * s, 2) for s in first_token],
    }


async def run_pipeline(pipeline, n: int, tokens: int, k: int) -> int:
    """R requests through the replica's serving pipeline without gRPC, each chunk made a protobuf
    message and serialised, as the servicer and gRPC do; the tokens made. The chunks are pushed
    (`Generation.push`, as a GenerateStream request's are), or read from `stream()` in a tree without
    push (before 2026-12-02's fourth cut, when GenerateStream read them so too)."""
    import contextlib

    import numpy as np

    from maskroll.proto.records import SamplingOptions
    from maskroll.proto.wire import chunk_to_pb

    async def one(i: int, prompt: list[int]) -> int:
        options = SamplingOptions(max_tokens=tokens, temperature=1.0, logprobs_k=k, seed=i, ignore_eos=True)
        gen = pipeline.prepare(np.asarray(prompt, np.int32), options)
        made = 0

        def send(c) -> None:
            nonlocal made
            made += len(c.token_ids)
            chunk_to_pb(c).SerializeToString()

        if hasattr(gen, "push"):
            await gen.push(send)
        else:
            async with contextlib.aclosing(gen.stream()) as chunks:
                async for c in chunks:
                    send(c)
        return made

    return sum(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts(n))]))


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
    address: str,
    model_dir: Path | None,
    n: int,
    tokens: int,
    k: int,
    sizes: bool = True,
    go=None,
    done=None,
    rounds: int = 1,
) -> dict:
    """go / done: called when connected (the clock starts after it) and when the last chunk arrived.
    rounds: the R requests this many times, one round after the other (figures summed)."""
    from maskroll.client import RolloutClient, SamplingOptions
    from maskroll.proto.wire import chunk_to_pb

    async with RolloutClient(address) as client:
        await client.info()  # connect before the clock starts
        if go is not None:
            await go()
        first_token: list[float] = []  # seconds from the call to its first chunk (its first token)

        async def one(i: int, prompt: list[int]) -> list:
            # ignore_eos: the replica adds the model's EOS as a stop token, the in-process runs have none;
            # every request makes exactly T tokens on both paths.
            options = SamplingOptions(
                max_tokens=tokens, temperature=1.0, logprobs_k=k, seed=i, ignore_eos=True
            )
            start, chunks = time.perf_counter(), []
            async for c in client.generate(prompt, options):
                if not chunks:
                    first_token.append(time.perf_counter() - start)
                chunks.append(c)
            return chunks

        t0, cpu0 = time.perf_counter(), time.process_time()
        streams = []
        for _ in range(rounds):
            streams += await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts(n))])
        seconds, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if done is not None:
            done()
        # The GenerateStream call's messages (the replica batches chunks of several requests; info()
        # above sends none on it). None: one Generate call per request (a message per chunk), as in a
        # --baseline tree from before GenerateStream.
        stream = getattr(client, "_stream", None)
        messages = stream.messages if stream is not None else None
    chunks = [c for s in streams for c in s]
    out = {
        "tokens": sum(len(c.token_ids) for c in chunks),
        "seconds": seconds,
        "chunks": len(chunks),
        "messages": len(chunks) if messages is None else messages,
        "first_token_ms": [round(1e3 * s, 2) for s in first_token],
        "client_cpu_s": client_cpu,  # the client process's (in 1-proc: the server's too)
    }
    if sizes and model_dir is not None:  # after the clock: re-serialising and JSON are not the workload
        out["wire_bytes"] = sum(len(chunk_to_pb(c).SerializeToString()) + GRPC_PREFIX_BYTES for c in chunks)
        out["json_bytes"] = openai_logprobs_json(chunks, token_table(model_dir)) if k else 0
    return out


def run_grpc_subprocess(
    address: str, model_dir: Path | None, n: int, tokens: int, k: int, rounds: int = 1
) -> dict:
    """One gRPC measurement with the client in a child process. `server_cpu_s`: this process's CPU time
    from telling the connected child to start until its result arrives (the child's start-up, imports
    and connection are not the serving path's)."""
    cmd = [
        sys.executable,
        __file__,
        "--client",
        address,
        *(["--model", str(model_dir)] if model_dir is not None else []),
        "--requests",
        str(n),
        "--tokens",
        str(tokens),
        "--k",
        str(k),
        "--rounds",
        str(rounds),
    ]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the benchmark client {cmd} did not start")
        cpu0 = time.process_time()
        child.stdin.write("go\n")
        child.stdin.flush()
        finished = child.stdout.readline().strip()
        cpu = time.process_time() - cpu0
        line = child.stdout.readline()
    if finished != "done":
        raise RuntimeError(f"the benchmark client said {finished!r}, expected 'done'")
    if child.returncode:
        raise RuntimeError(f"the benchmark client exited with {child.returncode}")
    return {**json.loads(line), "server_cpu_s": cpu}


# ---- the serving path alone: a scripted engine --------------------------------------------------------


def scripted_engine_class():
    """A scripted Engine (defined on first use: the Engine base class lives in maskroll.server)."""
    import numpy as np

    from maskroll.server.engines.contract import Engine, EngineLimits, EngineOutput

    class ScriptedEngine(Engine):
        """Precomputed tokens and logprobs on a fixed step clock, so that its own CPU is close to nothing.

        Every `step_s` each running request gets the next token, as a vLLM engine step gives every
        sequence one; a request whose consumer fell behind gets the tokens of all the steps it missed in
        one output, as vLLM merges the deltas of a lagging consumer (RequestOutputCollector)."""

        name, version, model_id = "scripted", "0", "scripted"

        def __init__(self, step_s: float, max_logprobs: int, max_tokens: int, vocab: int = 512) -> None:
            self.step_s = step_s
            self._limits = EngineLimits(
                vocab_size=vocab, max_model_len=max_tokens + 64, max_logprobs=max_logprobs
            )
            rng = np.random.default_rng(0)
            self._ids = rng.integers(0, vocab, (max_tokens, max_logprobs + 1), dtype=np.int32)  # [T, 1 + K]
            self._lp = -rng.random((max_tokens, max_logprobs + 1), dtype=np.float32)  # [T, 1 + K]
            self._ranks = rng.integers(1, 4, max_tokens, dtype=np.int32)  # [T]
            self._waiting: set[asyncio.Queue] = set()
            self._busy = asyncio.Event()
            self._clock: asyncio.Task | None = None

        @property
        def limits(self) -> EngineLimits:
            return self._limits

        @property
        def policy_version(self) -> int:
            return 0

        async def start(self) -> None:
            self._clock = asyncio.create_task(self._steps())

        async def close(self) -> None:
            if self._clock is not None:
                self._clock.cancel()
                await asyncio.gather(self._clock, return_exceptions=True)

        async def _steps(self) -> None:
            while True:
                await self._busy.wait()  # no step while no request runs
                await asyncio.sleep(self.step_s)
                for q in self._waiting:
                    q.put_nowait(None)

        async def update_weights(self, version: int, checkpoint_dir: Path) -> int:
            raise NotImplementedError

        async def generate(self, request):
            t, k = request.params.max_tokens, request.params.logprobs_k
            steps: asyncio.Queue = asyncio.Queue()
            self._waiting.add(steps)
            self._busy.set()
            done = 0
            try:
                while done < t:
                    await steps.get()
                    n = min(t - done, 1 + steps.qsize())
                    for _ in range(n - 1):
                        steps.get_nowait()
                    a, b = done, done + n
                    done = b
                    yield EngineOutput(
                        token_ids=self._ids[a:b, 0],
                        sampled_logprobs=self._lp[a:b, 0],
                        sampled_ranks=self._ranks[a:b],
                        topk_ids=self._ids[a:b, 1 : 1 + k],
                        topk_logprobs=self._lp[a:b, 1 : 1 + k],
                        policy_version=0,
                        finish_reason="length" if done == t else None,
                    )
            finally:
                self._waiting.discard(steps)
                if not self._waiting:
                    self._busy.clear()

    return ScriptedEngine


async def bench_scripted(args: argparse.Namespace) -> dict:
    """Serving CPU per token with the engine's cost taken out: the same scripted engine consumed
    in-process and served through gRPC (client in a child process), each repetition's process CPU time
    of the first subtracted from the second's."""
    from maskroll.server.app import start
    from maskroll.server.config import ServerConfig
    from maskroll.server.generation.pipeline import Pipeline

    n, t, kmax = args.requests, args.tokens, args.k
    load_start = common.load_1m()
    engine = scripted_engine_class()(args.step_ms / 1e3, kmax, t)
    await engine.start()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="maskroll-bench-") as tmp:
        (Path(tmp) / "config.json").write_text("{}")
        config = ServerConfig(
            model=Path(tmp), port=0, max_logprobs=kmax, replica_id="bench", **args.server_settings
        )
        replica = await start(config, engine)
        pipeline = Pipeline(engine, config)  # the replica's rules and chunking, without gRPC
        try:
            gc.freeze()  # as `maskroll serve` does once its replica has started (server/app.py serve)
            # A warm-up, not counted: a fresh replica's first RPCs pay one-time costs (imports, the first
            # connection, caches) that were 3-4x a repetition's CPU per token, and the first counted
            # repetition after one round of each path was still the slowest of seven (19.2 µs against
            # 13.3-17.8): three rounds of each path (then a whole repetition), so that with --baseline (a
            # process per repetition) every repetition is measured as warm as the later ones of a long run.
            rounds = args.rounds
            warm = min(rounds, 3)  # the amount measured to be enough (the old default of --rounds)
            for k in (0, kmax):
                for _ in range(warm):
                    await run_inprocess(engine, n, t, k)
                    await run_pipeline(pipeline, n, t, k)
                await asyncio.to_thread(run_grpc_subprocess, replica.address, None, n, t, k, warm)

            async def cpu_of(run) -> float:
                cpu0 = time.process_time()
                for _ in range(rounds):
                    await run()
                return time.process_time() - cpu0

            for rep in range(args.reps):
                for k in (0, kmax):
                    before = await cpu_of(lambda k=k: run_inprocess(engine, n, t, k))
                    row = await asyncio.to_thread(run_grpc_subprocess, replica.address, None, n, t, k, rounds)
                    after = await cpu_of(lambda k=k: run_inprocess(engine, n, t, k))
                    piped = await cpu_of(lambda k=k: run_pipeline(pipeline, n, t, k))
                    # the engine's CPU for the gRPC run between them: their mean (drift cancels)
                    cpu = {"inprocess_cpu_s": (before + after) / 2, "pipeline_cpu_s": piped}
                    runs.append({"rep": rep, "k": k, **cpu, **row})
        finally:
            await replica.drain(timeout_s=0)
            await engine.close()
    out = {
        "requests": n,
        "tokens_per_request": t,
        "step_ms": args.step_ms,
        "reps": args.reps,
        "rounds": args.rounds,
        "k": kmax,
    }
    for k in (0, kmax):
        rows = [r for r in runs if r["k"] == k]
        grpc = [r["server_cpu_s"] / r["tokens"] for r in rows]
        inproc = [r["inprocess_cpu_s"] / r["tokens"] for r in rows]
        serving = [1e6 * (g - e) for g, e in zip(grpc, inproc, strict=True)]
        # The serving path in two layers: maskroll's pipeline (pipeline run less in-process: validation,
        # chunks, records, protobuf) and gRPC's own (gRPC run less pipeline run: RPCs, messages, the wire).
        piped = [r["pipeline_cpu_s"] / r["tokens"] for r in rows]
        layers = {
            "pipeline": [1e6 * (q - e) for q, e in zip(piped, inproc, strict=True)],
            "grpc_layer": [1e6 * (g - q) for g, q in zip(grpc, piped, strict=True)],
        }
        out[f"k{k}"] = {
            # The median over the repetitions of back-to-back differences: the serving path's own CPU
            # per token (load drifts slowly, so pairing cancels most of what it adds to both).
            "serving_cpu_us_per_token": round(
                1e6 * statistics.median(g - e for g, e in zip(grpc, inproc, strict=True)), 1
            ),
            "serving_cpu_us_per_token_range": {s: round(v, 1) for s, v in common.spread(serving).items()},
            **{
                f"{name}_cpu_us_per_token_range": {s: round(v, 1) for s, v in common.spread(xs).items()}
                for name, xs in layers.items()
            },
            "engine_cpu_us_per_token": round(1e6 * statistics.median(inproc), 1),
            "client_cpu_us_per_token": round(
                1e6 * statistics.median(r["client_cpu_s"] / r["tokens"] for r in rows), 1
            ),
            "grpc_cpu_us_per_token_by_rep": [round(1e6 * x, 1) for x in grpc],
            "engine_cpu_us_per_token_by_rep": [round(1e6 * x, 1) for x in inproc],
            "tokens_per_chunk": round(statistics.median(r["tokens"] / r["chunks"] for r in rows), 2),
            "tokens_per_message": round(statistics.median(r["tokens"] / r["messages"] for r in rows), 2),
            "first_token_ms_median": round(
                statistics.median(x for r in rows for x in r["first_token_ms"]), 2
            ),
            "first_token_ms_max": max(x for r in rows for x in r["first_token_ms"]),
        }
    out["load_average_1m"] = [load_start, common.load_1m()]
    return out


def scripted_summary(r: dict) -> str:
    """--scripted in words: serving CPU per token as median [min, max] over the repetitions."""
    k = r["k"]
    return (
        f"serving CPU per token (scripted engine, {r['requests']} x {r['tokens_per_request']} tokens, "
        f"{r['reps']} reps of {r.get('rounds', 1)} rounds): "
        f"K=0 {common.fmt_spread(r['k0']['serving_cpu_us_per_token_range'])} µs, "
        f"K={k} {common.fmt_spread(r[f'k{k}']['serving_cpu_us_per_token_range'])} µs "
        f"(target <= {TARGET_SERVING_US:.0f} at K={k}); of it at K={k}: maskroll's pipeline "
        f"{common.fmt_spread(r[f'k{k}']['pipeline_cpu_us_per_token_range'])} µs, gRPC "
        f"{common.fmt_spread(r[f'k{k}']['grpc_layer_cpu_us_per_token_range'])} µs; client K={k} "
        f"{r[f'k{k}']['client_cpu_us_per_token']} µs; {r[f'k{k}']['tokens_per_chunk']} tokens/chunk, "
        f"{r[f'k{k}']['tokens_per_message']} tokens/message; "
        f"1-min load {r['load_average_1m'][0]} -> {r['load_average_1m'][1]}"
    )


def headline(r: dict) -> dict[str, float]:
    """The figures `--baseline` compares, from one run's JSON (scripted or vLLM)."""
    k = r["k"]
    if "k0" in r:  # --scripted
        return {
            f"serving µs/token K={k}": r[f"k{k}"]["serving_cpu_us_per_token"],
            "serving µs/token K=0": r["k0"]["serving_cpu_us_per_token"],
            f"pipeline µs/token K={k}": r[f"k{k}"]["pipeline_cpu_us_per_token_range"]["median"],
            f"gRPC layer µs/token K={k}": r[f"k{k}"]["grpc_layer_cpu_us_per_token_range"]["median"],
            f"client µs/token K={k}": r[f"k{k}"]["client_cpu_us_per_token"],
            f"engine µs/token K={k}": r[f"k{k}"]["engine_cpu_us_per_token"],
        }
    return {
        f"serving µs/token K={k}": r["serving_cpu_us_per_token"][str(k)],
        "serving µs/token K=0": r["serving_cpu_us_per_token"]["0"],
        f"gRPC/in-process tok/s K={k}": r["ratios"]["grpc_vs_inprocess_k"],
        "gRPC/in-process tok/s K=0": r["ratios"]["grpc_vs_inprocess_k0"],
        f"K={k}/K=0 tok/s in-process": r["ratios"]["k_vs_k0_inprocess"],
        f"client µs/token K={k}": r["client_cpu_us_per_token"][str(k)],
    }


# ---- orchestration ----------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, model_dir: Path) -> dict:
    from maskroll.server.app import start
    from maskroll.server.config import EngineConfig, ServerConfig
    from maskroll.server.engines.vllm_engine import VllmEngine

    n, t, kmax = args.requests, args.tokens, args.k
    engine = VllmEngine(
        model_dir,
        max_logprobs=kmax,
        max_batch=n,
        config=EngineConfig(enforce_eager=True, vllm_args={"stream_interval": str(args.stream_interval)}),
    )
    load_before = common.load_1m()
    t0 = time.perf_counter()
    await engine.start()
    startup = time.perf_counter() - t0
    replica = None
    runs: list[dict] = []  # one entry per (rep, path, K)
    try:
        await run_inprocess(engine, n, 8, kmax)  # first requests pay one-off initialisation
        config = ServerConfig(
            model=model_dir,
            engine="vllm",
            port=0,
            max_logprobs=kmax,
            max_batch=n,
            replica_id="bench",
            **args.server_settings,
        )
        replica = await start(config, engine)
        for rep in range(args.reps):
            for k in (0, kmax) if rep % 2 == 0 else (kmax, 0):
                cpu0 = time.process_time()
                row = await run_inprocess(engine, n, t, k)
                row["server_cpu_s"] = time.process_time() - cpu0
                runs.append({"rep": rep, "k": k, "path": "inprocess", **row})
                row = await asyncio.to_thread(run_grpc_subprocess, replica.address, model_dir, n, t, k)
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
    return summarise(runs, args, model_dir, engine.version, startup, (load_before, common.load_1m()))


def summarise(runs: list[dict], args, model_dir: Path, version: str, startup: float, load: tuple) -> dict:
    from maskroll.server.config import ServerConfig

    kmax, paths = args.k, ("inprocess", "grpc", "grpc_1proc")
    by = {(r["rep"], r["path"], r["k"]): r for r in runs}

    def tps(r: dict) -> float:
        return r["tokens"] / r["seconds"]

    def cpu_per_token(rep: int, path: str, k: int) -> float:
        r = by[(rep, path, k)]
        return r["server_cpu_s"] / r["tokens"]

    def median_ratio(num: tuple[str, int], den: tuple[str, int]) -> float:
        reps = range(args.reps)
        return common.median_ratio([tps(by[(i, *num)]) for i in reps], [tps(by[(i, *den)]) for i in reps])

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
        # The serving path's own CPU per token (µs): the gRPC run's server CPU less the back-to-back
        # in-process run's (the engine's share), median over the repetitions; neither the client nor
        # the engine is in it.
        "serving_cpu_us_per_token": {
            str(k): round(
                1e6
                * statistics.median(
                    cpu_per_token(i, "grpc", k) - cpu_per_token(i, "inprocess", k) for i in range(args.reps)
                ),
                1,
            )
            for k in (0, kmax)
        },
        "serving_cpu_us_per_token_range": {
            str(k): {
                stat: round(v, 1)
                for stat, v in common.spread(
                    1e6 * (cpu_per_token(i, "grpc", k) - cpu_per_token(i, "inprocess", k))
                    for i in range(args.reps)
                ).items()
            }
            for k in (0, kmax)
        },
        # Per-repetition ratios of back-to-back runs, median [min, max].
        "ratio_ranges": {
            name: {
                stat: round(v, 3)
                for stat, v in common.spread(
                    tps(by[(i, *num)]) / tps(by[(i, *den)]) for i in range(args.reps)
                ).items()
            }
            for name, num, den in (
                ("k_vs_k0_inprocess", ("inprocess", kmax), ("inprocess", 0)),
                ("grpc_vs_inprocess_k", ("grpc", kmax), ("inprocess", kmax)),
                ("grpc_vs_inprocess_k0", ("grpc", 0), ("inprocess", 0)),
            )
        },
        # CPU of the client process per token (µs): on a shared machine it competes with the server.
        "client_cpu_us_per_token": {
            str(k): round(
                1e6
                * statistics.median(
                    by[(i, "grpc", k)]["client_cpu_s"] / by[(i, "grpc", k)]["tokens"]
                    for i in range(args.reps)
                ),
                1,
            )
            for k in (0, kmax)
        },
        # Request sent to its first token (ms), median over every request of every repetition.
        "first_token_ms": {
            p: {
                str(k): round(
                    statistics.median(x for i in range(args.reps) for x in by[(i, p, k)]["first_token_ms"]), 1
                )
                for k in (0, kmax)
            }
            for p in paths
        },
        "chunk_settings": {
            # None: a maskroll from before chunks were gathered (one chunk per engine output)
            name: args.server_settings.get(
                name, getattr(ServerConfig.model_fields.get(name), "default", None)
            )
            for name in ("chunk_interval_ms", "chunk_max_tokens")
        },
        "wire_bytes_per_token": round(last["wire_bytes"] / last["tokens"], 1),
        "json_bytes_per_token": round(last["json_bytes"] / last["tokens"], 1),
        "tokens_per_chunk": round(last["tokens"] / last["chunks"], 2),
        "tokens_per_message": round(last["tokens"] / last.get("messages", last["chunks"]), 2),
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
        f"gRPC/in-process >= {TARGET_GRPC_RATIO} at K={kmax}": ratios["grpc_vs_inprocess_k"]
        >= TARGET_GRPC_RATIO,
        f"gRPC/in-process >= {TARGET_GRPC_RATIO} at K=0": ratios["grpc_vs_inprocess_k0"] >= TARGET_GRPC_RATIO,
        f"serving CPU <= {TARGET_SERVING_US:.0f} µs/token at K={kmax}": result["serving_cpu_us_per_token"][
            str(kmax)
        ]
        <= TARGET_SERVING_US,
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
        f"{'path':<26}{'K=0 tok/s':>11}{f'K={k} tok/s':>12}{'K=0 cpu µs/tok':>16}{f'K={k} cpu µs/tok':>17}"
        f"{'K=0 1st tok ms':>16}{f'K={k} 1st tok ms':>17}",
    ]
    first = r["first_token_ms"]
    names = {
        "inprocess": "in-process",
        "grpc": "gRPC (client process)",
        "grpc_1proc": "gRPC (client in server)",
    }
    for path, name in names.items():
        rows.append(
            f"{name:<26}{tps[path]['0']:>11.0f}{tps[path][str(k)]:>12.0f}"
            f"{cpu[path]['0']:>16.0f}{cpu[path][str(k)]:>17.0f}"
            f"{first[path]['0']:>16.1f}{first[path][str(k)]:>17.1f}"
        )
    chunking = r["chunk_settings"]
    serving, client = r["serving_cpu_us_per_token_range"], r["client_cpu_us_per_token"]
    rows += [
        "",
        f"serving CPU per token (gRPC less in-process, the engine's excluded), median [min, max]: K=0 "
        f"{common.fmt_spread(serving['0'])} µs, K={k} {common.fmt_spread(serving[str(k)])} µs; "
        f"chunks every <= {chunking['chunk_interval_ms']} ms or "
        f"{chunking['chunk_max_tokens']} tokens; the client process: K=0 {client['0']:.1f} µs, "
        f"K={k} {client[str(k)]:.1f} µs",
        f"K={k}/K=0: in-process {common.fmt_spread(r['ratio_ranges']['k_vs_k0_inprocess'], 3)}, "
        f"gRPC {ratios['k_vs_k0_grpc']:.3f}",
        f"gRPC/in-process: K={k} {common.fmt_spread(r['ratio_ranges']['grpc_vs_inprocess_k'], 3)}, "
        f"K=0 {common.fmt_spread(r['ratio_ranges']['grpc_vs_inprocess_k0'], 3)} "
        f"(client in the server process: {ratios['grpc_1proc_vs_inprocess_k']:.3f})",
        f"bytes/token at K={k}: wire {r['wire_bytes_per_token']:.0f} (protobuf + gRPC prefix, "
        f"{r['tokens_per_chunk']:.2f} tokens/chunk, {r['tokens_per_message']:.2f}/message), "
        f"OpenAI JSON logprobs {r['json_bytes_per_token']:.0f}: "
        f"ratio {ratios['wire_vs_json']:.3f}; at K=0 the wire carries {r['wire_bytes_per_token_k0']:.0f}",
        "",
        "targets: "
        + ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in r["targets_met"].items()),
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_model(p)
    p.add_argument("--requests", type=int, default=16, help="concurrent requests R")
    p.add_argument("--tokens", type=int, default=128, help="tokens per request T")
    p.add_argument("--k", type=int, default=20, help="top-K logprobs in the K > 0 runs")
    common.add_reps(p, 5)
    common.add_baseline(p)
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="vLLM stream_interval: tokens per streamed output (1 = every token, vLLM's default)",
    )
    p.add_argument(
        "--scripted",
        action="store_true",
        help="measure the serving path alone: a scripted engine instead of vLLM (no model, seconds)",
    )
    p.add_argument("--step-ms", type=float, default=4.0, help="--scripted: engine step (one token each)")
    p.add_argument(
        "--rounds",
        type=int,
        default=8,
        help="--scripted: each path runs the R requests this many times per repetition (CPU and tokens "
        "summed), so that one repetition's figure is not one 0.5 s run's noise",
    )
    p.add_argument(
        "--chunk-interval-ms",
        type=float,
        help="the replica's chunk_interval_ms (default: the server's default)",
    )
    p.add_argument(
        "--chunk-max-tokens", type=int, help="the replica's chunk_max_tokens (default: the server's)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)  # child: one gRPC measurement
    args = p.parse_args(argv)

    if args.client:  # connect, say "ready", start on "go"

        async def go() -> None:
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)

        def done() -> None:
            print("done", flush=True)

        result = run_grpc_client(
            args.client, args.model, args.requests, args.tokens, args.k, go=go, done=done, rounds=args.rounds
        )
        print(json.dumps(asyncio.run(result)), flush=True)
        return 0

    if args.baseline:
        return common.run_baseline(__file__, argv, args, headline)
    # Only the settings given, so that the server's own defaults are what is measured otherwise.
    args.server_settings = {
        name: value
        for name, value in (
            ("chunk_interval_ms", args.chunk_interval_ms),
            ("chunk_max_tokens", args.chunk_max_tokens),
        )
        if value is not None
    }
    if args.scripted:
        result = asyncio.run(bench_scripted(args))
        print(scripted_summary(result), file=sys.stderr, flush=True)
        print(json.dumps(result, indent=2))
        return 0

    with tempfile.TemporaryDirectory(prefix="maskroll-bench-") as tmp:
        common.vllm_run_env(Path(tmp))
        result = asyncio.run(bench(args, common.model_dir(args.model, Path(tmp))))
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":  # vLLM's engine-core process re-imports this module: keep the guard
    sys.exit(main())
