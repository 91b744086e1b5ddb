"""The sparse_nccl backend of the NCCL transport (`NcclPublisher(backend="sparse_nccl")`, nccl.py): each
version broadcast as the elements whose bits changed since the last one, through vLLM's sender-only
`SparseNCCLTrainerWeightTransferEngine` (distributed/weight_transfer/sparse_nccl_engine.py). The replica's
workers write them into the live model in place through its own weight loader (vLLM's
`load_checkpoint_weight_patches`: a checkpoint-shaped tensor, NaN wherever no value was sent).

What the trainer keeps: the last version sent, in the replicas' dtype, on the model's device — one copy
(`SparseBase`, made by `delta.replica_copy`), overwritten tensor by tensor as each is compared
(`delta.changed_at`: bits, not values, as the stream transport's deltas, delta.py; a bf16 element moves
only when the master weight crosses half a bf16 ulp, so at RL learning rates most do not).

What is sent, per parameter: (name, int32 flat indices, their values, the full shape) — a patch — or
nothing when no element's bits changed. A patch lands on whatever the replica holds, so none is ever
sent on a base the replicas may not hold: the first version after connect() (a new group; what its
replicas hold is unknown) and the first after a failed publish (some may have applied part of it) send
every element ("full": indices 0 .. n-1, 4 + itemsize bytes per element, three times a dense bf16
broadcast, and one int32 arange of the largest tensor on the trainer while it is sent). A version in
which nothing changed still sends one element (the first tensor's first, its value as it was): vLLM's
engine skips an empty send entirely, so the replicas would never relabel, and its update info needs at
least one patch.

Refused by name before anything is sent (`check_backend`): `nccl_m2n` (not wired), an unknown backend,
sparse_nccl packed, on an FSDP2-sharded model (the sparse engine gathers nothing), on a parameter that is
not floating point (NaN is the replica's "untouched" mark) or past int32 indices. Knows nothing of gRPC,
the run record or the replicas (nccl.py's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from maskroll.proto.tensor_push import COLLECTIVE_BACKENDS, SPARSE_NCCL, index_bytes

from .delta import changed_at, distinct, replica_copy
from .sharded import is_sharded


class Patch(NamedTuple):
    """One parameter's part of a version: vLLM's `SparseWeightPatch` fields (`sparse_patch` converts)."""

    name: str
    indices: torch.Tensor  # int32 [k]: flat positions, increasing
    values: torch.Tensor  # [k], the replicas' dtype
    full_shape: tuple[int, ...]


def check_backend(backend: str, model: torch.nn.Module, *, packed: bool | None, dtype: object) -> None:
    """ValueError naming the combination when `backend` cannot publish `model` as asked."""
    if backend == "nccl_m2n":
        raise ValueError(
            "backend='nccl_m2n' is not wired: it needs an FSDP2 trainer and vLLM's m2n trainer engine on "
            "GPUs, and was not built without a GPU to run it; backend='nccl' publishes an FSDP2 model too "
            "(gathered one parameter at a time)"
        )
    if backend not in COLLECTIVE_BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {', '.join(map(repr, COLLECTIVE_BACKENDS))}")
    if backend != SPARSE_NCCL:
        if dtype is not None:
            raise ValueError(
                f"dtype={dtype!r} is backend='sparse_nccl''s: backend='nccl' sends the parameters in place, "
                "in the model's dtype (the replicas cast them)"
            )
        return
    if packed:
        raise ValueError(
            "backend='sparse_nccl' is never packed (vLLM's sparse engine broadcasts each patch as it is): "
            "leave packed out, or use backend='nccl' for packed broadcasts"
        )
    if is_sharded(model):
        raise ValueError(
            "backend='sparse_nccl' sends from one rank and gathers nothing, and this model is FSDP2-sharded "
            "(DTensor parameters): use backend='nccl', whose sender gathers each parameter"
        )
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise ValueError(
                f"parameter {name!r} is {p.dtype}: sparse_nccl sends floating-point values only (the "
                "replica marks untouched elements NaN); use backend='nccl'"
            )
        if index_bytes(p.numel()) != 4:
            raise ValueError(
                f"parameter {name!r} has {p.numel()} elements, past sparse_nccl's int32 indices; use "
                "backend='nccl'"
            )


class SparseBase:
    """The last version sent, as the replicas hold it (`dtype`; None: the model's own), and whether every
    replica of the group holds it (`known`; only then may a patch be sparse)."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self.tensors: dict[str, torch.Tensor] = {}
        self.known = False
        self.sent_elements = 0  # of the last patches: what a benchmark reports

    def forget(self) -> None:
        """What the replicas hold is unknown (a new group): the next version is sent full."""
        self.known = False

    def sent(self) -> None:
        """Every replica of the group applied the last patches: they hold `tensors`."""
        self.known = True

    @torch.no_grad()
    def patches(self, params: Mapping[str, torch.Tensor]) -> list[Patch]:
        """The patches that take the replicas to `params` (the model's parameters, cast to `dtype`), the
        base overwritten with them as it goes; ValueError naming a parameter that is not finite once cast
        (an overflow of the replicas' dtype) or that changed layout. From here until sent() the replicas
        may not hold the base: the next call is full unless sent() was called."""
        params = distinct(params)
        fresh = not self.tensors
        if fresh:
            self.tensors = replica_copy(params, self.dtype, device=None)
        elif list(params) != list(self.tensors):
            raise ValueError("the model's parameters are not the ones connect() sent: connect() again")
        full, self.known = not self.known, False
        out = self._full(params, fresh) if full else self._changed(params)
        self.sent_elements = sum(p.indices.numel() for p in out)
        return out

    def _full(self, params: Mapping[str, torch.Tensor], fresh: bool) -> list[Patch]:
        aranges: dict[torch.device, torch.Tensor] = {}  # one per device, sliced for every tensor
        longest = max(t.numel() for t in self.tensors.values())
        out = []
        for name, p in params.items():
            base = self.tensors[name]
            if not fresh:
                _same_layout(name, base, p)
                base.copy_(p)  # the cast rounds as Tensor.to does (nearest even)
            _finite(name, base)
            if base.device not in aranges:
                aranges[base.device] = torch.arange(longest, dtype=torch.int32, device=base.device)
            out.append(Patch(name, aranges[base.device][: base.numel()], base.view(-1), tuple(base.shape)))
        return out

    def _changed(self, params: Mapping[str, torch.Tensor]) -> list[Patch]:
        out = []
        for name, p in params.items():
            base = self.tensors[name]
            _same_layout(name, base, p)
            new = p.detach().to(base.dtype).reshape(-1)  # no copy when the model holds that dtype
            at = changed_at(base, new)  # int64 [k]
            if not at.numel():
                continue
            values = new[at]
            _finite(name, values)
            base.view(-1).index_copy_(0, at, values)
            out.append(Patch(name, at.to(torch.int32), values, tuple(base.shape)))
        if not out:  # see the module docstring: one element, rewritten as it was, so that a version lands
            name, base = next(iter(self.tensors.items()))
            one = torch.zeros(1, dtype=torch.int32, device=base.device)
            out.append(Patch(name, one, base.view(-1)[:1], tuple(base.shape)))
        return out


def _same_layout(name: str, base: torch.Tensor, p: torch.Tensor) -> None:
    if base.shape != p.shape or base.device != p.device:
        raise ValueError(
            f"parameter {name!r} is {list(p.shape)} on {p.device}, sent as {list(base.shape)} on "
            f"{base.device}: connect() again"
        )


def _finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"parameter {name!r} is not finite in {t.dtype} (it overflows the replicas' dtype)")


# ---- vLLM's sparse engine (imported on use: a CPU trainer never loads it) -----------------------------


def trainer_engine(client, master_address: str, master_port: int):
    """vLLM's sparse sender as NCCL rank 0 of `client`'s group (the rendezvous: every replica of
    `client` joins it through client.init_weight_transfer_engine, which vLLM calls)."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import (
        SparseNCCLTrainerInitInfo,
        SparseNCCLTrainerWeightTransferEngine,
    )

    info = SparseNCCLTrainerInitInfo(
        master_address=master_address, master_port=master_port, world_size=client.world_size, rank=0
    )
    return SparseNCCLTrainerWeightTransferEngine.trainer_init(info, client=client)


def send(engine, patches: list[Patch]) -> None:
    """Broadcast `patches` as one update (the client's update_weights, the replicas' relabel)."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch

    engine.send_weights([SparseWeightPatch(**p._asdict()) for p in patches])
