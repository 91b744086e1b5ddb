"""The nccl transport's trainer end: weight sync on GPUs through vLLM's own weight-transfer engine
(`vllm.distributed.weight_transfer`).

The trainer is rank 0 of one NCCL group; every replica's vLLM workers join it (replica i's workers at
rank_offset 1 + i * tensor_parallel_size). vLLM's trainer-side engine (`NCCLTrainerWeightTransferEngine`)
does the rendezvous and the packed broadcast; it drives the inference side through a
`VLLMWeightSyncClient`, which here is maskroll's control RPC: `UpdateWeights` with a
`CollectiveSource` (init: join the group; otherwise: receive the listed tensors), sent to every replica
in parallel (`broadcast.collective_update`). Each replica pauses, receives into its live
model (vLLM's layerwise reload: no second copy of the weights), relabels its version and resumes, as
for the other transports (the replica's end: server/weights/nccl.py).

Only the sending trainer rank checks values: NaN or inf anywhere refuses the version before a byte is
sent, since the bytes land in the replicas' models directly. The replica checks names and shapes
against its model before receiving. As the other publishers, `publish` records each version in the run
record (`RolloutQueue.record_version`, with `run_record.NCCL_CHECKPOINT`) and makes it the trainer's
policy version before any replica loads it, and takes the version rule and the per-replica results
from `versions.py`. The group's world size is fixed at `connect()`: a replica that starts later cannot
enter it; it finds that marker in the run record and starts on its own weights (server/weights/join.py)
until the trainer forms a new group with it (or publishes through a StreamPublisher or the directory).
Needs CUDA, NCCL and vLLM on the trainer; the replicas run the vLLM engine started with
`--vllm-arg weight_transfer_config='{"backend": "nccl"}'` (or the backend chosen below).

Two of vLLM's backends (`backend=`, checked at construction by `nccl_sparse.check_backend`): "nccl"
(the default) broadcasts every parameter whole, packed; "sparse_nccl" (nccl_sparse.py) only the elements
whose bits changed since the last version, in the replicas' dtype (`dtype=`), keeping one copy of the
last version on the model's device. The CollectiveSource names the backend, and each tensor's number of
elements sent (`TensorSpec.changed`), so that the replica receives what is broadcast.

A data-parallel trainer (issue 21) makes one NcclPublisher per rank (`rank`, through
`make_publisher(..., collective=...)`: `ranked.RankedPublisher`): rank 0 is vLLM's sender (the NCCL
group with the replicas, the RPCs, the run record); the other ranks hold no queue and are not in the
group, they only join the trainer-side gathers — vLLM's `ModuleSource` gathers an FSDP2 model one
parameter at a time (`full_tensor()`) while the sender broadcasts each, so no rank holds the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from maskroll.client import ReplicaInfo
from maskroll.proto.run_record import NCCL_CHECKPOINT
from maskroll.proto.tensor_push import SPARSE_NCCL, CollectiveSpec, TensorSpec

from . import delta, nccl_sparse
from .broadcast import collective_update
from .versions import WeightSyncError, checked, next_version


class GrpcWeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol over maskroll's UpdateWeights(collective) RPC, to every
    replica at once. `version` is the version the next update_weights labels its weights with;
    `backend` the vLLM backend the trainer sends with (the specs name it)."""

    def __init__(
        self,
        replicas: Sequence[ReplicaInfo],
        *,
        tensor_parallel_size: int = 1,
        group_name: str = "maskroll-weights",
        run_id: str = "",
        timeout: float = 600.0,
        token: str | None = None,
        tls: bool = False,
        root_certs: bytes | None = None,
        backend: str = "nccl",
    ) -> None:
        self.replicas, self.tp, self.group_name = list(replicas), tensor_parallel_size, group_name
        self.backend = backend
        self.run_id, self.timeout = run_id, timeout
        self._auth = {"token": token, "tls": tls, "root_certs": root_certs}
        self.version = 0
        self._init: dict | None = None
        self.results: dict[str, str] = {}

    @property
    def world_size(self) -> int:
        return 1 + self.tp * len(self.replicas)

    def _specs(self, init: bool, tensors: tuple[TensorSpec, ...] = ()) -> list[CollectiveSpec]:
        assert self._init is not None, "init_weight_transfer_engine() first"
        return [
            CollectiveSpec(
                group_name=self.group_name,
                master_address=str(self._init["master_address"]),
                master_port=int(self._init["master_port"]),
                rank_offset=1 + i * self.tp,  # vLLM's init_info says 1: the first replica's place
                world_size=int(self._init["world_size"]),
                init=init,
                tensors=tensors,
                packed=bool(self._init.get("packed", True)),
                backend=self.backend,
            )
            for i in range(len(self.replicas))
        ]

    def _call(self, version: int, specs: list[CollectiveSpec]) -> None:
        self.results = asyncio.run(
            collective_update(
                self.replicas, version, specs, run_id=self.run_id, timeout=self.timeout, **self._auth
            )
        )
        failed = {r: e for r, e in self.results.items() if e != "ok"}
        if failed:
            raise WeightSyncError(version, failed, self.results)

    # ---- VLLMWeightSyncClient -------------------------------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._init = dict(init_info)
        self._call(0, self._specs(init=True))

    def start_weight_update(self) -> None:
        """Nothing to do: each replica starts, receives and finishes within its one UpdateWeights."""

    def update_weights(self, update_info: dict) -> None:
        names = update_info["names"]
        # sparse_nccl's: the (index, value) pairs broadcast per tensor, which the replica must receive
        counts = update_info.get("num_updates_list") or [0] * len(names)
        tensors = tuple(
            TensorSpec(name=n, dtype=d, shape=tuple(s), nbytes=0, changed=int(k))
            for n, d, s, k in zip(
                names, update_info["dtype_names"], update_info["shapes"], counts, strict=True
            )
        )
        self._call(self.version, self._specs(init=False, tensors=tensors))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Nothing to do: the replicas finished (and relabelled) in update_weights."""


class NcclPublisher:
    """Publish versions of `model` (on CUDA) to every live replica of `queue` over NCCL.

    pub = NcclPublisher(q, model, master_address="10.0.0.5", master_port=29600)
    pub.start(model)         # the rendezvous (connect): every live replica joins the group
    for step in ...:
        ...                  # an optimiser step
        pub.publish(model)   # version + 1: recorded in the run, broadcast from rank 0

    `queue` is a `maskroll.client.RolloutQueue` (its run record, policy version, replica registry and
    the replicas' credentials). The model is the one given here: NCCL sends its parameters in place,
    so start() and publish() take only that one (the Publisher protocol's argument).

    backend: vLLM's weight-transfer backend, the replicas' `weight_transfer_config` ("nccl", or
        "sparse_nccl": the changed elements only, nccl_sparse.py). dtype: sparse_nccl's replicas' dtype
        (torch.bfloat16 or its name; None: the model's own), in which bits are compared and values sent.
        packed: vLLM's packed broadcast, "nccl" only (None: packed for "nccl"; sparse_nccl never is).
    """

    def __init__(
        self,
        queue,
        model: torch.nn.Module,
        *,
        master_address: str,
        master_port: int,
        tensor_parallel_size: int = 1,
        packed: bool | None = None,
        timeout: float = 600.0,
        rank: int = 0,
        backend: str = "nccl",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        if (rank == 0) == (queue is None):
            raise ValueError(f"rank {rank}: the queue is rank 0's, and only rank 0's (queue=None elsewhere)")
        from .lora import refuse_lora

        refuse_lora(model, "nccl")
        nccl_sparse.check_backend(backend, model, packed=packed, dtype=dtype)
        self.queue, self.model, self.rank, self.backend = queue, model, rank, backend
        self.master_address, self.master_port = master_address, master_port
        self.packed = backend != SPARSE_NCCL and packed is not False  # None: "nccl"'s default, packed
        self.tp, self.timeout = tensor_parallel_size, timeout
        self.client: GrpcWeightSyncClient | None = None
        self._engine = None
        dtype = delta.floating_dtype(dtype)
        # sparse_nccl: the last version sent, on rank 0, the only sender (the other ranks have no part in it)
        sparse = backend == SPARSE_NCCL and rank == 0
        self._base = nccl_sparse.SparseBase(dtype) if sparse else None

    @property
    def sent_elements(self) -> int | None:
        """sparse_nccl: the elements the last publish broadcast (every one for a full patch); else None."""
        return None if self._base is None else self._base.sent_elements

    @property
    def version(self) -> int:
        """The last version published: the queue's policy version (its run's, recorded in Redis)."""
        return self.queue.policy_version

    def start(self, model: torch.nn.Module | None = None) -> int:
        """Form the group with the live replicas (connect()); returns the run's current version. A
        replica that starts later is not in the group (see the module docstring)."""
        self._own(model)
        self.connect()
        return self.version

    def close(self) -> None:
        """Nothing to release: the NCCL group lives as long as the process."""

    def _own(self, model: object) -> None:
        if isinstance(model, int):
            raise TypeError(
                "publish(model, version): the version is the second argument (publish(version=v))"
            )
        if model is not None and model is not self.model:
            raise ValueError("NcclPublisher sends the model it was made with (NCCL reads it in place)")

    def connect(self) -> list[str]:
        """Form the group with the live replicas; returns their ids."""
        if self.rank != 0:  # not in the NCCL group
            if self.backend != SPARSE_NCCL:  # this rank only joins the gathers of send_weights()
                self._engine = self._dense_engine(None, world_size=1)
            return []  # sparse_nccl: vLLM's sparse engine is sender-only, nothing to join
        replicas = self.queue.replicas()
        if not replicas:
            raise WeightSyncError(0, {}, {})
        self.client = GrpcWeightSyncClient(
            replicas,
            tensor_parallel_size=self.tp,
            run_id=self.queue.run.run_id,
            timeout=self.timeout,
            backend=self.backend,
            **self.queue.replica_auth,
        )
        if self._base is None:
            self._engine = self._dense_engine(self.client, world_size=self.client.world_size)
        else:
            self._base.forget()  # a new group: what its replicas hold is unknown, the next version is full
            self._engine = nccl_sparse.trainer_engine(self.client, self.master_address, self.master_port)
        return [r.replica_id for r in replicas]

    def _dense_engine(self, client: GrpcWeightSyncClient | None, *, world_size: int):
        """vLLM's "nccl" trainer engine over the model's parameters (rank 0: the sender, with `client`)."""
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        info = NCCLTrainerInitInfo(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=world_size,
            packed=self.packed,
            rank=self.rank,  # rank 0 is the sender (vLLM's TrainerInitInfo asks for it explicitly)
        )
        return NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=client, source=ModuleSource(self.model)
        )

    def publish(self, model: torch.nn.Module | None = None, version: int | None = None) -> dict[str, str]:
        """Broadcast the model's parameters as `version` (default: the last + 1); {replica_id: "ok"}.
        `model`: the publisher's own (None means the same).
        Raises ValueError (nothing sent, nothing recorded) on a version that does not move the run
        forward or a non-finite value (for sparse_nccl, also once cast to the replicas' dtype);
        WeightSyncError if a replica of the group failed (the group is then unusable: connect() again;
        with sparse_nccl the next version is sent full either way)."""
        self._own(model)
        version = next_version(self.version, version)
        bad = self.nonfinite()
        if bad is not None:
            raise ValueError(f"parameter {bad!r} has non-finite values; version {version} not sent")
        return self.send(version)

    def nonfinite(self) -> str | None:
        """The first parameter with a NaN or inf in what this rank holds of it (its shard, for an FSDP2
        model: a data-parallel trainer combines every rank's answer), or None."""
        for name, p in self.model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                return name
        return None

    def send(self, version: int) -> dict[str, str]:
        """Rank 0: record `version` and broadcast the parameters to the group; the other ranks of a
        data-parallel trainer: join the gathers (a sharded model) and return {}. Checks are publish()'s;
        sparse_nccl's patches are built (and refused: ValueError) before the version is recorded."""
        if self.rank != 0 and self.backend == SPARSE_NCCL:
            return {}  # vLLM's sparse engine is sender-only
        if self._engine is None or (self.rank == 0 and self.client is None):
            raise RuntimeError("connect() (or start()) first")
        if self.rank != 0:
            self._engine.send_weights()
            return {}
        patches = None if self._base is None else self._base.patches(dict(self.model.named_parameters()))
        self.queue.record_version(version, NCCL_CHECKPOINT)
        self.client.version = version
        if patches is None:
            self._engine.send_weights()
        else:
            nccl_sparse.send(self._engine, patches)
        # Every replica of the group took part in the one broadcast: any failure already raised.
        results = checked(version, dict(self.client.results), require_all=True)
        if self._base is not None:
            self._base.sent()  # only now may the next version be a sparse patch on this one
        return results
