"""RankedPublisher: one Publisher for every rank of a data-parallel trainer (issue 21), rank 0 the only one
that talks to Redis and the replicas.

Every rank calls `start(model)` and `publish(model)` at the same points of its loop; `version` is then the
same on every rank (rank 0's, broadcast through the control-plane collective: `client.ranks.Collective`,
e.g. `trainer_adapter.distributed.TorchCollective`). What the ranks do depends on the model:

- **a plain model** (one process, or DDP: every rank holds all the weights): rank 0's publisher (stream,
  directory or nccl) publishes it as it always did; the other ranks only join the broadcast of
  the outcome. A resumed run's weights, loaded on rank 0, are broadcast to the others
  (`torch.distributed.broadcast`, tensor by tensor).
- **a sharded model** (FSDP2 `fully_shard`, DTensors): no rank holds it. Every rank joins a gather
  parameter by parameter (`sharded.write_gathered`); rank 0 writes each full tensor into the version's
  file and drops it — the extra memory on any rank is one parameter — then publishes that file
  (`publish_written`: pushed chunk by chunk, or loaded by the replicas from the shared root). A resumed
  run's version is read back one tensor at a time on rank 0 and scattered (`sharded.load_sharded`).
- **the NCCL transport** ("nccl", GPUs): every rank has an `NcclPublisher`; rank 0 is vLLM's
  sender, the others join the trainer-side gathers of vLLM's `ModuleSource` (`full_tensor()` per
  parameter, as the sender broadcasts each): plain and sharded models alike, nothing written.

Failures never leave a rank waiting: rank 0's outcome (a value, or the error) is broadcast after every
step that only rank 0 does, and the other ranks raise the same `WeightSyncError` (or a RuntimeError
naming rank 0's error). Knows nothing of the loss or of how records reach the ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from .checkpoint import checkpoint_dir
from .lora import LoraUnsupported, is_lora
from .sharded import is_sharded, load_sharded, read_written, version_file, write_gathered
from .versions import WeightSyncError, checked, next_version

log = logging.getLogger(__name__)

T = TypeVar("T")


def _outcome(fn: Callable[[], T]) -> tuple[tuple, BaseException | None]:
    """(what the other ranks are told, the error itself): exceptions stay on rank 0, since one whose
    __init__ takes other arguments than its args (WeightSyncError) does not unpickle."""
    try:
        return ("ok", fn()), None
    except WeightSyncError as e:
        return ("weights", e.version, e.failed, e.results), e
    except Exception as e:
        return ("error", f"{type(e).__name__}: {e}"), e


def _raise(error: BaseException):
    raise error


def broadcast_state(model: torch.nn.Module) -> None:
    """Every tensor of rank 0's `model` copied into the other ranks' (a replicated model, DDP): after a
    resumed run's version was loaded on rank 0 only. A collective of the default group."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)


class RankedPublisher:
    """The Publisher of one trainer rank: `inner` (rank 0's publisher, None elsewhere) and `collective`.

    coll = TorchCollective()
    q = RolloutQueue(url, ns, run="new", ...) if coll.rank == 0 else None   # or RankedQueue(...).queue
    pub = make_publisher("stream", q, collective=coll, root="./ckpt")
    pub.start(model)            # every rank
    for step in ...:
        ...                     # the optimiser step, on every rank
        pub.publish(model)      # every rank: a collective; pub.version is then equal everywhere
    pub.close()
    """

    def __init__(self, inner: Any | None, collective: Any, transport: str) -> None:
        rank = collective.rank
        if transport == "nccl" and inner is None:
            raise ValueError(f"rank {rank}: the nccl transport needs an NcclPublisher on every rank")
        if transport != "nccl" and (rank == 0) != (inner is not None):
            raise ValueError(
                f"rank {rank}: rank 0 publishes through the queue's replicas and the other ranks through "
                f"none; got {'no' if inner is None else 'a'} publisher on rank {rank} (pass the queue on "
                "rank 0 only)"
            )
        self.inner, self.collective, self.transport = inner, collective, transport
        self._version: int | None = inner.version if rank == 0 else None

    @property
    def rank(self) -> int:
        return self.collective.rank

    @property
    def version(self) -> int:
        """The last version published: rank 0's (the queue's run), as broadcast by the last start() or
        publish(); before start() only rank 0 knows it."""
        if self.rank == 0:
            return self.inner.version
        if self._version is None:
            raise RuntimeError(f"rank {self.rank}: the version is known on rank 0 only until start()")
        return self._version

    @property
    def held(self) -> tuple[str, int] | None:
        """Rank 0's StreamPublisher.held (the run and version the model holds, for a publisher reopened
        in the same process); None on the other ranks and for the other transports."""
        return getattr(self.inner, "held", None) if self.rank == 0 else None

    def _on_rank0(self, fn: Callable[[], T], what: str) -> T:
        """fn() on rank 0, its result (or its error) on every rank."""
        told, error = _outcome(fn) if self.rank == 0 else (None, None)
        out = self.collective.broadcast(told)
        if error is not None:
            raise error
        if out[0] == "ok":
            return out[1]
        if out[0] == "weights":
            raise WeightSyncError(out[1], out[2], out[3])
        raise RuntimeError(f"rank 0 failed to {what}: {out[1]}")

    # ---- start ---------------------------------------------------------------------------------------

    def start(self, model: torch.nn.Module) -> int:
        """Every rank: trainer and live replicas on the run's current version (as the inner publisher's
        start()); returns it on every rank. A resumed run's weights end up in every rank's model."""
        if is_sharded(model) and is_lora(model):
            raise LoraUnsupported(
                "a LoRA model sharded with FSDP2 is not published: its adapter is a few MB, so wrap it "
                "with DDP (sharding='ddp'), whose rank 0 publishes the adapter"
            )
        if self.transport == "nccl":
            # rank 0 forms the NCCL group with the replicas; the others only set up their gathers
            self.inner._own(model)
            version = self._on_rank0(lambda: (self.inner.connect(), self.inner.version)[1], "form the group")
            if self.rank != 0:
                self.inner.connect()
        elif is_sharded(model):
            version = self._start_sharded(model)
        else:
            resumed = self._on_rank0(lambda: self.inner.version > 0, "read the run")
            version = self._on_rank0(lambda: self.inner.start(model), "start the run's weights")
            if resumed and self.collective.world_size > 1:
                broadcast_state(model)  # rank 0 loaded the run's version; DDP ranks must hold it too
        self._version = version
        return version

    def _start_sharded(self, model: torch.nn.Module) -> int:
        plan = self._on_rank0(self._resume_plan, "plan the start")
        action, version, directory = plan
        if action == "load":
            load_sharded(model, directory, self.collective)
            self._on_rank0(lambda: self._resumed(version, directory), "bring the replicas to the version")
            return version
        if action == "held":  # the model holds the version; the follower needs its file
            path = self.inner.written_path(version) if self.rank == 0 else None
            written = write_gathered(model, path, version)
            self._on_rank0(lambda: self._resumed_written(written), "bring the replicas to the version")
            return version
        # a new run's version 0, or resume_from_base's v + 1: recorded even with no live replica yet
        self._publish_sharded(model, version, starting=True)
        return version

    def _resume_plan(self) -> tuple[str, int, str | None]:
        """Rank 0: what start() does with a sharded model: ("publish0", 0, None) for a new run, ("load",
        v, directory) to resume from a copy of v, ("held", v, None) when the model holds v, ("publish",
        v + 1, None) for resume_from_base; refusals as the inner publisher's start()."""
        inner = self.inner
        run = inner.queue.run if self.transport == "stream" else inner.fleet.run
        if run.version == 0:
            return ("publish0", 0, None)
        if self.transport == "directory":
            own = checkpoint_dir(inner.root, run.version)
            return ("load", run.version, str(own if own.exists() or not run.checkpoint else run.checkpoint))
        own = checkpoint_dir(inner.save_root, run.version) if inner.save_root else None
        if own is not None and version_file(own).exists():
            return ("load", run.version, str(own))
        if inner.held == (run.run_id, run.version):
            return ("held", run.version, None)
        if inner.resume_from_base:
            log.warning(
                "resuming run %s at version %d with no local copy under save_root=%s: resume_from_base=True, "
                "so the model is published as a new version %d",
                run.run_id, run.version, inner.save_root, run.version + 1,
            )  # fmt: skip
            return ("publish", run.version + 1, None)
        raise RuntimeError(
            f"run {run.run_id} is at policy version {run.version} but this trainer has no copy of it "
            f"({'no ' + str(own) if own is not None else 'save_root=None'}): point save_root at the "
            "directory the run saved into, start a new run (run='new'), or pass resume_from_base=True "
            f"to publish this model as a new version {run.version + 1}"
        )

    def _resumed(self, version: int, directory: str) -> None:
        """Rank 0, after every rank loaded `version`: the replicas not serving it get it."""
        if self.transport == "stream":
            self._resumed_written(read_written(version_file(directory), version))
        else:
            inner = self.inner
            checked(version, inner.fleet.sync_replicas(timeout=inner.timeout), inner.require_all)

    def _resumed_written(self, written) -> None:
        self.inner.remember_written(written)
        self.inner.catch_up()

    # ---- publish -------------------------------------------------------------------------------------

    def publish(
        self, model: Mapping[str, torch.Tensor] | torch.nn.Module, version: int | None = None
    ) -> dict[str, str]:
        """Every rank: publish `model` as `version` (default: the last + 1); {replica_id: result} on every
        rank. A collective; raises on every rank when rank 0's publish failed."""
        if self.transport == "nccl":
            return self._publish_nccl(model, version)
        if not is_sharded(model):
            results = self._on_rank0(lambda: self.inner.publish(model, version), "publish")
            self._version = self._on_rank0(lambda: self.inner.version, "read the version")
            return results
        target = self._on_rank0(lambda: next_version(self.inner.version, version), "publish")
        return self._publish_sharded(model, target)

    def _publish_sharded(self, model, version: int, starting: bool = False) -> dict[str, str]:
        written, error = None, None
        if self.rank == 0:
            try:
                written = write_gathered(model, self.inner.written_path(version), version)
            except Exception as e:  # its file (after every gather had run): told to every rank below
                error = e
        else:
            write_gathered(model, None, version)

        def send() -> dict[str, str]:
            if error is not None:
                raise error
            if starting and version == 0 and self.transport == "directory":
                self.inner.fleet.adopt_replicas(written.fingerprint)
            try:
                return self.inner.publish_written(written)
            except WeightSyncError as e:
                if starting and not e.results:  # no live replica yet: not an error for a run's start
                    return {}
                raise

        results = self._on_rank0(send, f"publish version {version}")
        self._version = version
        return results

    def _publish_nccl(self, model, version: int | None) -> dict[str, str]:
        self.inner._own(model)
        target = self._on_rank0(lambda: next_version(self.inner.version, version), "publish")
        bad = [b for b in self.collective.all_gather(self.inner.nonfinite()) if b is not None]
        if bad:  # on every rank: no rank enters the broadcast
            raise ValueError(f"parameter {bad[0]!r} has non-finite values; version {target} not sent")
        # every rank runs send_weights (rank 0 the NCCL broadcast, all of them the gathers); rank 0's
        # results or error are then everyone's
        try:
            mine, error = self.inner.send(target), None
        except Exception as e:
            mine, error = None, e
        results = self._on_rank0(
            lambda: _raise(error) if error is not None else mine, f"send version {target}"
        )
        if error is not None:
            raise error
        self._version = target
        return results

    def close(self) -> None:
        """Rank 0: the inner publisher's close() (its follower thread, its spool)."""
        if self.inner is not None:
            self.inner.close()

    def __enter__(self) -> RankedPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
