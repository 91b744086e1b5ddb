"""The NCCL transport's control side without GPUs: GrpcWeightSyncClient (vLLM's VLLMWeightSyncClient
protocol over UpdateWeights) gives each replica its own ranks and carries the tensor list; a replica
whose engine cannot take NCCL (the torch engine) refuses with UNIMPLEMENTED, reported per replica;
NcclPublisher records each version in the run record before the broadcast, as the other
publishers do, and refuses (recording nothing) a version that does not move forward or a NaN."""

from __future__ import annotations

import pytest

from maskroll.client import ReplicaInfo
from maskroll.weight_sync import WeightSyncError
from maskroll.weight_sync.nccl import GrpcWeightSyncClient


def test_each_replica_gets_its_own_rank_offset():
    reps = [ReplicaInfo(f"r{i}", f"127.0.0.1:{i + 1}") for i in range(3)]
    client = GrpcWeightSyncClient(reps, tensor_parallel_size=2)
    assert client.world_size == 7  # the trainer + 3 replicas x 2 ranks
    client._init = {"master_address": "10.0.0.1", "master_port": 29600, "world_size": 7, "packed": True}
    specs = client._specs(init=True)
    assert [s.rank_offset for s in specs] == [1, 3, 5]
    assert {(s.master_address, s.master_port, s.world_size, s.init) for s in specs} == {
        ("10.0.0.1", 29600, 7, True)
    }


def test_a_replica_without_nccl_refuses_and_says_so(torch_replica):
    before = torch_replica.core.updates.weights_served
    client = GrpcWeightSyncClient([ReplicaInfo("torch-0", torch_replica.address)], timeout=10)
    with pytest.raises(WeightSyncError) as err:
        client.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 1, "world_size": 2})
    assert "UNIMPLEMENTED" in client.results["torch-0"] and "NCCL" in client.results["torch-0"]
    assert "torch-0" in str(err.value)
    client.version = before[1] + 1
    with pytest.raises(WeightSyncError):
        client.update_weights({"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[4, 4]]})
    assert "UNIMPLEMENTED" in client.results["torch-0"]
    assert torch_replica.core.updates.weights_served == before


class _TrainerEngine:
    """What vLLM's NCCLTrainerWeightTransferEngine.send_weights does with its client, minus the NCCL
    broadcast itself (which needs GPUs: tests/weight_sync/test_nccl_gpu.py)."""

    def __init__(self, client, model) -> None:
        self.client, self.model = client, model

    def send_weights(self) -> None:
        named = list(self.model.named_parameters())
        self.client.start_weight_update()
        self.client.update_weights(
            {
                "names": [n for n, _ in named],
                "dtype_names": [str(p.dtype).split(".")[-1] for _, p in named],
                "shapes": [list(p.shape) for _, p in named],
            }
        )
        self.client.finish_weight_update()


def test_nccl_publish_records_the_version_in_the_run_like_the_other_publishers(torch_replica):
    import torch

    from maskroll.client import RolloutQueue
    from maskroll.local.redis_server import LocalRedis
    from maskroll.proto.run_record import NCCL_CHECKPOINT
    from maskroll.weight_sync.nccl import NcclPublisher

    model = torch.nn.Linear(4, 4)
    with LocalRedis() as srv, RolloutQueue(srv.url, "nccl", run="new", batch_size=1) as q:
        pub = NcclPublisher(q, model, master_address="127.0.0.1", master_port=1)
        pub.client = GrpcWeightSyncClient([ReplicaInfo("torch-0", torch_replica.address)], timeout=10)
        # connect() without the NCCL rendezvous
        pub.client._init = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}
        pub._engine = _TrainerEngine(pub.client, model)
        with pytest.raises(
            ValueError, match="version -1 does not move the run forward: the last published is 0"
        ):
            pub.publish(model, -1)
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
        with pytest.raises(ValueError, match="'weight' has non-finite values; version 1 not sent"):
            pub.publish(model)
        assert (q.run.version, q.policy_version) == (0, 0)  # refused before anything was recorded
        with torch.no_grad():
            model.weight[0, 0] = 1.0
        # the torch engine takes no NCCL: the replica fails, but the version was recorded first, as
        # broadcast_weights and push_weights record it before any replica loads it
        with pytest.raises(WeightSyncError, match=r"torch-0: .*UNIMPLEMENTED"):
            pub.publish(model)
        assert (q.run.version, q.run.checkpoint, q.policy_version) == (1, NCCL_CHECKPOINT, 1)
        assert pub.version == 1
        with pytest.raises(
            ValueError, match="version 1 does not move the run forward: the last published is 1"
        ):
            pub.publish(model, 1)
        with pytest.raises(TypeError, match=r"publish\(version=v\)"):
            pub.publish(2)  # the old positional version
        with pytest.raises(ValueError, match="the model it was made with"):
            pub.publish(torch.nn.Linear(4, 4))
