"""A LoRA adapter pushed to a real gRPC replica on loopback (PushWeights with manifest.adapter): GetInfo
reports it, Generate's records say which adapter (and version) sampled every token, their logprobs are
the merged weights' (scored by a second engine on the merged model), Score uses it too; every refusal
with its status code, after which the old adapter still samples. The torch engine serves the main
replica; the scripted FakeEngine the cases that need no maths (LoRA off, full weights replacing the base,
several namespaces)."""

from __future__ import annotations

import asyncio

import grpc
import lora_helpers as lh
import numpy as np
import pytest
import torch
from fake_engine import FakeEngine
from grpc_fixtures import replica, server_config, start_torch_engine, wait_until
from push_helpers import messages, push, spool_at

from maskroll.client import RolloutClient, RolloutError, SamplingOptions
from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc
from maskroll.proto.records import AdapterInfo
from maskroll.proto.scoring import ScoreOptions
from maskroll.server.engines.contract import SamplingParams, ScoreRequest

PROMPT = [72, 101, 108, 108, 111, 32, 9]
OPTS = SamplingOptions(max_tokens=10, temperature=1.0, logprobs_k=5, seed=7)


@pytest.fixture(scope="module")
def torch_lora(loop, lora_model_dir):
    """A torch replica with LoRA on (rank <= 8, 4 resident, 2 versions of a run); yields (replica, engine)."""
    engine = start_torch_engine(
        loop, lora_model_dir, max_logprobs=5, max_batch=8, threads=1, max_lora_rank=8, max_loras=4
    )
    config = server_config(lora_model_dir, max_lora_rank=8, max_loras=4, lora_versions=2)
    with replica(loop, config, engine) as r:
        yield r, engine
    loop.run(engine.close())


@pytest.fixture(scope="module")
def adapter(lora_model_dir):
    return lh.random_adapter(lora_model_dir, rank=4, alpha=8.0, seed=1, std=0.1)


def _call(address: str, fn):
    async def main():
        async with RolloutClient(address) as c:
            return await fn(c)

    return asyncio.run(main())


def _record(address: str, namespace: str = ""):
    """The record of one Generate (n = 1) in `namespace`, through the real stub."""

    async def main():
        request = wire.generate_request(PROMPT, OPTS, include_record_arrays=True, namespace=namespace)
        async with grpc.aio.insecure_channel(address) as ch:
            async for m in pb_grpc.RolloutServiceStub(ch).Generate(request, timeout=60):
                if m.HasField("record"):
                    return wire.record_from_pb(m.record)
        raise AssertionError("no record")

    try:
        return asyncio.run(main())
    except grpc.aio.AioRpcError as e:
        return RolloutError.from_rpc(e)


def _score_direct(loop, engine, prompt, completion, adapter=None) -> np.ndarray:
    """float32 [T]: log μ of `completion` under the engine's weights (+ adapter) at OPTS' temperature."""
    req = ScoreRequest(
        request_id=f"direct-{id(engine)}-{adapter and adapter.id}",
        prompt_ids=np.asarray(prompt, np.int32),
        completions=(np.asarray(completion, np.int32),),
        params=SamplingParams(max_tokens=len(completion), temperature=OPTS.temperature, logprobs_k=5),
        adapter=adapter,
    )
    return loop.run(engine.score(req)).logprobs[0]


def test_a_pushed_adapter_samples_every_token_and_its_records_say_so(
    loop, torch_lora, adapter, lora_model_dir, tmp_path
):
    r, engine = torch_lora
    spec, tensors = adapter
    info = _call(r.address, lambda c: c.info())
    base_fp = lh.base_fingerprint(lora_model_dir)
    assert (info.base_fingerprint, info.max_lora_rank, info.max_loras, info.adapters) == (base_fp, 8, 4, ())
    before = _record(r.address)
    assert (before.adapter, before.policy_version_first) == ("", 0)  # the base samples

    got = lh.push_adapter(r.address, spec, tensors, version=1, run_id="r1")
    assert not isinstance(got, RolloutError), got
    assert (got.version, got.paused_requests) == (1, 0)
    info = _call(r.address, lambda c: c.info())
    assert info.adapters == (AdapterInfo("default", "r1", 1, "default/r1/v1", 4),)
    assert info.base_fingerprint == base_fp and info.policy_version == 0  # the base is untouched

    rec = _record(r.address)
    assert (rec.adapter, rec.run_id, rec.policy_version_first, rec.policy_version_last) == (
        "default/r1/v1",
        "r1",
        1,
        1,
    )
    assert rec.version_changes == [] and rec.num_tokens == OPTS.max_tokens
    # The numbers are the merged weights': a second engine on W + (alpha/r) B A scores the sampled tokens
    # as the replica sampled them (float32 rounding: the two orders of the sum differ by ~1e-5).
    merged_dir = lh.write_model_dir(
        lora_model_dir,
        lh.merged_state_dict(lh.base_state_dict(lora_model_dir), spec, tensors),
        tmp_path / "m",
    )
    merged = start_torch_engine(loop, merged_dir, max_logprobs=5, max_batch=4, threads=1)
    try:
        on_merged = _score_direct(loop, merged, PROMPT, rec.completion_ids)
    finally:
        loop.run(merged.close())
    np.testing.assert_allclose(rec.sampled_logprobs, on_merged, atol=1e-4, rtol=1e-4)
    on_base = _score_direct(loop, engine, PROMPT, rec.completion_ids)
    assert np.abs(on_base - on_merged).max() > 1e-2  # the adapter moved the distribution
    # Score over gRPC uses the namespace's adapter too, and says its version
    scored = _call(
        r.address,
        lambda c: c.score(PROMPT, [rec.completion_ids], ScoreOptions(temperature=1.0, logprobs_k=5)),
    )
    assert scored.policy_version == 1
    np.testing.assert_allclose(scored.completions[0].logprobs, rec.sampled_logprobs, atol=1e-5, rtol=1e-5)


def _bad_pushes(lora_model_dir, spec, tensors):
    """(what, push kwargs, status code, words) of every refused push."""
    q0 = "model.layers.0.self_attn.q_proj"
    nan = dict(tensors)
    nan[q0 + ".lora_B.weight"] = tensors[q0 + ".lora_B.weight"].clone()
    nan[q0 + ".lora_B.weight"][5, 2] = float("nan")
    wide = dict(tensors)
    wide[q0 + ".lora_A.weight"] = torch.zeros(4, 129)
    other_spec, other = lh.random_adapter(lora_model_dir, rank=4, seed=3, fingerprint="wfp1:another-base")
    big_spec, big = lh.random_adapter(lora_model_dir, rank=16, seed=4)
    small_spec, small = lh.random_adapter(lora_model_dir, rank=2, seed=5)
    ok = dict(spec=spec, tensors=tensors, version=2, run_id="r2")
    return [
        ("wrong base", {**ok, "spec": other_spec, "tensors": other}, "INVALID_ARGUMENT",
         "adapter trained on base wfp1:another-base, this replica serves wfp1:"),
        ("NaN", {**ok, "tensors": nan}, "INVALID_ARGUMENT",
         f"'{q0}.lora_B.weight' in the adapter has 1 non-finite values"),
        ("shape", {**ok, "tensors": wide}, "INVALID_ARGUMENT",
         f"LoRA module '{q0}': lora_A [4, 129] and lora_B [128, 4] do not fit the base's [out, in] = [128, "),
        ("rank of the tensors", {**ok, "tensors": small}, "INVALID_ARGUMENT",
         "are not [4, in] and [out, 4] (rank 4)"),
        ("rank above the replica's", {**ok, "spec": big_spec, "tensors": big}, "FAILED_PRECONDITION",
         "adapter rank 16 is above this replica's --max-lora-rank 8"),
        ("stale version", {**ok, "version": 1}, "FAILED_PRECONDITION",
         "version 1 must be greater than the current adapter version 1 of run r2 in namespace 'default'"),
        ("namespace", {**ok, "namespace": "elsewhere"}, "FAILED_PRECONDITION",
         "namespace 'elsewhere' is not served by this replica (it serves ['default']"),
        ("small spec", {**ok, "spec": small_spec, "tensors": tensors}, "INVALID_ARGUMENT",
         "are not [2, in] and [out, 2] (rank 2)"),
    ]  # fmt: skip


def test_every_refused_push_names_its_reason_and_the_old_adapter_keeps_serving(
    torch_lora, adapter, lora_model_dir
):
    r, _ = torch_lora
    spec, tensors = adapter
    # a new run: version 1 of r2 (the previous test's r1 is evicted once unused)
    got = lh.push_adapter(r.address, spec, tensors, version=1, run_id="r2")
    assert got.version == 1
    expected = (AdapterInfo("default", "r2", 1, "default/r2/v1", 4),)
    for what, kw, code, words in _bad_pushes(lora_model_dir, spec, tensors):
        err = lh.push_adapter(r.address, **kw)
        assert isinstance(err, RolloutError), what
        assert (err.code.name, words in err.message) == (code, True), (what, err.message)
        assert _call(r.address, lambda c: c.info()).adapters == expected, what
    rec = _record(r.address)
    assert (rec.adapter, rec.run_id, rec.policy_version_last) == ("default/r2/v1", "r2", 1)
    err = _record(r.address, namespace="elsewhere")
    assert err.code.name == "FAILED_PRECONDITION" and "namespace 'elsewhere' is not served" in err.message
    # the next good push moves on
    assert lh.push_adapter(r.address, spec, tensors, version=2, run_id="r2").version == 2
    assert _record(r.address).adapter == "default/r2/v2"


@pytest.fixture
def fake_replica(loop, lora_model_dir):
    """Factory: fake_replica(engine kwargs, config overrides) -> (replica, FakeEngine), stopped after."""
    stack = []

    def make(config=None, **engine_kwargs):
        engine = FakeEngine(vocab_size=259, **engine_kwargs)
        cm = replica(loop, server_config(lora_model_dir, **(config or {})), engine)
        stack.append(cm)
        return cm.__enter__(), engine

    yield make
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


def test_a_replica_without_lora_refuses_adapters_naming_max_lora_rank(fake_replica, adapter):
    r, engine = fake_replica()
    err = lh.push_adapter(r.address, *adapter, version=1, run_id="r1")
    assert err.code.name == "FAILED_PRECONDITION"
    assert err.message == (
        "this replica takes no LoRA adapters: start it with --max-lora-rank 4 or more (the fake engine's "
        "max_lora_rank is 0)"
    )
    info = _call(r.address, lambda c: c.info())
    assert (info.max_lora_rank, info.max_loras, info.adapters) == (0, 0, ())
    assert engine.adapter_calls == []


def test_full_weights_replace_the_base_and_end_every_adapter(fake_replica, adapter, lora_model_dir, spool):
    r, engine = fake_replica(config={"max_lora_rank": 8}, max_lora_rank=8)
    assert lh.push_adapter(r.address, *adapter, version=1, run_id="r1").version == 1
    assert _record(r.address).adapter == "default/r1/v1"
    got = push(r.address, messages(lh.base_state_dict(lora_model_dir), version=5, run_id="full"))
    assert not isinstance(got, RolloutError), got
    info = _call(r.address, lambda c: c.info())
    assert (info.adapters, info.base_fingerprint, info.policy_version, info.run_id) == ((), "", 5, "full")
    assert engine.adapter_calls == ["add default/r1/v1", "remove default/r1/v1"]
    rec = _record(r.address)
    assert (rec.adapter, rec.run_id, rec.policy_version_first) == ("", "full", 5)
    err = lh.push_adapter(r.address, *adapter, version=2, run_id="r1")
    assert err.code.name == "FAILED_PRECONDITION" and "no longer serves its base model" in err.message


@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    """Where a full-weight push to the fake engine is written (it loads files, not tensors)."""
    with spool_at(tmp_path_factory.mktemp("spool")) as path:
        yield path


@pytest.fixture(scope="module")
def redis_url():
    from maskroll.local.redis_server import LocalRedis

    with LocalRedis() as r:
        yield r.url


def test_a_replica_serving_several_runs_samples_each_namespace_with_its_own_adapter(
    fake_replica, lora_model_dir, redis_url, spool
):
    """--lora-namespaces b: two runs on one base. Each namespace's pushes move only its own adapter, a
    request names its namespace's, and full weights (which would pull the base from under both) are
    refused whatever the source."""
    config = {"max_lora_rank": 8, "lora_namespaces": ("b",), "redis_url": redis_url}
    r, engine = fake_replica(config=config, max_lora_rank=8)
    spec_a, tensors_a = lh.random_adapter(lora_model_dir, rank=4, seed=11)
    spec_b, tensors_b = lh.random_adapter(lora_model_dir, rank=8, seed=12)
    assert lh.push_adapter(r.address, spec_a, tensors_a, version=3, run_id="ra").version == 3
    assert lh.push_adapter(r.address, spec_b, tensors_b, version=1, run_id="rb", namespace="b").version == 1
    info = _call(r.address, lambda c: c.info())
    assert info.adapters == (
        AdapterInfo("default", "ra", 3, "default/ra/v3", 4),
        AdapterInfo("b", "rb", 1, "b/rb/v1", 8),
    )
    for namespace, name, run, version in (("", "default/ra/v3", "ra", 3), ("b", "b/rb/v1", "rb", 1)):
        rec = _record(r.address, namespace=namespace)
        assert (rec.adapter, rec.run_id, rec.policy_version_first, rec.policy_version_last) == (
            name,
            run,
            version,
            version,
        )
    assert [req.adapter.name for req in engine.requests[-2:]] == ["default/ra/v3", "b/rb/v1"]
    # b's next version leaves default's adapter alone
    assert lh.push_adapter(r.address, spec_b, tensors_b, version=2, run_id="rb", namespace="b").version == 2
    assert _call(r.address, lambda c: c.info()).adapters[0].name == "default/ra/v3"
    assert _record(r.address, namespace="b").adapter == "b/rb/v2"
    words = "this replica serves several LoRA runs on its base (namespaces ['default', 'b'])"
    err = push(r.address, messages(lh.base_state_dict(lora_model_dir), version=5, run_id="full"))
    assert err.code.name == "FAILED_PRECONDITION" and words in err.message
    with pytest.raises(RolloutError) as e:
        _call(r.address, lambda c: c.update_weights(7, str(lora_model_dir), run_id="full"))
    assert e.value.code.name == "FAILED_PRECONDITION" and words in e.value.message
    assert _call(r.address, lambda c: c.info()).policy_version == 0


def test_openai_calls_sample_with_the_replicas_adapter(fake_replica, adapter):
    import httpx

    r, engine = fake_replica(config={"max_lora_rank": 8, "http_port": 0}, max_lora_rank=8)
    assert lh.push_adapter(r.address, *adapter, version=2, run_id="r1").version == 2
    url = f"http://127.0.0.1:{r.http.port}/v1/completions"
    body = {"model": engine.model_id, "prompt": [1, 2, 3], "max_tokens": 3, "n": 2, "seed": 1}
    answer = httpx.post(url, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 2
    assert [req.adapter.name for req in engine.requests] == ["default/r1/v2"] * 2
    assert all(req.adapter.version == 2 and req.adapter.run_id == "r1" for req in engine.requests)
    # the call held the adapter while it sampled, and let it go when it ended
    table = r.core.adapters
    wait_until(lambda: table.users(table.current()) == 0, what="the call to release its adapter")
