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
`--vllm-arg weight_transfer_config='{"backend": "nccl"}'`.

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
from maskroll.proto.tensor_push import CollectiveSpec, TensorSpec

from .broadcast import collective_update
from .versions import WeightSyncError, checked, next_version


class GrpcWeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol over maskroll's UpdateWeights(collective) RPC, to every
    replica at once. `version` is the version the next update_weights labels its weights with."""

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
    ) -> None:
        self.replicas, self.tp, self.group_name = list(replicas), tensor_parallel_size, group_name
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
        tensors = tuple(
            TensorSpec(name=n, dtype=d, shape=tuple(s), nbytes=0)
            for n, d, s in zip(
                update_info["names"], update_info["dtype_names"], update_info["shapes"], strict=True
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
    """

    def __init__(
        self,
        queue,
        model: torch.nn.Module,
        *,
        master_address: str,
        master_port: int,
        tensor_parallel_size: int = 1,
        packed: bool = True,
        timeout: float = 600.0,
        rank: int = 0,
    ) -> None:
        if (rank == 0) == (queue is None):
            raise ValueError(f"rank {rank}: the queue is rank 0's, and only rank 0's (queue=None elsewhere)")
        from .lora import refuse_lora

        refuse_lora(model, "nccl")
        self.queue, self.model, self.rank = queue, model, rank
        self.master_address, self.master_port, self.packed = master_address, master_port, packed
        self.tp, self.timeout = tensor_parallel_size, timeout
        self.client: GrpcWeightSyncClient | None = None
        self._engine = None

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
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        if self.rank != 0:  # not in the NCCL group: this rank only joins the gathers of send_weights()
            info = NCCLTrainerInitInfo(
                master_address=self.master_address, master_port=self.master_port, world_size=1, rank=self.rank
            )
            self._engine = NCCLTrainerWeightTransferEngine.trainer_init(
                info, client=None, source=ModuleSource(self.model)
            )
            return []
        replicas = self.queue.replicas()
        if not replicas:
            raise WeightSyncError(0, {}, {})
        self.client = GrpcWeightSyncClient(
            replicas,
            tensor_parallel_size=self.tp,
            run_id=self.queue.run.run_id,
            timeout=self.timeout,
            **self.queue.replica_auth,
        )
        info = NCCLTrainerInitInfo(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=self.client.world_size,
            packed=self.packed,
            rank=0,  # the sender (vLLM's TrainerInitInfo asks for it explicitly)
        )
        self._engine = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=self.client, source=ModuleSource(self.model)
        )
        return [r.replica_id for r in replicas]

    def publish(self, model: torch.nn.Module | None = None, version: int | None = None) -> dict[str, str]:
        """Broadcast the model's parameters as `version` (default: the last + 1); {replica_id: "ok"}.
        `model`: the publisher's own (None means the same).
        Raises ValueError (nothing sent, nothing recorded) on a version that does not move the run
        forward or a non-finite value; WeightSyncError if a replica of the group failed (the group is
        then unusable: connect() again)."""
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
        data-parallel trainer: join the gathers (a sharded model) and return {}. Checks are publish()'s."""
        if self._engine is None or (self.rank == 0 and self.client is None):
            raise RuntimeError("connect() (or start()) first")
        if self.rank != 0:
            self._engine.send_weights()
            return {}
        self.queue.record_version(version, NCCL_CHECKPOINT)
        self.client.version = version
        self._engine.send_weights()
        # Every replica of the group took part in the one broadcast: any failure already raised.
        return checked(version, dict(self.client.results), require_all=True)
