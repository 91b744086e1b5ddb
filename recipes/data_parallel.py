"""The GRPO recipe's data-parallel plumbing: the ranks from torchrun's environment, the model wrapped
for them, and the record of which rollouts each published version trained on (exactly-once).

Ranks: with `WORLD_SIZE > 1` (torchrun, `torch.distributed.run`) the default process group is made from
the environment — NCCL when the ranks have GPUs, gloo on CPU — and the control plane is a
`TorchCollective` (always gloo); with one process, `single_process()`: the same code path, no
torch.distributed. The model is wrapped in DDP (every rank holds it whole) or sharded with FSDP2
(`fully_shard`: each rank holds 1/W); both average gradients over the ranks.

Exactly-once across a killed rank (recipes/grpo.py's step): records are acked only after every rank
finished the step, and rank 0 writes the global batch's rollout ids beside the checkpoints
(`weight_sync.write_trained`: `<weights_root>/trained/v<version>.json`, the checkpoint layout's ledger)
*before* publishing that version. A trainer killed between
publishing version v and acking its batch finds, on resume at v, the ids its pending records were
trained on, and acks them untrained (`RankedQueue.skip_trained`); killed before the publish recorded v,
it resumes at v − 1 and trains them again — the first training never reached a published version.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Sharding = Literal["ddp", "fsdp2"]


def init_ranks():
    """(collective, loss world, owned): the trainer ranks. Under torchrun (WORLD_SIZE > 1) the default
    process group is initialised from the environment unless it already is (owned: this call made it,
    so the caller destroys it); otherwise one process (`single_process()`, world None: the loss
    normalises over this rank's batch, which is then the whole one)."""
    from maskroll.trainer_adapter.distributed import TorchCollective, single_process, torch_world

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return single_process(), None, False
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        gpus = torch.cuda.is_available() and torch.cuda.device_count() > 0
        if gpus:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if gpus else "gloo", **_attempt_store())
    return TorchCollective(), torch_world(), owned


def _attempt_store() -> dict:
    """init_process_group's store under torchrun: the agent's store, its keys prefixed by the restart
    count. torchrun keeps one store across an elastic restart, and the process group's keys (each
    rank's gloo address) are the same in every attempt: the restarted ranks read the dead ranks'
    addresses and hang connecting to them (seen with torch 2.13, gloo, `--standalone`). Outside
    torchrun's agent: {} (init from the environment as usual)."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, use_libuv=True
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"maskroll/attempt{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def device() -> torch.device:
    """This rank's device: its GPU under NCCL (LOCAL_RANK), else the CPU."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wrap(model: torch.nn.Module, world_size: int, sharding: Sharding = "ddp") -> torch.nn.Module:
    """`model` as the ranks train it, or itself on one rank. Both average gradients over the ranks,
    which `policy_loss(..., world=)` is calibrated for. "ddp": a DistributedDataParallel wrapper
    (every rank holds the whole model; call the wrapper for the training forward). "fsdp2":
    `fully_shard` on each decoder layer, then the model, in place (parameters become DTensors: a
    rank holds 1/W of each; the returned model is `model`): for models one GPU cannot train whole.
    Build the optimiser after this (FSDP2 replaces the parameters)."""
    if world_size <= 1:
        return model
    if sharding == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(
                f"sharding='fsdp2' shards decoder layers at model.model.layers: {type(model).__name__}"
            )
        for layer in layers:
            fully_shard(layer)
        return fully_shard(model)
    if sharding != "ddp":
        raise ValueError(f"sharding={sharding!r}; expected 'ddp' or 'fsdp2'")
    from torch.nn.parallel import DistributedDataParallel

    dev = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[dev] if dev.type == "cuda" else None)
