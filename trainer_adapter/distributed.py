"""The trainer ranks, as the learner's maths and the SDK see them (issue 21: a data-parallel learner).

Two small views of one `torch.distributed` process group:

- `World` (`torch_world`): what a loss needs across ranks — how many there are and a global sum of a
  detached tensor — so that `policy_loss(..., world=...)` and `distill_loss(..., world=...)` normalise
  over the global batch (docs/math.md "Across ranks");
- `TorchCollective`: the control plane between ranks (records, versions, flags: Python objects), the
  `Collective` protocol of `maskroll.client.ranks` met structurally — this package never imports the SDK,
  and the SDK never imports torch. Objects always travel through a gloo group, even when the default
  group is NCCL: pickled objects through NCCL would go through a GPU tensor and a device sync each.

`single_process()` is both views for one rank, without torch.distributed: a one-process trainer runs
the same code path. Knows nothing of queues, models or optimisers.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

Tensor = torch.Tensor


class World(Protocol):
    """What a loss needs from the ranks: how many, and a global sum."""

    world_size: int

    def sum(self, x: Tensor) -> Tensor:  # all_reduce SUM of a detached copy of x; returns the copy
        ...


def _require_initialised(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs torch.distributed initialised (init_process_group, or torchrun / accelerate "
            "launch); for one process without it use single_process()"
        )


class _TorchWorld:
    """World over a torch.distributed group (the default one when `group` is None)."""

    def __init__(self, group: Any = None) -> None:
        _require_initialised("torch_world")
        self.group = group
        self.world_size = dist.get_world_size(group)

    def sum(self, x: Tensor) -> Tensor:
        # A copy, detached: the denominators are constants of the loss, and all_reduce works in place.
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def __repr__(self) -> str:
        return f"torch_world(world_size={self.world_size})"


def torch_world(group: Any = None) -> World:
    """The World of torch.distributed's default group, or of `group`. Its `sum` is a collective: every
    rank of the group must call the loss with the same options (the same number of sums, in order)."""
    return _TorchWorld(group)


# Gloo groups created for object traffic, by the group they shadow (None: the default group). new_group
# is itself a collective of the default group, so it is created once per process and group, and every
# rank must construct its first TorchCollective for a group at the same point of its program.
_GLOO_GROUPS: dict[Any, Any] = {}


def _gloo_group(group: Any) -> Any:
    if dist.get_backend(group) == dist.Backend.GLOO:
        return group
    key = group
    if key not in _GLOO_GROUPS:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        _GLOO_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _GLOO_GROUPS[key]


class TorchCollective:
    """`maskroll.client.ranks.Collective` over torch.distributed: objects (pickled) between the ranks of
    `group` (default: the default group), through a gloo group. Ranks are ranks within that group."""

    def __init__(self, group: Any = None) -> None:
        _require_initialised("TorchCollective")
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._group = _gloo_group(group)
        # torch's object collectives take the *global* rank of src; ours are ranks within the group.
        self._global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))

    def _check_src(self, src: int) -> None:
        if not 0 <= src < self.world_size:
            raise ValueError(f"src={src}; expected a rank in [0, {self.world_size})")

    def broadcast(self, obj: object, src: int = 0) -> object:
        """Every rank gets src's obj (the others' obj is ignored)."""
        self._check_src(src)
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=self._global(src), group=self._group)
        return box[0]

    def scatter(self, objs: list | None, src: int = 0) -> object:
        """Rank i gets objs[i]; objs is read on src only. A wrong objs on src raises on every rank (the
        error travels in the scatter) rather than leaving the others waiting."""
        self._check_src(src)
        boxes = None
        if self.rank == src:
            if objs is None or len(objs) != self.world_size:
                got = "None" if objs is None else f"{len(objs)} objects"
                error = f"scatter from rank {src}: got {got}; expected one per rank ({self.world_size})"
                boxes = [(error, None)] * self.world_size
            else:
                boxes = [(None, o) for o in objs]
        out: list = [None]
        dist.scatter_object_list(out, boxes, src=self._global(src), group=self._group)
        error, obj = out[0]
        if error is not None:
            raise ValueError(error)
        return obj

    def all_gather(self, obj: object) -> list:
        """[obj of rank 0, obj of rank 1, …] on every rank."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def __repr__(self) -> str:
        return f"TorchCollective(rank={self.rank}, world_size={self.world_size})"


class SingleProcess:
    """One rank, no torch.distributed: a `Collective` and a `World` whose operations are identities."""

    rank = 0
    world_size = 1

    def broadcast(self, obj: object, src: int = 0) -> object:
        if src != 0:
            raise ValueError(f"src={src}; a single process has rank 0 only")
        return obj

    def scatter(self, objs: list | None, src: int = 0) -> object:
        if src != 0:
            raise ValueError(f"src={src}; a single process has rank 0 only")
        if objs is None or len(objs) != 1:
            got = "None" if objs is None else f"{len(objs)} objects"
            raise ValueError(f"scatter: got {got}; expected one (a single process)")
        return objs[0]

    def all_gather(self, obj: object) -> list:
        return [obj]

    def barrier(self) -> None:
        return None

    def sum(self, x: Tensor) -> Tensor:
        return x.detach().clone()

    def __repr__(self) -> str:
        return "single_process()"


def single_process() -> SingleProcess:
    """The one-rank collective and world (rank 0, world_size 1), without torch.distributed."""
    return SingleProcess()
