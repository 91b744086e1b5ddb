"""Rank 0's serial work per step when it reads and scatters (client/ranks.py, docs/architecture.md flow 9):
decode a global batch of records, split it by groups (`split_groups`) and pickle one share per rank, as
the gloo scatter does; and one rank's unpickling of its share. No Redis and no network: those are
estimated in the doc from the bytes printed here.

    .venv/bin/python bench/rank0_scatter.py --ranks 64 --per-rank 8 --tokens 1000 --k 20 --reps 3

Prints one JSON object: bytes per record and per batch, and median / min / max milliseconds of each part.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time

import common


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument(
        "--per-rank", type=int, default=8, help="records per rank (the global batch: ranks × this)"
    )
    p.add_argument("--tokens", type=int, default=1000, help="completion tokens per record")
    p.add_argument("--k", type=int, default=20, help="top-K logprobs per token")
    p.add_argument("--group", type=int, default=8, help="GRPO group size")
    common.add_reps(p, 3)
    a = p.parse_args()

    import numpy as np

    from maskroll.client import split_groups
    from maskroll.proto import wire
    from maskroll.proto.records import RolloutRecord, Semantics

    rng = np.random.default_rng(0)
    t, k, n = a.tokens, a.k, a.ranks * a.per_rank

    def record(i: int) -> RolloutRecord:
        return RolloutRecord(
            rollout_id=f"r{i}",
            request_id=f"q{i}",
            prompt_ids=np.arange(200, dtype=np.int32),
            completion_ids=rng.integers(0, 150_000, t).astype(np.int32),
            sampled_logprobs=-rng.random(t).astype(np.float32),
            sampled_ranks=np.ones(t, np.int32),
            topk_ids=rng.integers(0, 150_000, (t, k)).astype(np.int32),
            topk_logprobs=-np.sort(rng.random((t, k)).astype(np.float32), axis=1),
            finish_reason="length",
            semantics=Semantics(temperature=1.0, logprobs_k=k, engine="bench"),
            job_id=f"j{i // a.group}",
            group_size=a.group,
            sample_index=i % a.group,
            run_id="bench",
        )

    raw = [wire.encode_record(record(i)) for i in range(n)]
    parts: dict[str, list[float]] = {"decode_ms": [], "split_ms": [], "pickle_ms": [], "unpickle_one_ms": []}
    pickled = 0
    load_start = common.load_1m()
    for _ in range(a.reps):
        t0 = time.perf_counter()
        recs = [wire.decode_record(b) for b in raw]
        t1 = time.perf_counter()
        shares = split_groups(recs, a.ranks)
        t2 = time.perf_counter()
        blobs = [pickle.dumps(("ok", s), protocol=pickle.HIGHEST_PROTOCOL) for s in shares]
        t3 = time.perf_counter()
        pickle.loads(blobs[0])
        t4 = time.perf_counter()
        pickled = sum(map(len, blobs))
        for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[key].append(dt * 1e3)
    out = {
        "ranks": a.ranks,
        "records": n,
        "bytes_per_record": len(raw[0]),
        "batch_mb": sum(map(len, raw)) / 1e6,
        "pickled_mb": pickled / 1e6,
        **{key: common.spread(v) for key, v in parts.items()},
        "load_1m": [load_start, common.load_1m()],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
