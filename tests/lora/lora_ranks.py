"""One trainer rank of tests/lora/test_trainer_lora.py's data-parallel test, run under torchrun (gloo, CPU):

    python -m torch.distributed.run --nproc-per-node 2 lora_ranks.py --model DIR --redis URL \
        --namespace NS --mode ddp|fsdp --root DIR --out DIR

The recipe's LoRA model (rank 8) wrapped in DDP (or sharded with FSDP2, which the publisher refuses),
rank 0 holding the queue; `start`, one real optimiser step on a fixed batch (only the adapters train),
`publish`; writes `<out>/rank<r>.json` (versions, results, the adapter's checksum on this rank, or the
error) and, on rank 0, the adapter it published to `<out>/adapter_v1` (PEFT's layout).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--redis", "--namespace", "--root", "--out"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--mode", choices=("ddp", "fsdp"), required=True)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from maskroll.client import RolloutQueue
    from maskroll.recipes.config import LoraConfig
    from maskroll.recipes.grpo import lora_model
    from maskroll.trainer_adapter.distributed import TorchCollective
    from maskroll.weight_sync import lora, make_publisher

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    coll = TorchCollective()
    rank = coll.rank
    torch.manual_seed(0)  # the same A on every rank, as DDP requires
    model = lora_model(
        AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), LoraConfig(lora_rank=8)
    )
    if args.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        trained = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model)
    q = RolloutQueue(args.redis, args.namespace, run="new", batch_size=2) if rank == 0 else None
    pub = make_publisher("stream", q, collective=coll, root=args.root, follow_s=None, timeout=60)
    report: dict = {"rank": rank}
    try:
        report["start_version"] = pub.start(model)
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    if "error" not in report:
        # one real optimiser step; each rank its own batch, so only DDP's averaging makes them agree
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        ids = torch.tensor([[1, 5, 9, 13, 17, 21, 2]]) + rank
        trained(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        report["results"] = pub.publish(model)
        report["version"] = pub.version
        spec, tensors = lora.adapter_of(model)
        report["adapter_sum"] = float(sum(t.double().abs().sum() for t in tensors.values()))
        report["last_update_bytes"] = getattr(pub.inner, "last_update_bytes", None) if rank == 0 else None
        if rank == 0:
            lora.save_adapter(Path(args.out) / "adapter_v1", spec, tensors)
    pub.close()
    if q is not None:
        q.close()
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    from maskroll.recipes.launch import exit_rank

    main()
    exit_rank(0)  # launch.exit_rank says why: gloo's threads can abort the interpreter's shutdown
