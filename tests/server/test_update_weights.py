"""UpdateWeights through gRPC on a real TorchEngine: where checkpoints may come from, versions that must
increase, bad content refused without harm, outputs and versions that change — also mid-stream.

The engine here is this module's own: it changes weights, which the session's shared engine must not.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import numpy as np
import pytest
from grpc_fixtures import replica, server_config, server_loop, start_torch_engine, wait_until  # noqa: F401

from maskroll.client import RecordAssembler, RolloutClient, RolloutError, SamplingOptions
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc

PROMPT = [256, 84, 104, 101]  # <bos> "The"
OPTS = SamplingOptions(max_tokens=12, logprobs_k=5, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def weights(tmp_path_factory, tiny_model_dir):
    """weights_root with checkpoints v1 (seed 1), v2 (seed 2), a corrupt one and a mis-shaped one; and a
    checkpoint outside the root with a symlink to it from inside."""
    import torch
    from safetensors.torch import save_file

    from maskroll.app.model_init import init_model

    base = tmp_path_factory.mktemp("weights")
    root = base / "root"
    init_model(root / "v1", seed=1)
    init_model(root / "v2", seed=2)
    (root / "corrupt").mkdir()
    (root / "corrupt" / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    (root / "misshaped").mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(root / "misshaped" / "model.safetensors"))
    init_model(base / "outside", seed=3)
    os.symlink(base / "outside", root / "escape")
    return root


@pytest.fixture(scope="module")
def engine(server_loop, tiny_model_dir):  # noqa: F811
    e = start_torch_engine(server_loop, tiny_model_dir, max_logprobs=20, max_batch=8)
    yield e
    server_loop.run(e.close())


@pytest.fixture(scope="module")
def server(server_loop, engine, tiny_model_dir, weights):  # noqa: F811
    with replica(server_loop, server_config(tiny_model_dir, weights_root=weights), engine) as r:
        yield r


def _call(server, fn):
    async def main():
        async with RolloutClient(server.address) as c:
            return await fn(c)

    return asyncio.run(main())


def _update_error(server, version, path) -> RolloutError:
    async def fn(c):
        with pytest.raises(RolloutError) as err:
            await c.update_weights(version, path)
        return err.value

    return _call(server, fn)


def _version(server) -> int:
    async def fn(c):
        return (await c.info()).policy_version

    return _call(server, fn)


@pytest.mark.parametrize("path", ["/etc", "../outside", "escape"])
def test_checkpoints_outside_the_root_are_permission_denied(server, weights, path):
    err = _update_error(server, _version(server) + 1, path)
    assert err.code == grpc.StatusCode.PERMISSION_DENIED and "weights_root" in err.message


def test_symlink_escape_by_absolute_path_is_denied(server, weights):
    err = _update_error(server, _version(server) + 1, str(weights / "escape"))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED


def test_a_server_without_weights_root_refuses_every_update(server_loop, engine, tiny_model_dir, weights):  # noqa: F811
    with replica(server_loop, server_config(tiny_model_dir), engine) as bare:
        err = _update_error(bare, 100, str(weights / "v1"))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED and "without a weights_root" in err.message


@pytest.mark.parametrize(
    ("name", "needle"), [("corrupt", "could not be loaded"), ("misshaped", "could not be loaded")]
)
def test_bad_checkpoint_content_is_invalid_argument_and_the_server_keeps_serving(
    server, weights, name, needle
):
    before = _version(server)
    err = _update_error(server, before + 1, name)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and needle in err.message and name in err.message

    async def fn(c):
        return await c.generate_record(PROMPT, OPTS), (await c.info()).policy_version

    rec, after = _call(server, fn)
    assert after == before and rec.num_tokens == 12 and rec.policy_version_first == before


def test_collective_source_is_unimplemented(server):
    async def main():
        async with grpc.aio.insecure_channel(server.address) as ch:
            req = pb.UpdateWeightsRequest(
                version=99, collective=pb.CollectiveSource(group_name="g", world_size=2)
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.RolloutServiceStub(ch).UpdateWeights(req)
            return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED and "NCCL" in err.details()


def test_update_changes_outputs_and_version_and_versions_must_increase(server, weights):
    async def fn(c):
        before = await c.generate_record(PROMPT, OPTS)
        v = (await c.info()).policy_version + 1
        result = await c.update_weights(v, weights / f"v{1 if v % 2 else 2}")
        after = await c.generate_record(PROMPT, OPTS)
        info = await c.info()
        with pytest.raises(RolloutError) as same:
            await c.update_weights(v, weights / "v1")
        with pytest.raises(RolloutError) as lower:
            await c.update_weights(v - 1, weights / "v1")
        return before, v, result, after, info, same.value, lower.value

    before, v, result, after, info, same, lower = _call(server, fn)
    assert result.version == v and info.policy_version == v and result.load_seconds > 0
    assert (after.policy_version_first, after.policy_version_last, after.version_changes) == (v, v, [])
    # Same seed, same prompt, new weights: the distribution (and so the logprobs) changed.
    assert not np.allclose(before.topk_logprobs[0], after.topk_logprobs[0], atol=1e-3)
    for err in (same, lower):
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"greater than the current policy version {v}" in err.message
    assert server.metrics.registry.get_sample_value("maskroll_policy_version") == v


def test_in_flight_stream_sees_the_version_change_at_a_token_index(server, weights):
    async def fn(c):
        v = (await c.info()).policy_version + 1
        assembler, per_token, result = RecordAssembler(), [], None
        async for ch in c.generate(
            PROMPT, SamplingOptions(max_tokens=600, logprobs_k=3, seed=1, ignore_eos=True)
        ):
            per_token += [ch.policy_version] * len(ch.token_ids)
            if result is None and per_token:
                result = await c.update_weights(v, weights / f"v{1 if v % 2 else 2}")
            rec = assembler.add(ch)
        return v, result, per_token, rec

    v, result, per_token, rec = _call(server, fn)
    assert result.paused_requests == 1, "the stream was in flight during the update"
    assert rec.num_tokens == 600 and rec.finish_reason == "length"
    change = per_token.index(v)
    assert 0 < change < 600, "the update landed mid-stream"
    assert rec.version_changes == [(change, v)]
    assert (rec.policy_version_first, rec.policy_version_last) == (v - 1, v)
    np.testing.assert_array_equal(rec.token_versions(), per_token)


def test_a_file_swapped_for_a_symlink_between_check_and_load_is_refused(server_loop, engine, server, weights):  # noqa: F811
    """The check-then-load race of issue 11: the path is checked, then (before the engine opens the
    files) the checkpoint's file becomes a symlink to weights outside the root. The engine opens only
    the files that were checked, by inode and without following symlinks, so the load is refused and the
    old weights serve on."""
    import shutil

    from maskroll.server.errors import PermissionDenied
    from maskroll.server.weights import checkpoints as weights_module

    swap = weights / "swap"
    shutil.copytree(weights / "v1", swap)
    before = _version(server)
    checked = weights_module.resolve_checkpoint("swap", weights)
    target = swap / "model.safetensors"
    target.unlink()
    os.symlink(weights.parent / "outside" / "model.safetensors", target)
    with pytest.raises(PermissionDenied, match=r"model\.safetensors changed after it was checked"):
        server_loop.run(weights_module.load_checkpoint(engine, before + 1, checked))
    assert _version(server) == before and engine.policy_version == before

    async def fn(c):
        return await c.generate_record(PROMPT, OPTS)

    rec = _call(server, fn)
    assert rec.num_tokens == 12 and rec.policy_version_first == before
    # Through gRPC the path is checked anew: the symlink now points outside the root.
    err = _update_error(server, before + 1, "swap")
    assert err.code == grpc.StatusCode.PERMISSION_DENIED and "links outside the weights_root" in err.message
