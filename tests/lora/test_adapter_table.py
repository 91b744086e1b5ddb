"""AdapterTable (server/weights/adapters.py): the rules of a pushed adapter, the version rule per
namespace, residency (versions per run, max_loras by LRU among unused, never a current one, in-use
adapters kept until their requests end) and every refusal with its message — after each of which the old
adapter is still current and nothing new is resident. The engine is tests/server's scripted FakeEngine
(it records every add / remove the table asks for); tests/lora/test_push_adapter.py runs the same table
behind a real gRPC replica. Each test runs its own event loop (asyncio.run)."""

from __future__ import annotations

import asyncio
import dataclasses

import lora_helpers as lh
import pytest
import torch
from fake_engine import FakeEngine

from maskroll.server.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from maskroll.server.weights.adapters import AdapterTable
from maskroll.server.weights.tensor_rules import Layout

FP = "wfp1:base"
# A base of two blocks, Linear weights [out, in] of distinct sizes so a transposed or swapped tensor shows.
BASE = {
    "model.layers.0.self_attn.q_proj.weight": torch.zeros(12, 8),
    "model.layers.0.self_attn.v_proj.weight": torch.zeros(6, 8),
    "model.layers.1.self_attn.q_proj.weight": torch.zeros(12, 8),
    "model.layers.1.self_attn.v_proj.weight": torch.zeros(6, 8),
    "model.layers.0.input_layernorm.weight": torch.zeros(8),
    "model.embed_tokens.weight": torch.zeros(20, 8),
}
LAYOUTS = {name: Layout.of(t) for name, t in BASE.items()}


def _adapter(seed: int = 0, rank: int = 4, fingerprint: str = FP, targets=("q_proj", "v_proj")):
    return lh.random_adapter(
        BASE, rank=rank, alpha=8.0, target_modules=targets, seed=seed, fingerprint=fingerprint
    )


def _table(engine=None, *, namespaces=("ns",), max_loras: int = 4, versions: int = 2, fp: str = FP):
    engine = engine or FakeEngine(max_lora_rank=8)
    table = AdapterTable(
        engine,
        base_fingerprint=fp,
        max_loras=max_loras,
        versions_per_run=versions,
        namespaces=namespaces,
        base_layouts=lambda: LAYOUTS,
    )
    return table, engine


def _load(table: AdapterTable, version: int, run: str = "r1", ns: str = "", seed: int = 0, spec_tensors=None):
    spec, tensors = spec_tensors or _adapter(seed)
    manifest = lh.adapter_manifest(spec, tensors, version, run, ns)
    return table.load(manifest, dict(tensors))


def _names(table: AdapterTable) -> list[str]:
    return [r.name for r in table.resident()]


def test_a_load_makes_the_adapter_current_and_reports_it() -> None:
    async def main():
        table, engine = _table()
        assert table.current("ns") is None and table.served("ns") is None and table.info() == ()
        with table.use() as ref:
            assert ref is None  # no adapter yet: the base samples
        paused, seconds = await _load(table, 3)
        ref = table.current("")  # "" is the replica's own namespace
        assert (ref.name, ref.id, ref.version, ref.namespace, ref.run_id) == ("ns/r1/v3", 1, 3, "ns", "r1")
        assert paused == 0 and seconds >= 0
        assert table.served("ns") == ("r1", 3)
        (info,) = table.info()
        assert (info.namespace, info.run_id, info.version, info.name, info.rank) == (
            "ns",
            "r1",
            3,
            "ns/r1/v3",
            4,
        )
        assert engine.adapter_calls == ["add ns/r1/v3"]
        spec, tensors = _adapter(0)
        got_ref, weights = engine.adapters[1]
        assert got_ref == ref and weights.spec == spec
        assert torch.equal(weights.tensors["model.layers.1.self_attn.v_proj.lora_B.weight"],
                           tensors["model.layers.1.self_attn.v_proj.lora_B.weight"])  # fmt: skip

    asyncio.run(main())


def test_versions_move_forward_within_a_run_and_restart_with_a_new_run() -> None:
    async def main():
        table, engine = _table(versions=2)
        await _load(table, 1)
        await _load(table, 2, seed=1)
        for stale in (2, 1):
            with pytest.raises(FailedPrecondition) as e:
                await _load(table, stale, seed=2)
            assert str(e.value) == (
                f"version {stale} must be greater than the current adapter version 2 of run r1 in "
                "namespace 'ns'"
            )
        with pytest.raises(InvalidArgument, match="version -1 is negative"):
            await _load(table, -1, run="r2")
        assert table.served("ns") == ("r1", 2) and _names(table) == ["ns/r1/v1", "ns/r1/v2"]
        # version 3 retires v1 (2 versions of a run are kept)
        await _load(table, 3, seed=3)
        assert _names(table) == ["ns/r1/v2", "ns/r1/v3"]
        # another run starts again at 0, and the old run's adapters leave (no request uses them)
        await _load(table, 0, run="r2", seed=4)
        assert table.served("ns") == ("r2", 0) and _names(table) == ["ns/r2/v0"]
        assert engine.adapter_calls == [
            "add ns/r1/v1", "add ns/r1/v2", "add ns/r1/v3", "remove ns/r1/v1", "add ns/r2/v0",
            "remove ns/r1/v2", "remove ns/r1/v3",
        ]  # fmt: skip
        assert [r.id for r in table.resident()] == [4]  # ids are never reused

    asyncio.run(main())


def test_an_adapter_in_use_stays_resident_until_its_requests_end() -> None:
    async def main():
        table, engine = _table(versions=1)
        await _load(table, 1)
        with table.use("ns") as v1:
            await _load(table, 2, seed=1)  # v1 is retired (1 version kept) but samples a request
            assert table.current("ns").version == 2 and table.users(v1) == 1
            assert _names(table) == ["ns/r1/v1", "ns/r1/v2"]
            with table.use("ns") as v2:
                assert v2.version == 2 and table.users(v2) == 1
        for _ in range(3):  # the request ended: v1 is removed on the loop, right after
            await asyncio.sleep(0)
        assert _names(table) == ["ns/r1/v2"] and table.users(v1) == 0
        assert engine.adapter_calls[-1] == "remove ns/r1/v1"

    asyncio.run(main())


@pytest.mark.parametrize("used_last", ["a", "b"])
def test_max_loras_evicts_the_least_recently_used_adapter_no_request_uses(used_last: str) -> None:
    """4 slots, namespaces a and b keeping 3 versions each: the 5th load must evict one of the two
    non-current adapters (a's v1, b's v1): the one whose namespace sampled with it longer ago."""

    async def main():
        table, engine = _table(namespaces=("a", "b"), max_loras=4, versions=3)
        await _load(table, 1, ns="a")
        await _load(table, 1, ns="b")
        first = "b" if used_last == "a" else "a"
        for ns in (first, used_last):
            with table.use(ns):
                pass
        await _load(table, 2, ns="a", seed=1)
        await _load(table, 2, ns="b", seed=2)
        assert len(table.resident()) == 4
        await _load(table, 3, ns="a", seed=3)
        assert engine.adapter_calls[-2:] == [f"remove {first}/r1/v1", "add a/r1/v3"]
        assert sorted(_names(table)) == sorted(["a/r1/v2", "a/r1/v3", "b/r1/v2", f"{used_last}/r1/v1"])

    asyncio.run(main())


def test_no_room_is_refused_naming_max_loras_and_the_old_adapters_serve() -> None:
    async def main():
        table, engine = _table(max_loras=2, versions=2)
        await _load(table, 1)
        with table.use() as v1:
            await _load(table, 2, seed=1)
            # v1 samples a request, v2 is current: neither may go
            with pytest.raises(ResourceExhausted) as e:
                await _load(table, 3, seed=2)
            assert "2 adapters are resident, the --max-loras 2" in str(e.value)
            assert table.served("ns") == ("r1", 2) and _names(table) == ["ns/r1/v1", "ns/r1/v2"]
            assert table.users(v1) == 1
        await _load(table, 3, seed=2)  # v1's request ended: it is evicted for room
        assert _names(table) == ["ns/r1/v2", "ns/r1/v3"]
        assert engine.adapter_calls[-2:] == ["remove ns/r1/v1", "add ns/r1/v3"]

    asyncio.run(main())


def test_one_namespace_never_evicts_another_namespaces_current_adapter() -> None:
    async def main():
        table, _ = _table(namespaces=("a", "b", "c"), max_loras=2, versions=2)
        await _load(table, 1, ns="a")
        await _load(table, 1, ns="b")
        with pytest.raises(ResourceExhausted, match="--max-loras 2"):
            await _load(table, 1, ns="c")
        assert table.current("c") is None and [i.name for i in table.info()] == ["a/r1/v1", "b/r1/v1"]

    asyncio.run(main())


def _bad(case: str):
    """(spec, tensors) of a broken adapter, and the words of its refusal."""
    spec, tensors = _adapter(5)
    q0 = "model.layers.0.self_attn.q_proj"
    if case == "nan":
        tensors[q0 + ".lora_B.weight"][3, 1] = float("nan")
        return spec, tensors, InvalidArgument, f"'{q0}.lora_B.weight' in the adapter has 1 non-finite values"
    if case == "inf":
        tensors[q0 + ".lora_A.weight"][0, 0] = float("inf")
        return spec, tensors, InvalidArgument, f"'{q0}.lora_A.weight' in the adapter has 1 non-finite values"
    if case == "shape":  # lora_A of the wrong in_features
        tensors[q0 + ".lora_A.weight"] = torch.zeros(4, 9)
        return (
            spec,
            tensors,
            InvalidArgument,
            (
                f"LoRA module '{q0}': lora_A [4, 9] and lora_B [12, 4] do not fit the base's [out, in] = "
                "[12, 8] at rank 4: expected [4, 8] and [12, 4]"
            ),
        )
    if case == "transposed":  # B as [r, out]
        tensors[q0 + ".lora_B.weight"] = torch.zeros(4, 12)
        return (
            spec,
            tensors,
            InvalidArgument,
            f"LoRA module '{q0}': lora_A [4, 8] and lora_B [4, 12] do not fit",
        )
    if case == "rank":  # tensors of rank 2 under a spec of rank 4
        _, small = _adapter(5, rank=2)
        return spec, small, InvalidArgument, "expected [4, 8] and [12, 4]"
    if case == "module":  # a module the base lacks
        tensors["model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 8)
        tensors["model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.zeros(12, 4)
        return (
            spec,
            tensors,
            InvalidArgument,
            (
                "LoRA module 'model.layers.7.self_attn.q_proj': the base has no weight "
                "'model.layers.7.self_attn.q_proj.weight'"
            ),
        )
    if case == "not_linear":  # the embedding is 2-D but a norm is not
        tensors["model.layers.0.input_layernorm.lora_A.weight"] = torch.zeros(4, 8)
        tensors["model.layers.0.input_layernorm.lora_B.weight"] = torch.zeros(8, 4)
        return spec, tensors, InvalidArgument, "is not a Linear's floating [out, in] weight"
    if case == "target":  # a module outside the spec's target_modules
        return (
            dataclasses.replace(spec, target_modules=("q_proj",)),
            tensors,
            InvalidArgument,
            (
                "LoRA module 'model.layers.0.self_attn.v_proj' is not one of the adapter's target_modules "
                "['q_proj']"
            ),
        )
    if case == "dtype":
        tensors[q0 + ".lora_A.weight"] = torch.zeros(4, 8, dtype=torch.int32)
        return spec, tensors, InvalidArgument, f"LoRA tensor '{q0}.lora_A.weight' has dtype torch.int32"
    if case == "fingerprint":
        spec, tensors = _adapter(5, fingerprint="wfp1:other")
        return (
            spec,
            tensors,
            InvalidArgument,
            (
                "adapter trained on base wfp1:other, this replica serves wfp1:base: push it to replicas of "
                "the model it was trained on"
            ),
        )
    if case == "max_rank":
        spec, tensors = _adapter(5, rank=16)
        return (
            spec,
            tensors,
            FailedPrecondition,
            (
                "adapter rank 16 is above this replica's --max-lora-rank 8: restart it with "
                "--max-lora-rank 16 or more"
            ),
        )
    raise AssertionError(case)


CASES = [
    "nan",
    "inf",
    "shape",
    "transposed",
    "rank",
    "module",
    "not_linear",
    "target",
    "dtype",
    "fingerprint",
]


@pytest.mark.parametrize("case", [*CASES, "max_rank"])
def test_a_bad_adapter_is_refused_by_name_and_the_old_one_keeps_serving(case: str) -> None:
    async def main():
        table, engine = _table()
        await _load(table, 1)
        old = table.current("ns")
        spec, tensors, error, words = _bad(case)
        with pytest.raises(error) as e:
            await _load(table, 2, spec_tensors=(spec, tensors))
        assert words in str(e.value)
        assert table.current("ns") == old and _names(table) == ["ns/r1/v1"]
        assert engine.adapter_calls == ["add ns/r1/v1"]  # the engine never saw the bad one
        with table.use() as ref:
            assert ref == old
        await _load(table, 2, seed=9)  # and the next good push loads
        assert table.served("ns") == ("r1", 2)

    asyncio.run(main())


def test_the_engine_refusing_an_adapter_leaves_the_old_one_current() -> None:
    async def main():
        table, engine = _table()
        await _load(table, 1)
        engine.refuse_adapter = "out of adapter slots"
        with pytest.raises(
            InvalidArgument, match="adapter ns/r1/v2 refused by the fake engine: out of adapter slots"
        ):
            await _load(table, 2, seed=1)
        assert table.served("ns") == ("r1", 1) and _names(table) == ["ns/r1/v1"]
        engine.refuse_adapter = None
        await _load(table, 2, seed=1)
        assert table.current("ns").id == 3  # the refused load's id 2 is never given out again

    asyncio.run(main())


def test_lora_off_a_namespace_not_served_and_a_replaced_base_are_refused() -> None:
    async def main():
        off, _ = _table(FakeEngine(max_lora_rank=0))
        with pytest.raises(FailedPrecondition) as e:
            await _load(off, 1)
        assert str(e.value) == (
            "this replica takes no LoRA adapters: start it with --max-lora-rank 4 or more (the fake engine's "
            "max_lora_rank is 0)"
        )
        table, engine = _table(namespaces=("ns", "b"))
        await _load(table, 1)
        with pytest.raises(FailedPrecondition) as e:
            await _load(table, 1, ns="zz")
        assert str(e.value) == (
            "namespace 'zz' is not served by this replica (it serves ['ns', 'b']; add it with "
            "--lora-namespaces)"
        )
        with pytest.raises(FailedPrecondition, match="namespace 'zz' is not served"), table.use("zz"):
            pass
        # full weights replaced the base: every namespace back to them, and no adapter fits any more
        table.base_fingerprint = ""
        await table.drop_all()
        assert table.current("ns") is None and table.resident() == []
        with pytest.raises(FailedPrecondition, match="no longer serves its base model"):
            await _load(table, 2, seed=1)
        assert engine.adapter_calls == ["add ns/r1/v1", "remove ns/r1/v1"]

    asyncio.run(main())


def test_drop_namespace_sends_its_requests_back_to_the_base() -> None:
    async def main():
        table, engine = _table(namespaces=("a", "b"))
        await _load(table, 1, ns="a")
        await _load(table, 4, run="rb", ns="b")
        with table.use("a") as held:
            await table.drop_namespace("a")
            assert table.current("a") is None and table.served("a") is None
            assert [i.namespace for i in table.info()] == ["b"]
            assert held.name in _names(table)  # still sampling
            with table.use("a") as ref:
                assert ref is None
        for _ in range(3):
            await asyncio.sleep(0)
        assert _names(table) == ["b/rb/v4"] and engine.adapter_calls[-1] == "remove a/r1/v1"
        await _load(table, 0, run="r2", ns="a")  # a new run of the namespace starts over
        assert table.served("a") == ("r2", 0)

    asyncio.run(main())


def test_manifest_rules_are_checked_before_any_byte_arrives() -> None:
    """check_manifest is what PushWeights asks before receiving: every manifest-level refusal."""
    table, _ = _table()
    spec, tensors = _adapter(0)
    assert table.check_manifest(lh.adapter_manifest(spec, tensors, 1, "r1", "")) == "ns"
    with pytest.raises(InvalidArgument, match="adapter trained on base wfp1:other"):
        table.check_manifest(
            lh.adapter_manifest(dataclasses.replace(spec, base_fingerprint="wfp1:other"), tensors, 1)
        )
    with pytest.raises(InvalidArgument, match="the manifest has no adapter"):
        table.check_manifest(dataclasses.replace(lh.adapter_manifest(spec, tensors, 1), adapter=None))


def test_the_pipeline_puts_the_adapter_on_every_engine_request_and_record(tmp_path) -> None:
    """generation/pipeline.py: n samples all run with the adapter, records name it and its run (not the
    caller's run id), and a sample ended before its first token is an abort of the adapter's version."""
    import contextlib

    import numpy as np
    from grpc_fixtures import server_config

    from maskroll.proto.records import SamplingOptions
    from maskroll.server.engines.contract import AdapterRef
    from maskroll.server.generation.pipeline import Pipeline

    (tmp_path / "config.json").write_text("{}")
    engine = FakeEngine(max_lora_rank=8)
    engine._version = 9  # the full weights' version, which no adapter record may carry
    ref = AdapterRef("ns/run-b/v4", 1, 4, "ns", "run-b")
    engine.adapters[ref.id] = (ref, None)
    pipeline = Pipeline(engine, server_config(tmp_path))
    prompt, opts = np.array([1, 2, 3], np.int32), SamplingOptions(max_tokens=3, n=2, seed=5, logprobs_k=2)

    async def main():
        recs = await pipeline.prepare(prompt, opts, run_id="run-a", adapter=ref).records()
        plain = await pipeline.prepare(prompt, opts, run_id="run-a").records()
        gen = pipeline.prepare(prompt, opts, run_id="run-a", adapter=ref)
        gen.abort()
        async with contextlib.aclosing(gen.stream()) as chunks:
            aborted = [c.record async for c in chunks if c.record is not None]
        return recs, plain, aborted

    recs, plain, aborted = asyncio.run(main())
    assert [r.adapter for r in engine.requests[:2]] == [ref, ref] and engine.requests[2].adapter is None
    for rec in recs:
        assert (rec.adapter, rec.run_id, rec.policy_version_first, rec.policy_version_last) == (
            "ns/run-b/v4", "run-b", 4, 4,
        )  # fmt: skip
        assert rec.num_tokens == 3
    for rec in plain:
        assert (rec.adapter, rec.run_id, rec.policy_version_first) == ("", "run-a", 9)
    assert [(r.finish_reason, r.num_tokens, r.policy_version_first, r.adapter) for r in aborted] == [
        ("abort", 0, 4, "ns/run-b/v4")
    ] * 2
