"""A new run's version 0 without a load (AdoptSource): GetInfo reports the starting weights' fingerprint,
which is the trainer's model's when both hold the same weights; a replica adopts only that fingerprint,
only version 0 of a run, only while it serves its starting weights — a mismatch is refused by name and
changes nothing (the trainer then pushes its model)."""

from __future__ import annotations

import grpc
import pytest
from grpc_fixtures import replica, server_config, server_loop, start_torch_engine  # noqa: F401

from maskroll.client import RolloutClient, RolloutError


@pytest.fixture(scope="module")
def served(server_loop, tiny_model_dir):  # noqa: F811
    engine = start_torch_engine(server_loop, tiny_model_dir, max_logprobs=5, max_batch=4)
    with replica(server_loop, server_config(tiny_model_dir), engine) as r:
        yield r
    server_loop.run(engine.close())


def _call(server_loop, r, fn):  # noqa: F811
    async def go():
        async with RolloutClient(r.address) as c:
            return await fn(c)

    return server_loop.run(go())


def test_adopt_takes_only_the_same_weights_and_only_a_new_runs_version_0(server_loop, served, tiny_model_dir):  # noqa: F811
    import torch
    import transformers

    from maskroll.server.weights.dir_fingerprint import fingerprint_dir
    from maskroll.weight_sync.model_fingerprint import model_fingerprint

    info = _call(server_loop, served, lambda c: c.info())
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    mine = model_fingerprint(model)
    assert info.weights_fingerprint == mine == fingerprint_dir(tiny_model_dir) != ""
    assert info.run_id == ""

    with torch.no_grad():
        model.model.norm.weight[0] += 0.5  # one value at a sampled position: other weights
    other = model_fingerprint(model)
    assert other != mine
    with pytest.raises(RolloutError) as e:
        _call(server_loop, served, lambda c: c.adopt_weights(other, run_id="run-a"))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert mine in str(e.value) and "other weights; push the model instead" in str(e.value)
    assert _call(server_loop, served, lambda c: c.info()).run_id == ""  # nothing changed

    with pytest.raises(RolloutError) as e:
        _call(server_loop, served, lambda c: c.adopt_weights(mine, run_id=""))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT

    result = _call(server_loop, served, lambda c: c.adopt_weights(mine, run_id="run-a"))
    assert (result.version, result.load_seconds) == (0, 0.0)
    info = _call(server_loop, served, lambda c: c.info())
    assert (info.run_id, info.policy_version, info.weights_fingerprint) == ("run-a", 0, "")
    # a retry of the same adoption is answered alike; another run's cannot adopt what run-a now serves
    assert _call(server_loop, served, lambda c: c.adopt_weights(mine, run_id="run-a")).version == 0
    with pytest.raises(RolloutError) as e:
        _call(server_loop, served, lambda c: c.adopt_weights(mine, run_id="run-b"))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "version 0 of run run-a" in str(e.value)
