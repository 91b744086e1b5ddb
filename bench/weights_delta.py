"""Weight updates as sparse deltas (issue 36): bytes and seconds per update, delta against full, on real
training steps; the trainer's egress against the replica count; whether compressing the patch indices
pays. bench/weights.py times full pushes; this is its delta study (docs/benchmarks.md "Weight updates at
scale", projected in docs/scaling.md "Weight updates").

`--part grpo`: `maskroll demo --model smollm2 --replica-dtype bfloat16 --replicas 1 --steps 5` (real GRPO
steps of the recipe, Adam, float32 master weights, one torch replica holding bf16), once per learning rate
with `--weight-deltas auto` and once at 1e-5 with `off` (the full baseline). From each run's summary.json:
bytes sent per update and replica (`weight_bytes_per_update`, the mean over the 5 versions after 0), as a
share of the model in bf16 (`model_bytes`), seconds per update (`weight_seconds_per_update`: the push,
from its first byte to the replica serving it) and `replicas_match_trainer` (every replica's GetInfo
weights fingerprint is the trainer's digests fingerprint of the last version). A thread hard-links each
version the trainer saves (`--weights-dir`, float32, kept 2 deep by the recipe) before it is pruned, and
each pair of consecutive versions is encoded again here with `weight_sync.delta` (the trainer's code, same
inputs): bytes per version, the share of bf16 elements that changed, and the index study below.

Index study (in `--part grpo`): each sparse patch's int32 indices, increasing, as gaps (`np.diff`, the
first index kept) compressed with zstandard at levels 1 and 3, one frame per tensor as an encoder would
(`pip install zstandard` into the venv to run it: not a dependency of maskroll). Reported: compressed /
raw index bytes, the whole delta's bytes with its indices compressed against without, compress and
decompress MB/s of raw index bytes on one core (diff and cumsum included), the entropy bound of the
positions (Σ numel·H(k/numel) bits: no coding of uniformly scattered positions does better), and the link
speed below which compressing pays (bytes saved / seconds spent).

`--part egress`: N = 1, 2, 4 `maskroll serve --pull` torch replicas (`--dtype bfloat16`, one thread, a
private Redis, loopback) and this process as the trainer with `StreamPublisher(dtype=bfloat16)` on the
demo's tiny model and on SmolLM2-135M. Between versions one real optimiser step (Adam, the recipe's, lr
1e-5, next-token loss on 2 x 64 random tokens). Versions alternate full and delta (the publisher's
`deltas` switched per version, full-delta then delta-full: drifting load hits both alike) after one
untimed version of each. Egress = the tensor bytes the trainer streamed for the version to all replicas
(`last_sent_bytes`; gRPC framing and manifests not counted); seconds = the push until every replica
serves it (`update_seconds`), and the whole `publish` call (cast to bf16, digests, delta encoding, push).

    python bench/weights_delta.py --part grpo --out /tmp/wd          # 4 demo runs, ~15 min on 2 cores
    python bench/weights_delta.py --part egress --out /tmp/wd        # about 4 minutes
    python bench/weights_delta.py --part grpo --tables /tmp/wd/grpo-torch.json     # the tables again
    python bench/weights_delta.py --part grpo --lrs 1e-5 --no-full --steps 3 --out /tmp/wd-short
    python bench/weights_delta.py --part grpo --engine vllm --lrs 1e-5 --no-full   # a vLLM replica (*)

Each part writes `<out>/grpo-<engine>.json` or `<out>/egress.json` and prints its Markdown tables; the
1-minute load average at start and end is in both. Run it under `nice` on a shared machine: the bytes are
exact, the seconds are not. (*) On 2026-12-04 a vLLM replica of SmolLM2 refused every push (the tied
lm_head.weight, sent once, is stored in the served directory: docs/benchmarks.md says more).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import common

LRS = (1e-6, 1e-5, 1e-4)
ZSTD_LEVELS = (1, 3)


# ---- part grpo: the demo's real GRPO steps ----------------------------------------------------------


class VersionKeeper:
    """Hard-links every `<weights>/v<N>/model.safetensors` the trainer writes into `keep/v<N>.safetensors`
    (polled every 0.2 s), so the recipe's pruning (2 versions kept) loses none. A step takes tens of
    seconds, a version is pruned two publishes after it is written: the poll never misses one."""

    def __init__(self, weights: Path, keep: Path) -> None:
        self.weights, self.keep = weights, keep
        keep.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.poll()

    def poll(self) -> None:
        for f in self.weights.glob("v*/model.safetensors"):  # complete: written under a temporary name
            target = self.keep / f"{f.parent.name}.safetensors"
            if not target.exists():
                with contextlib.suppress(FileNotFoundError):  # pruned between glob and link
                    os.link(f, target)

    def __enter__(self) -> VersionKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def versions(self) -> list[int]:
        return sorted(int(p.stem[1:]) for p in self.keep.glob("v*.safetensors"))


def run_demo(out: Path, lr: float, deltas: str, steps: int, engine: str, timeout: float) -> dict:
    """One `maskroll demo` run (SmolLM2, 1 replica in bf16) with its versions kept; its summary.json."""
    weights = out / "weights"
    cmd = [sys.executable, "-m", "maskroll.app.cli", "demo", "--engine", engine, "--model", "smollm2"]
    cmd += ["--replica-dtype", "bfloat16", "--weight-deltas", deltas, "--steps", str(steps), "--lr", str(lr)]
    cmd += ["--replicas", "1", "--out", str(out), "--weights-dir", str(weights)]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(out / "demo.log", "w") as log, VersionKeeper(weights, out / "versions") as keeper:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"demo exited with {proc.returncode}: see {out / 'demo.log'}")
    summary = json.loads((out / "summary.json").read_text())
    summary["versions_kept"] = keeper.versions()
    summary["wall_s"] = time.monotonic() - t0
    return summary


def replica_state(path: Path, model_dir: Path):
    """A saved version (float32 master weights) as the trainer sends it: `delta.replica_copy` in bf16. The
    file holds a tied lm_head.weight beside the embedding (the model's state dict names both); the
    trainer's copy keeps the tensor once, so the tied name is dropped as the model's config says."""
    import torch
    from safetensors.torch import load_file

    from maskroll.weight_sync import delta

    state = load_file(str(path))
    if json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return delta.replica_copy(state, torch.bfloat16)


def encode_versions(keep: Path, versions: list[int], model_dir: Path) -> list[dict]:
    """Each consecutive pair of kept versions encoded as the trainer does; per version: bytes, the changed
    share of elements, tensors by encoding, and the index study of its sparse patches."""
    from maskroll.proto.tensor_push import SPARSE
    from maskroll.weight_sync import delta

    rows, base = [], None
    for v in versions:
        new = replica_state(keep / f"v{v}.safetensors", model_dir)
        if base is not None and v == base[0] + 1:
            d = delta.encode(base[1], new, delta.digests(new), version=v, base_version=base[0])
            specs = d.manifest.tensors
            numel = sum(t.numel() for t in new.values())
            full = sum(s.dense_bytes for s in specs)
            changed = sum(
                s.changed if s.encoding == SPARSE else _changed(base[1][s.name], new[s.name]) for s in specs
            )
            by = {e: sum(s.encoding == e for s in specs) for e in ("same", "sparse", "dense")}
            rows.append(
                {
                    "version": v,
                    "delta_bytes": d.manifest.total_bytes,
                    "full_bytes": full,
                    "changed_elements": changed,
                    "elements": numel,
                    "tensors": by,
                    "indices": index_study(specs, d.payloads),
                }
            )
        base = (v, new)
    return rows


def _changed(old, new) -> int:
    """bf16 elements whose bits differ (a dense or same tensor's count; a patch's is in its spec)."""
    import torch

    return int((old.reshape(-1).view(torch.int16) != new.reshape(-1).view(torch.int16)).sum())


def index_study(specs, payloads) -> dict:
    """zstandard on the gaps between each sparse patch's indices: sizes, time, the positions' entropy; the
    gaps as uint16 (no compression) and the values through zstd 1, for comparison."""
    import numpy as np
    import zstandard

    from maskroll.proto.tensor_push import SPARSE, index_bytes

    out = {
        "raw_index_bytes": 0,
        "entropy_bytes": 0.0,
        "values_bytes": 0,
        "gap16_bytes": 0,
        "values_zstd1_bytes": 0,
    }
    for level in ZSTD_LEVELS:
        out[f"zstd{level}"] = {"bytes": 0, "compress_s": 0.0, "decompress_s": 0.0}
    for s, data in zip(specs, payloads, strict=True):
        if s.encoding != SPARSE:
            continue
        width = index_bytes(s.numel)
        raw = bytes(data[: s.changed * width])
        out["raw_index_bytes"] += len(raw)
        out["values_bytes"] += s.nbytes - len(raw)
        p = s.changed / s.numel
        out["entropy_bytes"] += s.numel * _binary_entropy(p) / 8
        idx = np.frombuffer(raw, dtype=np.int32 if width == 4 else np.int64)
        gaps = np.diff(idx, prepend=idx.dtype.type(0))
        # gaps as uint16, 0xFFFF then the int32 gap for the rare larger one: a codec at memcpy speed
        out["gap16_bytes"] += 2 * len(gaps) + 4 * int((gaps >= 0xFFFF).sum())
        out["values_zstd1_bytes"] += len(
            zstandard.ZstdCompressor(level=1).compress(bytes(data[len(raw) : s.nbytes]))
        )
        for level in ZSTD_LEVELS:
            z, row = zstandard.ZstdCompressor(level=level), out[f"zstd{level}"]
            t0 = time.perf_counter()
            frame = z.compress(np.diff(idx, prepend=idx.dtype.type(0)).tobytes())
            t1 = time.perf_counter()
            back = np.cumsum(np.frombuffer(zstandard.ZstdDecompressor().decompress(frame), dtype=idx.dtype))
            t2 = time.perf_counter()
            assert np.array_equal(back, idx)
            row["bytes"] += len(frame)
            row["compress_s"] += t1 - t0
            row["decompress_s"] += t2 - t1
    return out


def _binary_entropy(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def part_grpo(a: argparse.Namespace) -> dict:
    from maskroll.app import smollm2

    model_dir = smollm2.cached("float32")
    runs = [(lr, "auto") for lr in a.lrs] + ([] if a.no_full else [(1e-5, "off")])
    result = {"engine": a.engine, "steps": a.steps, "load_1m": [common.load_1m()], "runs": []}
    for lr, deltas in runs:
        out = a.out / f"grpo-{a.engine}-{deltas}-{lr:g}"
        print(
            f"demo lr {lr:g} deltas {deltas} -> {out} (load {common.load_1m()})", file=sys.stderr, flush=True
        )
        summary = run_demo(out, lr, deltas, a.steps, a.engine, a.timeout_s)
        row = {
            "lr": lr,
            "deltas": deltas,
            "load_1m_end": common.load_1m(),
            **{
                k: summary.get(k)
                for k in ("model_bytes", "weight_bytes_per_update", "weight_seconds_per_update")
            },
            **{k: summary.get(k) for k in ("weight_updates", "replicas_match_trainer", "seconds", "wall_s")},
            "reward": [summary.get("reward_before"), summary.get("reward_after")],
        }
        if deltas == "auto":
            row["per_version"] = encode_versions(out / "versions", summary["versions_kept"], model_dir)
        result["runs"].append(row)
        for f in (out / "versions").glob("*.safetensors"):  # 0.5 GB each
            f.unlink()
        print(json.dumps(row), file=sys.stderr, flush=True)  # kept if a later run fails
        (a.out / f"grpo-{a.engine}.json").write_text(json.dumps(result, indent=1))
    result["load_1m"].append(common.load_1m())
    (a.out / f"grpo-{a.engine}.json").write_text(json.dumps(result, indent=1))
    return result


def index_summary(per: list[dict]) -> dict:
    """The index study summed over a run's versions. `pays_below_gbps`: the link speed (per replica) under
    which compressing, sending and decompressing in series beats sending the raw indices; a trainer
    that compresses once for N replicas on one link gains N times as much per byte compressed."""
    raw = sum(v["indices"]["raw_index_bytes"] for v in per)
    z = {
        lv: {
            k: sum(v["indices"][f"zstd{lv}"][k] for v in per) for k in ("bytes", "compress_s", "decompress_s")
        }
        for lv in ZSTD_LEVELS
    }
    delta = sum(v["delta_bytes"] for v in per)
    values = sum(v["indices"]["values_bytes"] for v in per)
    saved = raw - z[1]["bytes"]
    return {
        "raw_index_mb": raw / 1e6,
        "entropy": sum(v["indices"]["entropy_bytes"] for v in per) / raw,
        "gap16": sum(v["indices"]["gap16_bytes"] for v in per) / raw,
        **{f"zstd{lv}": z[lv]["bytes"] / raw for lv in ZSTD_LEVELS},
        "delta_zstd1": (delta - saved) / delta,
        "values_zstd1": sum(v["indices"]["values_zstd1_bytes"] for v in per) / values,
        "compress_mb_s": raw / 1e6 / z[1]["compress_s"],
        "decompress_mb_s": raw / 1e6 / z[1]["decompress_s"],
        "pays_below_gbps": 8 * saved / (z[1]["compress_s"] + z[1]["decompress_s"]) / 1e9,
    }


def grpo_tables(result: dict) -> str:
    lines = [
        f"engine {result['engine']}, {result['steps']} GRPO steps per run; load {result['load_1m']}",
        "",
        "| lr | deltas | MB per update and replica (mean) | of the bf16 model | per version, % "
        "| bf16 elements changed per version, % | seconds per update | replicas match trainer |",
        "|---|---|--:|--:|---|---|--:|---|",
    ]
    for r in result["runs"]:
        per = r.get("per_version", [])
        pct = ", ".join(f"{100 * v['delta_bytes'] / v['full_bytes']:.2f}" for v in per) or "–"
        chg = ", ".join(f"{100 * v['changed_elements'] / v['elements']:.2f}" for v in per) or "–"
        sent, full = r["weight_bytes_per_update"], r["model_bytes"]
        lines.append(
            f"| {r['lr']:g} | {r['deltas']} | {sent / 1e6:.2f} | {100 * sent / full:.2f} % | {pct} | {chg} "
            f"| {r['weight_seconds_per_update']:.2f} | {r['replicas_match_trainer']} |"
        )
    lines += [
        "",
        "Patch indices (sizes as a share of the raw int32 indices, summed over the run's versions):",
        "",
        "| lr | raw index MB | entropy bound | gaps as uint16 | gaps + zstd 1 | gaps + zstd 3 "
        "| delta, indices zstd 1 / raw | values zstd 1 | zstd 1 MB/s compress / decompress | pays below |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for r in result["runs"]:
        if not r.get("per_version"):
            continue
        i = index_summary(r["per_version"])
        lines.append(
            f"| {r['lr']:g} | {i['raw_index_mb']:.2f} | {i['entropy']:.3f} | {i['gap16']:.3f} "
            f"| {i['zstd1']:.3f} | {i['zstd3']:.3f} | {i['delta_zstd1']:.3f} | {i['values_zstd1']:.3f} "
            f"| {i['compress_mb_s']:.0f} / {i['decompress_mb_s']:.0f} | {i['pays_below_gbps']:.2f} Gb/s |"
        )
    return "\n".join(lines)


# ---- part egress: StreamPublisher with N replicas ----------------------------------------------------


def part_egress(a: argparse.Namespace) -> dict:
    import tempfile

    result = {"reps": a.reps, "load_1m": [common.load_1m()], "cpu": common.cpu_model(), "rows": []}
    with tempfile.TemporaryDirectory(prefix="maskroll-wdelta-") as d:
        tmp = Path(d)
        for name in a.models.split(","):
            if name == "tiny":
                model_dir = common.model_dir(None, tmp)
            elif name == "smollm2":
                from maskroll.app import smollm2

                model_dir = smollm2.cached("float32")
            else:
                raise SystemExit(f"unknown model {name!r}; expected tiny or smollm2")
            for n in a.replicas:
                row = egress(name, model_dir, n, a.reps, tmp / f"{name}-{n}")
                result["rows"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)  # kept if a later case fails
                (a.out / "egress.json").write_text(json.dumps(result, indent=1))
    result["load_1m"].append(common.load_1m())
    (a.out / "egress.json").write_text(json.dumps(result, indent=1))
    return result


def _adam_step(model, opt, seed: int) -> None:
    """One real optimiser step: next-token loss on 2 x 64 random tokens."""
    import torch

    tokens = torch.randint(model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(seed))
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def egress(name: str, model_dir: Path, n: int, reps: int, tmp: Path) -> dict:
    """`n` bf16 torch replicas brought through 2 + 2 x reps versions, full and delta alternating."""
    import torch
    from transformers import AutoModelForCausalLM

    from maskroll.client import RolloutQueue
    from maskroll.local.replica import stop_all
    from maskroll.weight_sync import StreamPublisher, replica_weights

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-5)  # the recipe's
    ns = f"wdelta-{name}-{n}"
    row: dict = {"model": name, "replicas": n, "versions": []}
    with common.open_store() as store:
        args = ["--engine", "torch", "--port", "0", "--threads", "1", "--namespace", ns, "--pull"]
        args += ["--dtype", "bfloat16", "--max-message-bytes", str(64 << 20), "--heartbeat-ttl-s", "30"]
        env = {"OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": store.url}
        procs = common.start_replicas(model_dir, n, tmp / "logs", *args, env=env)
        try:
            with RolloutQueue(store.url, ns, run="new", batch_size=1) as q:
                common.wait_registered(q, n)
                with StreamPublisher(q, dtype=torch.bfloat16, follow_s=None, timeout=600) as pub:
                    pub.start(model)
                    row["model_bytes"] = pub.last_update_bytes  # one replica's full version, in bf16
                    pairs = (("off", "auto"), ("auto", "off"))  # alternating: drifting load hits both alike
                    modes = ["off", "auto"] + [m for r in range(reps) for m in pairs[r % 2]]
                    for i, mode in enumerate(modes):
                        _adam_step(model, opt, seed=i)
                        pub.deltas = mode  # the publisher's choice, per version: full or delta on the last
                        t0 = time.perf_counter()
                        results = pub.publish(model)
                        wall = time.perf_counter() - t0
                        assert set(results.values()) == {"ok"}, results
                        served = replica_weights(q)
                        row["versions"].append(
                            {
                                "timed": i >= 2,
                                "mode": mode,
                                "pushed": sorted(set(pub.last_pushed.values())),
                                "egress_bytes": pub.last_sent_bytes,
                                "push_s": pub.update_seconds[-1],
                                "publish_s": wall,
                                # every replica serves this version's bytes, and was sent what `mode` says
                                "match": len(served) == n
                                and all(
                                    getattr(w, "fingerprint", None) == pub.fingerprint
                                    for w in served.values()
                                )
                                and set(pub.last_pushed.values()) == {"delta" if mode == "auto" else "full"},
                            }
                        )
                    row["replica_rss_mb"] = [common.rss_mb(p.pid) for p in procs]
        finally:
            stop_all(procs, timeout=60)
    for mode in ("off", "auto"):
        timed = [v for v in row["versions"] if v["timed"] and v["mode"] == mode]
        row[mode] = {k: common.spread(v[k] for v in timed) for k in ("egress_bytes", "push_s", "publish_s")}
        row[mode]["match"] = all(v["match"] for v in timed)
    return row


def egress_table(result: dict) -> str:
    lines = [
        f"{result['reps']} timed versions per mode after one untimed each; load {result['load_1m']}; "
        f"{result['cpu']}",
        "",
        "| model (bf16 MB) | N | egress per version: full | delta (median [min, max]) | delta / full "
        "| push s: full | delta | publish s: full | delta | replicas match |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in result["rows"]:
        f, d = r["off"], r["auto"]
        lines.append(
            f"| {r['model']} ({r['model_bytes'] / 1e6:.1f}) | {r['replicas']} "
            f"| {f['egress_bytes']['median'] / 1e6:.2f} MB "
            f"| {common.fmt_spread({k: v / 1e6 for k, v in d['egress_bytes'].items()}, 3)} MB "
            f"| {d['egress_bytes']['median'] / f['egress_bytes']['median']:.2%} "
            f"| {common.fmt_spread(f['push_s'], 2)} | {common.fmt_spread(d['push_s'], 2)} "
            f"| {common.fmt_spread(f['publish_s'], 2)} | {common.fmt_spread(d['publish_s'], 2)} "
            f"| {f['match'] and d['match']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("grpo", "egress"), required=True)
    p.add_argument(
        "--tables", type=Path, help="print the tables of an earlier run's <part>.json, run nothing"
    )
    p.add_argument("--out", type=Path, default=Path("/tmp/maskroll-wdelta"), help="runs and <part>.json")
    p.add_argument("--lrs", type=float, nargs="+", default=list(LRS), help="grpo: learning rates with deltas")
    p.add_argument("--no-full", action="store_true", help="grpo: skip the --weight-deltas off run")
    p.add_argument("--steps", type=int, default=5, help="grpo: GRPO steps per run")
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch", help="grpo: the replica's engine")
    p.add_argument("--timeout-s", type=float, default=1800, help="grpo: per demo run")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4], help="egress: replica counts")
    p.add_argument("--models", default="tiny,smollm2", help="egress: comma-separated: tiny, smollm2")
    common.add_reps(p, 3, help="egress: timed full and delta versions each, after one untimed of each")
    a = p.parse_args(argv)
    if a.tables is not None:
        saved = json.loads(a.tables.read_text())
        print(grpo_tables(saved) if a.part == "grpo" else egress_table(saved))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if a.part == "grpo":
        print(grpo_tables(part_grpo(a)))
    else:
        print(egress_table(part_egress(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
