"""One-command GPU check of the NCCL weight transport: a ~1 GB model broadcast from a trainer rank to a
vLLM replica through vLLM's weight-transfer engine, rendezvous over maskroll's UpdateWeights RPC.

Needs two CUDA devices (NCCL refuses two ranks on one GPU): the trainer on device 0, one
`maskroll serve --engine vllm` replica on device 1 (started with
`--vllm-arg weight_transfer_config={"backend":"<--backend>"}`), a private Redis for the registry. It forms
the group (`NcclPublisher.connect`), publishes `--reps` versions of the model, checks the replica
serves each version and that its greedy-ish output changed, and prints seconds and GB/s per version
(the model's bytes over the seconds: for sparse_nccl what a full broadcast would have had to reach).

`--backend sparse_nccl` (weight_sync/nccl_sparse.py): version 1 scales every weight (the first version
of a group is sent full, every element), even versions scale one element in 97 and odd ones after 1 put
those back: the replica's output at each odd version must then be the one it gave at version 1, which
holds only if every patch landed exactly where it was meant to (a missed or misplaced element would
leave the weights apart from version 1's). Each version prints how many elements it sent.

    python bench/nccl_check.py                 # ~1 GB model (hidden 2048, 14 layers, bf16), 3 versions
    python bench/nccl_check.py --layers 4 --reps 1
    python bench/nccl_check.py --backend sparse_nccl --layers 2 --hidden 1024 --reps 3

Exit 0 with the figures, 2 when the machine lacks two CUDA devices or vLLM.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import common

STRIDE = 97  # sparse_nccl: the elements of each parameter that even versions move (about 1 %)


def change(model, version: int, backend: str, saved: dict) -> None:
    """The optimiser step's stand-in before `version` is published (see the module docstring)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.view(-1)
            if backend == "nccl" or version == 1:
                param.mul_(1.01)
            elif version % 2 == 0:
                saved[name] = flat[::STRIDE].clone()
                flat[::STRIDE] *= 1.5
            else:
                flat[::STRIDE] = saved[name]


def publish_versions(pub, model, address: str, size: int, reps: int, backend: str) -> None:
    """Versions 1 .. reps: each published, checked served, timed; the outputs compared (module docstring)."""
    import torch

    from maskroll.client import SamplingOptions, SyncRolloutClient

    opts = SamplingOptions(max_tokens=8, seed=1, temperature=0.05)

    def output() -> list[int]:
        with SyncRolloutClient(address) as c:
            return c.generate_record([1, 2, 3], opts).completion_ids.tolist()

    before, rates, saved, outputs = output(), [], {}, {}
    for v in range(1, reps + 1):
        change(model, v, backend, saved)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = pub.publish(model, v)
        seconds = time.perf_counter() - t0
        with SyncRolloutClient(address) as c:
            served = c.info().policy_version
        rates.append(size / seconds / 1e9)
        line = f"version {v}: {seconds:.3f} s, {rates[-1]:.2f} GB/s, replica at {served}"
        sent = "" if pub.sent_elements is None else f", sent {pub.sent_elements} elements"
        print(f"{line}{sent}, {results}", flush=True)
        assert served == v, f"replica serves {served}, expected {v}"
        if backend == "sparse_nccl":
            outputs[v] = output()
    after = output()
    print(f"output changed: {before != after}; median {sorted(rates)[len(rates) // 2]:.2f} GB/s")
    if backend == "sparse_nccl" and reps >= 3:
        patched = [outputs[v] != outputs[1] for v in range(2, reps + 1, 2)]
        restored = [outputs[v] == outputs[1] for v in range(3, reps + 1, 2)]
        print(f"patched output differs from version 1's: {all(patched)} ({patched})")
        print(f"restored output equals version 1's: {all(restored)} ({restored})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--hidden", type=int, default=2048)
    common.add_reps(p, 3, help="policy versions published (median GB/s)")
    p.add_argument("--port", type=int, default=29617, help="the NCCL rendezvous port on this host")
    p.add_argument("--backend", choices=("nccl", "sparse_nccl"), default="nccl", help="vLLM's backend")
    a = p.parse_args(argv)
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None or torch.cuda.device_count() < 2:
        print(f"nccl_check: needs vLLM and 2 CUDA devices (found {torch.cuda.device_count()}); not run")
        return 2
    from transformers import AutoModelForCausalLM

    from maskroll.client import RolloutQueue
    from maskroll.local.replica import LocalReplica, ReplicaStartError
    from maskroll.weight_sync.nccl import NcclPublisher

    with tempfile.TemporaryDirectory(prefix="maskroll-nccl-") as d:
        model_dir = common.model_dir(None, Path(d), hidden=a.hidden, heads=a.hidden // 128, layers=a.layers)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:0")
        size = sum(t.numel() * t.element_size() for t in model.parameters())
        print(f"model: {size / 1e9:.2f} GB bf16 ({a.layers} layers, hidden {a.hidden})", flush=True)
        with common.open_store() as srv:
            serve = ["--model", model_dir, "--engine", "vllm", "--port", "0", "--namespace", "nccl", "--pull"]
            serve += ["--replica-id", "gpu-1", "--dtype", "bfloat16"]
            serve += ["--vllm-arg", f'weight_transfer_config={{"backend":"{a.backend}"}}']
            replica = LocalReplica(
                serve,
                env={"CUDA_VISIBLE_DEVICES": "1", "MASKROLL_REDIS_URL": srv.url},
                log=Path(d) / "replica.log",
                ready_timeout=900,
            )
            try:
                try:
                    replica.start().wait_ready()
                except ReplicaStartError as e:
                    print(e)
                    return 1
                with RolloutQueue(srv.url, "nccl", run="new", batch_size=1) as q:
                    address = common.wait_registered(q, 1)[0].address
                    pub = NcclPublisher(
                        q, model, master_address="127.0.0.1", master_port=a.port, backend=a.backend
                    )
                    t0 = time.perf_counter()
                    print(f"group: {pub.connect()} in {time.perf_counter() - t0:.1f} s", flush=True)
                    publish_versions(pub, model, address, size, a.reps, a.backend)
            finally:
                replica.stop(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
