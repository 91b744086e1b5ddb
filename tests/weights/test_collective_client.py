"""The NCCL transport's control side without GPUs: GrpcWeightSyncClient (vLLM's VLLMWeightSyncClient
protocol over UpdateWeights) gives each replica its own ranks and carries the tensor list; a replica
whose engine cannot take NCCL (the torch engine) refuses with UNIMPLEMENTED, reported per replica."""

from __future__ import annotations

import pytest

from maskroll.client import ReplicaInfo
from maskroll.weight_sync.collective import GrpcWeightSyncClient
from maskroll.weight_sync.publish import WeightSyncError


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
    before = torch_replica.servicer.weights_served
    client = GrpcWeightSyncClient([ReplicaInfo("torch-0", torch_replica.address)], timeout=10)
    with pytest.raises(WeightSyncError) as err:
        client.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": 1, "world_size": 2})
    assert "UNIMPLEMENTED" in client.results["torch-0"] and "NCCL" in client.results["torch-0"]
    assert "torch-0" in str(err.value)
    client.version = before[1] + 1
    with pytest.raises(WeightSyncError):
        client.update_weights({"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[4, 4]]})
    assert "UNIMPLEMENTED" in client.results["torch-0"]
    assert torch_replica.servicer.weights_served == before
