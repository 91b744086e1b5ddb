"""One trainer rank of tests/weight_sync/test_sharded_publish.py, run under torchrun (gloo, CPU):

    python -m torch.distributed.run --nproc-per-node 2 sharded_ranks.py --model DIR --redis URL \
        --namespace NS --mode fsdp|ddp|plain --out DIR

Loads the tiny Llama, shards it (FSDP2 `fully_shard` per decoder layer and the root) or wraps it in DDP,
starts a run (rank 0 holds the queue), takes one real optimiser step on a fixed batch, writes the full
state dict as torch itself gathers it (`get_model_state_dict(full_state_dict=True)`: the reference,
independent of maskroll's gather) to `<out>/reference.safetensors`, publishes through
`make_publisher("stream", ..., collective=TorchCollective())` and writes `<out>/rank<r>.json`: the
versions, the replicas' results and the memory figures of the publish (RSS sampled every millisecond).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The highest RSS seen while the block runs, sampled every millisecond on a thread."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--redis", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--mode", choices=("fsdp", "ddp", "plain"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", default=None, help="the publisher's save_root (the trainer's resume copy)")
    ap.add_argument("--resume", action="store_true", help="resume the namespace's run instead of a new one")
    ap.add_argument("--transport", choices=("stream", "directory", "nccl"), default="stream")
    ap.add_argument("--master-port", type=int, default=29618, help="the NCCL group's rendezvous (nccl)")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from maskroll.client import RolloutQueue
    from maskroll.trainer_adapter.distributed import TorchCollective
    from maskroll.weight_sync import make_publisher

    torch.set_num_threads(1)
    cuda = args.transport == "nccl"  # NCCL: the model on this rank's GPU, the default group NCCL
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    coll = TorchCollective()
    rank = coll.rank
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(
        "cuda" if cuda else "cpu"
    )
    full_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    trained = model
    if args.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model)
    shard_bytes = sum(
        (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
        for t in model.state_dict().values()
    )

    run = "resume" if args.resume else "new"
    q = RolloutQueue(args.redis, args.namespace, run=run, batch_size=2) if rank == 0 else None
    if cuda:
        pub = make_publisher(
            "nccl",
            q,
            collective=coll,
            model=model,
            master_address="127.0.0.1",
            master_port=args.master_port,
        )
    elif args.transport == "directory":
        pub = make_publisher("directory", q, collective=coll, root=args.root, timeout=60)
    else:
        pub = make_publisher("stream", q, collective=coll, root=args.root, follow_s=None, timeout=60)
    v0 = pub.start(model)
    resumed_exact = None
    if args.resume:  # start() loaded the run's version into every rank's model: is it the published one?
        from safetensors.torch import load_file

        # every rank checks what it holds (its shards gathered; DDP: rank 0's copy, broadcast to it)
        held = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()
        }
        published = load_file(str(Path(args.out) / f"reference_v{v0}.safetensors"))
        resumed_exact = set(held) == set(published) and all(
            torch.equal(held[k].cpu(), published[k]) for k in held
        )
        del held, published

    # one real optimiser step, the same batch on every rank (the gradients are averaged across ranks)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 2]], device="cuda" if cuda else "cpu")
    trained(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    reference = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        ref = Path(args.out) / f"reference_v{v0 + 1}.safetensors"
        save_file({k: v.contiguous() for k, v in reference.items()}, str(ref))
    del reference
    dist.barrier()

    with PeakRSS() as mem:
        t0 = time.perf_counter()
        results = pub.publish(model)
        seconds = time.perf_counter() - t0
    report = {
        "rank": rank,
        "world_size": coll.world_size,
        "mode": args.mode,
        "start_version": v0,
        "resumed_exact": resumed_exact,
        "version": pub.version,
        "results": results,
        "publish_s": seconds,
        "rss_base": mem.base,
        "rss_peak_delta": mem.peak - mem.base,
        "model_bytes": full_bytes,
        "shard_bytes": shard_bytes,
        "largest_param_bytes": largest,
    }
    if q is not None and args.transport == "stream":  # the replicas' fingerprints against the trainer's
        from maskroll.weight_sync import replica_weights

        report["fingerprint"] = getattr(pub.inner, "fingerprint", "")
        report["replica_fingerprints"] = {r: w.fingerprint for r, w in replica_weights(q).items()}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    pub.close()
    if q is not None:
        q.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    from maskroll.recipes.launch import exit_rank

    main()
    exit_rank(0)  # launch.exit_rank says why: gloo's threads can abort the interpreter's shutdown
