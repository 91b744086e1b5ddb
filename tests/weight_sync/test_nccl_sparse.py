"""The sparse_nccl backend of the NCCL transport without GPUs (weight_sync/nccl_sparse.py, nccl.py):

- what NcclPublisher / make_publisher refuse by name before anything is sent (packed, FSDP2, nccl_m2n,
  an unknown backend, dtype on "nccl", a parameter sparse_nccl cannot carry);
- the patches, worked by hand: the first version after connect() and the first after a failed publish
  send every element, a later one the elements whose bits changed in the replicas' dtype (not those that
  moved less than half an ulp), nothing changed sends one element, an overflow of the replicas' dtype is
  refused before the version is recorded;
- end to end through vLLM's own sender engine (its patch checks and update info; a recording group in
  place of NCCL) and vLLM's own in-place apply on a replica model: after every version, failures included,
  the replica holds the trainer's copy bit for bit, and each CollectiveSpec carries the backend and the
  pair count the replica must receive for each tensor;
- the replica's end refuses a spec no receiver can take before its engine is asked.
The broadcast itself is tests/weight_sync/test_nccl_gpu.py's (two GPUs)."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

from maskroll.client import ReplicaInfo, RunInfo
from maskroll.proto.tensor_push import CollectiveSpec, TensorSpec
from maskroll.weight_sync import WeightSyncError, make_publisher
from maskroll.weight_sync.nccl import GrpcWeightSyncClient, NcclPublisher
from maskroll.weight_sync.nccl_sparse import SparseBase

ADDR = {"master_address": "127.0.0.1", "master_port": 1}


class _Queue:
    """What the publisher's constructor touches of a queue: nothing but the object itself."""

    run = RunInfo("run-a")
    policy_version = 0


# ---- refusals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"backend": "sparse_nccl", "packed": True}, r"^backend='sparse_nccl' is never packed"),
        ({"backend": "nccl_m2n"}, r"^backend='nccl_m2n' is not wired: it needs an FSDP2 trainer"),
        ({"backend": "rdma"}, r"^backend='rdma'; expected one of 'nccl', 'sparse_nccl'$"),
        ({"dtype": "bfloat16"}, r"^dtype='bfloat16' is backend='sparse_nccl''s: backend='nccl' sends"),
        ({"backend": "sparse_nccl", "dtype": "int8"}, r"floating-point torch dtype .* or None: torch.int8"),
        ({"backend": "sparse_nccl", "dtype": "auto"}, r"floating-point torch dtype .* or None: 'auto'"),
    ],
)
def test_the_publisher_refuses_a_backend_combination_that_cannot_work_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        NcclPublisher(_Queue(), torch.nn.Linear(2, 2), **ADDR, **kw)
    # the factory passes the keywords through to the same refusals
    with pytest.raises(ValueError, match=message):
        make_publisher("nccl", _Queue(), model=torch.nn.Linear(2, 2), **ADDR, **kw)


def test_sparse_nccl_is_built_unpacked_and_backend_belongs_to_nccl_alone():
    pub = make_publisher("nccl", _Queue(), model=torch.nn.Linear(2, 2), **ADDR, backend="sparse_nccl")
    assert (pub.backend, pub.packed, pub._base.dtype, pub.sent_elements) == ("sparse_nccl", False, None, 0)
    pub = NcclPublisher(_Queue(), torch.nn.Linear(2, 2), **ADDR, backend="sparse_nccl", packed=False)
    assert pub.packed is False
    pub = NcclPublisher(
        _Queue(), torch.nn.Linear(2, 2), **ADDR, backend="sparse_nccl", dtype="torch.bfloat16"
    )
    assert pub._base.dtype is torch.bfloat16
    dense = NcclPublisher(_Queue(), torch.nn.Linear(2, 2), **ADDR)
    assert (dense.backend, dense.packed, dense._base, dense.sent_elements) == ("nccl", True, None, None)
    # the other ranks of a data-parallel trainer keep no copy: only rank 0 sends
    other = NcclPublisher(None, torch.nn.Linear(2, 2), **ADDR, backend="sparse_nccl", rank=1)
    assert other._base is None and other.connect() == [] and other.send(1) == {}
    with pytest.raises(ValueError, match=r"^transport 'stream' takes no backend \(backend: nccl only\)$"):
        make_publisher("stream", _Queue(), follow_s=None, backend="sparse_nccl")


def test_a_parameter_sparse_nccl_cannot_carry_is_refused_naming_it():
    model = torch.nn.Linear(2, 2)
    model.register_parameter(
        "steps", torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    )
    with pytest.raises(
        ValueError, match=r"parameter 'steps' is torch.int64: sparse_nccl sends floating-point"
    ):
        NcclPublisher(_Queue(), model, **ADDR, backend="sparse_nccl")
    NcclPublisher(_Queue(), model, **ADDR)  # the dense backend sends it whole


def test_an_fsdp2_model_is_refused_with_the_backend_to_use_instead(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match=r"FSDP2-sharded \(DTensor parameters\): use backend='nccl'"):
            NcclPublisher(_Queue(), model, **ADDR, backend="sparse_nccl")
        NcclPublisher(_Queue(), model, **ADDR)  # "nccl" gathers each parameter as it sends it
    finally:
        dist.destroy_process_group()


# ---- the patches, by hand -----------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    """Linear(3 -> 2) with weights exact in bf16: w = [[1, 2, 3], [4, 5, 6]], b = [0.5, -0.5]."""
    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
        m.bias.copy_(torch.tensor([0.5, -0.5]))
    return m


def _by_name(patches):
    return {p.name: (p.indices.tolist(), p.values.tolist(), p.full_shape) for p in patches}


def test_the_first_version_is_full_then_only_the_bits_that_changed_in_the_replicas_dtype():
    model, base = _model(), SparseBase(torch.bfloat16)
    params = lambda: dict(model.named_parameters())  # noqa: E731
    first = base.patches(params())
    assert _by_name(first) == {
        "weight": ([0, 1, 2, 3, 4, 5], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], (2, 3)),
        "bias": ([0, 1], [0.5, -0.5], (2,)),
    }
    assert all(p.indices.dtype == torch.int32 and p.values.dtype == torch.bfloat16 for p in first)
    assert base.sent_elements == 8 and not base.known
    base.sent()
    with torch.no_grad():
        # bf16 near 5 has an ulp of 2**-5 = 0.03125: +0.01 rounds back to 5.0 (not sent), +0.05 to 5.0625;
        # weight[0, 0] 1.0 -> 1.5 (exact); the bias does not move
        model.weight[1, 1] += 0.05
        model.weight[1, 0] += 0.01
        model.weight[0, 0] = 1.5
    second = base.patches(params())
    assert _by_name(second) == {"weight": ([0, 4], [1.5, 5.0625], (2, 3))}
    assert base.sent_elements == 2
    assert base.tensors["weight"].tolist() == [[1.5, 2.0, 3.0], [4.0, 5.0625, 6.0]]  # the base moved with it
    base.sent()
    # nothing changed: one element, the first tensor's first, as it is (a version must still land)
    assert _by_name(base.patches(params())) == {"weight": ([0], [1.5], (2, 3))}


def test_a_patch_never_lands_on_an_unknown_base_after_a_failure_or_a_new_group():
    model, base = _model(), SparseBase(None)
    base.patches(dict(model.named_parameters()))
    base.sent()
    with torch.no_grad():
        model.bias[1] = 7.0
    assert _by_name(base.patches(dict(model.named_parameters()))) == {"bias": ([1], [7.0], (2,))}
    # not sent(): the publish failed, some replicas may hold it and some not -> every element again
    again = base.patches(dict(model.named_parameters()))
    assert _by_name(again)["bias"] == ([0, 1], [0.5, 7.0], (2,)) and base.sent_elements == 8
    base.sent()
    base.forget()  # connect() formed a new group
    assert base.sent_elements == 8 and len(base.patches(dict(model.named_parameters()))[0].indices) == 6


def test_an_overflow_of_the_replicas_dtype_is_refused_and_the_next_version_is_full():
    model, base = _model(), SparseBase(torch.float16)
    base.patches(dict(model.named_parameters()))
    base.sent()
    with torch.no_grad():
        model.weight[0, 2] = 1e5  # finite in float32, inf in float16 (max 65504)
    with pytest.raises(ValueError, match=r"parameter 'weight' is not finite in torch.float16"):
        base.patches(dict(model.named_parameters()))
    with torch.no_grad():
        model.weight[0, 2] = 3.0
    assert base.sent_elements == 8  # the refused call left the count of the last patches as it was
    assert len(base.patches(dict(model.named_parameters()))[0].indices) == 6


# ---- end to end through vLLM's sender and vLLM's apply ------------------------------------------------


class _Group:
    """NCCL's place in vLLM's sparse sender: every broadcast tensor, in order (a copy: what a receiver
    would get)."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor, src, stream=None) -> None:
        assert src == 0
        self.sent.append(tensor.clone())


class _Replica(torch.nn.Module):
    """A replica's model as vLLM's sparse receiver loads it: `load_weights` copies each checkpoint tensor
    into its parameter (vLLM swaps copy_ for a NaN-masked one around it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
        return {name for name, _ in weights}


def _receive(replica: _Replica, spec: CollectiveSpec, sent: list[torch.Tensor]) -> None:
    """What vLLM's SparseNCCLWeightTransferEngine.receive_weights does with the spec's update info:
    indices then values per tensor, `changed` of each, then the in-place apply."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    patches = []
    for t in spec.tensors:
        indices, values = sent.pop(0), sent.pop(0)
        assert (indices.dtype, indices.numel(), values.numel()) == (torch.int32, t.changed, t.changed)
        dtype = getattr(torch, t.dtype)
        patches.append(CheckpointWeightPatch(t.name, t.shape, dtype, values.to(dtype), indices))
    load_checkpoint_weight_patches(replica, patches)


@pytest.mark.vllm
def test_every_version_reaches_the_replica_bit_for_bit_through_vllms_sparse_engine(monkeypatch):
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerWeightTransferEngine

    from maskroll.client import RolloutQueue
    from maskroll.local.redis_server import LocalRedis

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)  # the CPU group takes none
    model, replica, group = _model(), _Replica(), _Group()
    specs: list[tuple[int, CollectiveSpec]] = []
    fail = []

    with LocalRedis() as srv, RolloutQueue(srv.url, "sparse", run="new", batch_size=1) as q:
        pub = NcclPublisher(q, model, **ADDR, backend="sparse_nccl", dtype=torch.bfloat16)
        client = pub.client = GrpcWeightSyncClient([ReplicaInfo("r0", "127.0.0.1:1")], backend="sparse_nccl")
        client._init = {**ADDR, "world_size": 2, "packed": False}  # vLLM's sparse init payload

        def call(version: int, calls: list[CollectiveSpec]) -> None:  # the RPC, and the replica's receive
            assert q.run.version == version  # recorded before any replica loads it
            [spec] = calls
            specs.append((version, spec))
            if fail:  # this replica fails: it applies nothing
                client.results = {"r0": "INTERNAL: lost"}
                raise WeightSyncError(version, dict(client.results), dict(client.results))
            client.results = {"r0": "ok"}

        client._call = call
        # connect() without the rendezvous: vLLM's own sender on the recording group
        pub._engine = SparseNCCLTrainerWeightTransferEngine(client=client)
        pub._engine.model_update_group = group
        pub._base.forget()

        def publish_and_apply() -> CollectiveSpec:
            assert pub.publish(model) == {"r0": "ok"}
            spec = specs[-1][1]
            _receive(replica, spec, group.sent)
            assert group.sent == []
            assert torch.equal(
                replica.weight.view(torch.int16), model.weight.to(torch.bfloat16).view(torch.int16)
            )
            assert torch.equal(replica.bias, model.bias.to(torch.bfloat16))
            return spec

        spec = publish_and_apply()  # version 1: full
        assert (spec.backend, spec.packed, [(t.name, t.dtype, t.changed) for t in spec.tensors]) == (
            "sparse_nccl",
            False,
            [("weight", "bfloat16", 6), ("bias", "bfloat16", 2)],
        )
        spec.check()
        with torch.no_grad():
            model.weight[1, 2] = -3.25
        spec = publish_and_apply()  # version 2: one element
        assert [(t.name, t.changed) for t in spec.tensors] == [("weight", 1)] and pub.sent_elements == 1

        with torch.no_grad():
            model.bias[0] = 2.0
        fail.append(True)
        with pytest.raises(WeightSyncError, match="r0"):
            pub.publish(model)
        assert specs[-1][0] == 3 and q.run.version == 3  # recorded, sent, not applied by the replica
        fail.clear()
        group.sent.clear()
        with torch.no_grad():
            model.weight[0, 1] = 9.0
        spec = publish_and_apply()  # version 4: full again, so bias[0] = 2.0 lands too
        assert [(t.name, t.changed) for t in spec.tensors] == [("weight", 6), ("bias", 2)]
        spec = publish_and_apply()  # version 5: nothing changed, one element, and the version lands
        assert [(t.name, t.changed) for t in spec.tensors] == [("weight", 1)]
        assert [v for v, _ in specs] == [1, 2, 3, 4, 5] and pub.version == 5

        with torch.no_grad():
            model.weight[0, 0] = float("nan")
        with pytest.raises(ValueError, match="'weight' has non-finite values; version 6 not sent"):
            pub.publish(model)
        assert q.run.version == 5 and len(specs) == 5


def test_the_client_maps_vllms_update_info_into_the_specs():
    client = GrpcWeightSyncClient([ReplicaInfo("r0", "h:1"), ReplicaInfo("r1", "h:2")], backend="sparse_nccl")
    client._init = {**ADDR, "world_size": 3, "packed": False}
    calls = []
    client._call = lambda version, specs: calls.append((version, specs))
    client.version = 4
    client.update_weights(
        {
            "names": ["a", "b"],
            "dtype_names": ["bfloat16", "float32"],
            "shapes": [[2, 2], [3]],
            "num_updates_list": [1, 3],
        }
    )
    [(version, specs)] = calls
    assert version == 4 and [s.rank_offset for s in specs] == [1, 2]
    assert {s.backend for s in specs} == {"sparse_nccl"} and not any(s.packed for s in specs)
    assert specs[0].tensors == (
        TensorSpec("a", "bfloat16", (2, 2), 0, changed=1),
        TensorSpec("b", "float32", (3,), 0, changed=3),
    )
    dense = GrpcWeightSyncClient([ReplicaInfo("r0", "h:1")])
    dense._init = {**ADDR, "world_size": 2, "packed": True}
    dense._call = lambda version, specs: calls.append((version, specs))
    dense.update_weights({"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]]})
    assert calls[-1][1][0].backend == "nccl" and calls[-1][1][0].tensors[0].changed == 0


# ---- the replica's end ---------------------------------------------------------------------------------


def test_the_replica_refuses_a_spec_no_receiver_can_take_before_its_engine_is_asked():
    """server/weights/nccl.py: an NCCL-capable engine (vLLM's on GPUs; a recording stand-in here) is never
    asked to receive a spec that does not match what the trainer sends: NCCL would hang."""
    from maskroll.server.errors import InvalidArgument
    from maskroll.server.weights.nccl import NcclSource, join

    asked = []

    async def update_weights_collective(version, spec):
        asked.append(spec)
        return 0

    async def init_weight_transfer(spec):
        raise ValueError("the engine's workers run backend 'nccl', the spec names 'sparse_nccl'")

    engine = types.SimpleNamespace(
        name="stand-in",
        weight_capabilities=types.SimpleNamespace(nccl=True),
        update_weights_collective=update_weights_collective,
        init_weight_transfer=init_weight_transfer,
    )
    base = dict(group_name="g", master_address="h", master_port=1, rank_offset=1, world_size=2)
    zero = CollectiveSpec(
        **base, packed=False, backend="sparse_nccl", tensors=(TensorSpec("w", "bfloat16", (2,), 0),)
    )
    with pytest.raises(InvalidArgument, match=r"refused: tensor 'w': a sparse_nccl patch of 0 elements on 2"):
        asyncio.run(NcclSource(zero).load(engine, 1))
    with pytest.raises(InvalidArgument, match=r"refused: backend 'ipc' is not one of 'nccl', 'sparse_nccl'"):
        asyncio.run(join(engine, NcclSource(CollectiveSpec(**base, init=True, backend="ipc"))))
    assert asked == []
    good = CollectiveSpec(
        **base,
        packed=False,
        backend="sparse_nccl",
        tensors=(TensorSpec("w", "bfloat16", (2,), 0, changed=2),),
    )
    assert "sparse broadcast of 2 elements in 1 tensors" in NcclSource(good).describe()
    asyncio.run(NcclSource(good).load(engine, 1))
    assert asked == [good]
    # the engine's own refusal (its workers' backend) reaches the trainer as INVALID_ARGUMENT, named
    with pytest.raises(InvalidArgument, match=r"NCCL join failed: ValueError: the engine's workers run"):
        asyncio.run(
            join(engine, NcclSource(CollectiveSpec(**base, init=True, packed=False, backend="sparse_nccl")))
        )
