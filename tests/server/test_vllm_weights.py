"""The vLLM engine's weight deltas (server/engines/vllm_weights.py, VllmEngine.apply_weight_patches).

Without vLLM: a delta checked on the served checkpoint and written as the new version's, in the engine's
dtype (a float32 checkpoint served as bfloat16: the cast rounds to nearest even, worked by hand below);
every way a delta can be wrong is refused naming the tensor, and its directory is gone; the reload groups;
the NCCL broadcast's layout check.

With vLLM (the session's shared engine, float32 on this CPU): a delta, and a delta on that delta, serve
bit for bit what a full update to the same weights serves (sampled tokens and logprobs for a seed, and
vLLM's own weight checksums); a wrong digest or a failure in the workers changes nothing that serves. The
engine's weights are restored afterwards.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm_fixtures import server_loop, vllm_engine  # noqa: F401  (fixtures)

from maskroll.proto.tensor_push import digest_of
from maskroll.server.engines import vllm_weights
from maskroll.server.engines.contract import EngineSettings, WeightPatch
from maskroll.server.weights.stream import SPOOL_ENV

LABEL = "the delta of version 1"


def raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: digest_of(raw(t)) for name, t in tensors.items()}


def sparse(name: str, new: torch.Tensor, indices: list[int]) -> WeightPatch:
    idx = torch.tensor(indices, dtype=torch.int32)
    return WeightPatch(name, tuple(new.shape), new.reshape(-1)[idx.long()].clone(), idx)


def dense(name: str, new: torch.Tensor) -> WeightPatch:
    return WeightPatch(name, tuple(new.shape), new.reshape(-1).clone())


def spool_dirs(spool: Path) -> list[Path]:
    return sorted(spool.glob("delta-v*"))


# ---- without vLLM -----------------------------------------------------------------------------------

# 1 + 2**-8 lies halfway between bfloat16's 1 and 1 + 2**-7: to even, 1. 1 + 3 * 2**-8 lies halfway
# between 1 + 2**-7 (odd last mantissa bit) and 1 + 2**-6 (even): 1.015625.
HALF_DOWN, HALF_UP = 1 + 2**-8, 1 + 3 * 2**-8


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A float32 checkpoint in two files, with an integer tensor (kept as stored, never cast)."""
    d = tmp_path / "base"
    d.mkdir()
    q = torch.full((4, 3), HALF_DOWN)
    q[0, 1] = HALF_UP
    save_file(
        {
            "model.layers.0.self_attn.q_proj.weight": q,
            "model.layers.0.self_attn.k_proj.weight": torch.arange(12.0).reshape(4, 3),
            "model.layers.1.mlp.up_proj.weight": torch.ones(2, 3),
            "model.layers.1.positions": torch.arange(2),  # int64
        },
        str(d / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"model.norm.weight": torch.ones(3), "lm_head.weight": torch.zeros(5, 3)},
        str(d / "model-00002-of-00002.safetensors"),
    )
    return d


def served(base: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(base.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


def v1(base: Path, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[WeightPatch]]:
    """The next version: two elements of q_proj changed (sparse), lm_head sent whole (dense)."""
    new = served(base, dtype)
    q = new["model.layers.0.self_attn.q_proj.weight"]
    q.view(-1)[[2, 7]] = torch.tensor([0.5, -3.0], dtype=dtype)
    new["lm_head.weight"] = torch.full((5, 3), 0.25, dtype=dtype)
    patches = [
        sparse("model.layers.0.self_attn.q_proj.weight", q, [2, 7]),
        dense("lm_head.weight", new["lm_head.weight"]),
    ]
    return new, patches


def test_the_cast_rounds_to_nearest_even_as_worked_by_hand(base: Path) -> None:
    q = served(base, torch.bfloat16)["model.layers.0.self_attn.q_proj.weight"]
    assert q[0, 0].item() == 1.0 and q[0, 1].item() == 1.015625


def test_a_delta_is_written_in_the_engines_dtype_with_its_reload_groups(base: Path, tmp_path: Path) -> None:
    new, patches = v1(base, torch.bfloat16)
    out = tmp_path / "out"
    out.mkdir()
    names = vllm_weights.write_delta(base, patches, digests(new), "bfloat16", out, LABEL)
    # layer 0 whole (q_proj is fused with k_proj in vLLM), lm_head; nothing of layer 1 nor the norm
    assert sorted(names) == [
        "lm_head.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ]
    written = load_file(str(out / vllm_weights.FILE_NAME))
    assert written.keys() == new.keys()
    for name, t in new.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), name
    q = written["model.layers.0.self_attn.q_proj.weight"].view(-1)
    assert q.tolist()[:8] == [1.0, 1.015625, 0.5, 1.0, 1.0, 1.0, 1.0, -3.0]
    assert written["model.layers.1.positions"].dtype == torch.int64


def test_the_reload_group_is_the_decoder_layer_else_the_module() -> None:
    group = vllm_weights.reload_group
    assert group("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert group("model.layers.3.mlp.experts.7.up_proj.weight") == "model.layers.3"
    assert group("transformer.h.0.attn.c_attn.weight") == "transformer.h.0"
    assert group("model.layers_norm.weight") == "model.layers_norm"  # not a layer index
    assert group("model.embed_tokens.weight") == "model.embed_tokens"
    assert group("lm_head.weight") == "lm_head"


# Each refusal: a mutation (the next version, its good patches) -> (patches, digests), and the message.


def _flip(new, patches):
    d = digests(new)
    t = new["model.norm.weight"].clone()
    t[1] = 2.0  # a value the patches do not make: the result would not match
    d["model.norm.weight"] = digest_of(raw(t))
    return patches, d


def _patch(i: int, fn):
    def mutate(new, patches):
        p = patches[i]
        patches[i] = replace(p, **fn(p))
        return patches, digests(new)

    return mutate


def _digests(fn):
    def mutate(new, patches):
        d = digests(new)
        fn(d)
        return patches, d

    return mutate


Q, HEAD = "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"
REFUSALS = {
    "a wrong digest": (_flip, "'model.norm.weight' would be"),
    "an unknown name": (
        _digests(lambda d: d.update({"model.extra.weight": "0" * 16})),
        "'model.extra.weight'",
    ),
    "a missing digest": (_digests(lambda d: d.pop("model.norm.weight")), "'model.norm.weight' has no digest"),
    "a patch of no tensor": (
        _patch(0, lambda p: {"name": "model.layers.9.q.weight"}),
        "'model.layers.9.q.weight' is for a tensor",
    ),
    "two patches of one tensor": (lambda n, p: ([p[0], p[0], p[1]], digests(n)), f"{Q!r} has two patches"),
    "float32 values": (_patch(0, lambda p: {"values": p.values.float()}), f"{Q!r} has torch.float32 values"),
    "an index out of range": (
        _patch(0, lambda p: {"indices": torch.tensor([2, 12], dtype=torch.int32)}),
        f"{Q!r}: its indices are not strictly increasing within [0, 12)",
    ),
    "a repeated index": (
        _patch(0, lambda p: {"indices": torch.tensor([7, 7], dtype=torch.int32)}),
        "not strictly increasing",
    ),
    "decreasing indices": (
        _patch(0, lambda p: {"indices": torch.tensor([7, 2], dtype=torch.int64)}),
        "not strictly increasing",
    ),
    "float indices": (_patch(0, lambda p: {"indices": p.indices.float()}), "1-D int32 or int64"),
    "a NaN value": (
        _patch(0, lambda p: {"values": torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16)}),
        f"{Q!r} has 1 non-finite values",
    ),
    "another shape": (_patch(1, lambda p: {"shape": (3, 5)}), f"{HEAD!r} is for shape [3, 5]"),
    "a short dense patch": (
        _patch(1, lambda p: {"values": p.values[:-1]}),
        f"{HEAD!r} is dense with 14 values for 15",
    ),
    "indices without values": (
        _patch(0, lambda p: {"values": p.values[:1]}),
        f"{Q!r} has 2 indices for 1 values",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_delta_is_refused_naming_the_tensor_and_leaves_no_file(
    case: str, base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "spool"
    monkeypatch.setenv(SPOOL_ENV, str(spool))
    mutate, needle = REFUSALS[case]
    new, patches = v1(base, torch.bfloat16)
    patches, d = mutate(new, list(patches))
    settings = EngineSettings(dtype="bfloat16")
    with pytest.raises(ValueError, match="^" + LABEL) as e:
        asyncio.run(vllm_weights.checked_delta(base, settings, None, 1, patches, d, LABEL))
    assert needle in str(e.value)
    assert spool_dirs(spool) == []


def test_a_good_delta_leaves_its_file_in_the_spool(base: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))
    new, patches = v1(base, torch.float32)
    settings = EngineSettings(dtype="float32")
    delta = vllm_weights.checked_delta(base, settings, None, 7, patches, digests(new), LABEL)
    path, names = asyncio.run(delta)
    assert path.parent.name.startswith("delta-v7-") and spool_dirs(tmp_path / "spool") == [path.parent]
    assert digests(load_file(str(path))) == digests(new) and len(names) == 3


def test_a_tied_head_sent_once_is_left_out_of_the_file_and_fed_the_embedding(tmp_path, monkeypatch):
    """A model whose config ties the head to the embedding (SmolLM2) stores both; the trainer sends the
    shared tensor once, under the embedding's name. The head is left out of the new file, and the workers'
    reload feeds it the embedding (`tied_aliases`): on CPU vLLM keeps the head's own packed copy, which a
    reload without it left on the old weights (bench/vllm_tied_delta.py)."""
    import json

    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))
    d = tmp_path / "tied"
    d.mkdir()
    emb = torch.arange(15.0).reshape(5, 3)
    norm = torch.ones(3)
    save_file(
        {"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone(), "model.norm.weight": norm},
        str(d / "model.safetensors"),
    )
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    new = {"model.embed_tokens.weight": emb.clone(), "model.norm.weight": norm.clone()}
    settings = EngineSettings(dtype="float32")
    # only the norm: the layers it touches
    new["model.norm.weight"][0] = 2.0
    patches = [sparse("model.norm.weight", new["model.norm.weight"], [0])]
    path, names = asyncio.run(vllm_weights.checked_delta(d, settings, d, 1, patches, digests(new), LABEL))
    assert sorted(load_file(str(path))) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert names == ["model.norm.weight"]
    # the embedding, on that version's file (which has no head): its module, the head fed from it
    new["model.embed_tokens.weight"][1, 2] = -1.0
    patches = [sparse("model.embed_tokens.weight", new["model.embed_tokens.weight"], [5])]
    v1_file = path.parent
    path, names = asyncio.run(
        vllm_weights.checked_delta(v1_file, settings, d, 2, patches, digests(new), LABEL)
    )
    assert names == ["model.embed_tokens.weight"] and digests(load_file(str(path))) == digests(new)
    assert vllm_weights.tied_aliases(d) == {"lm_head.weight": "model.embed_tokens.weight"}
    # untied (no config saying otherwise), the head is a tensor of its own: its digest is needed
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    with pytest.raises(ValueError, match=r"'lm_head\.weight' has no digest"):
        asyncio.run(vllm_weights.checked_delta(d, settings, d, 3, [], digests(new), LABEL))


def test_no_delta_without_a_checkpoint_or_on_a_quantized_model(base: Path) -> None:
    new, patches = v1(base, torch.float32)
    with pytest.raises(ValueError, match="came over NCCL"):
        asyncio.run(vllm_weights.checked_delta(None, EngineSettings("float32"), None, 1, patches, {}, LABEL))
    fp8 = EngineSettings("bfloat16", quantization="fp8")
    with pytest.raises(ValueError, match="fp8 model"):
        asyncio.run(vllm_weights.checked_delta(base, fp8, None, 1, patches, digests(new), LABEL))


def test_a_broadcast_is_checked_against_the_served_model(base: Path) -> None:
    from maskroll.proto.tensor_push import TensorSpec

    ok = [
        TensorSpec("model.norm.weight", "float32", (3,), 12),
        TensorSpec("lm_head.weight", "float32", (5, 3), 60),
    ]
    assert vllm_weights.broadcast_update_info(ok, base) == {
        "names": ["model.norm.weight", "lm_head.weight"],
        "dtype_names": ["float32", "float32"],
        "shapes": [[3], [5, 3]],
    }
    with pytest.raises(ValueError, match=r"wrong shape \[\('lm_head.weight', \(3, 5\), \(5, 3\)\)\]"):
        vllm_weights.broadcast_update_info([TensorSpec("lm_head.weight", "float32", (3, 5), 60)], base)


# ---- with vLLM (the session's engine) ---------------------------------------------------------------

vllm_test = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = [256, 84, 104, 101, 32, 113, 117]
PARAMS = {"max_tokens": 16, "temperature": 1.0, "logprobs_k": 5, "seed": 11}
_ids = iter(range(10**9))


async def _sample(engine) -> tuple[np.ndarray, ...]:
    """(tokens, sampled logprobs, top-K logprobs, versions) of one seeded sample."""
    from maskroll.server.engines.contract import EngineRequest, SamplingParams

    request = EngineRequest(f"delta-{next(_ids)}", np.asarray(PROMPT, np.int32), SamplingParams(**PARAMS))
    outs = [o async for o in engine.generate(request)]
    versions = np.concatenate([np.full(len(o.token_ids), o.policy_version) for o in outs])
    return (
        *(np.concatenate([getattr(o, f) for o in outs]) for f in ("token_ids", "sampled_logprobs")),
        np.concatenate([o.topk_logprobs for o in outs]),
        versions,
    )


def same(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> bool:
    """Bit for bit: tokens, sampled and top-K logprobs (the versions are compared apart)."""
    return all(np.array_equal(x, y) for x, y in zip(a[:3], b[:3], strict=True))


@pytest.fixture
def rig(server_loop, vllm_engine, tiny_model_dir: Path, tmp_path: Path, monkeypatch):  # noqa: F811
    """(run a coroutine on the engine's loop, the engine, the spool); the served weights and the version
    label restored after (the other vLLM tests count versions from the one they start at, 0)."""
    spool = tmp_path / "spool"
    monkeypatch.setenv(SPOOL_ENV, str(spool))
    # the deltas below are made on the tiny model's checkpoint: it must be the served one
    assert Path(vllm_engine._weights_dir).resolve() == tiny_model_dir.resolve()

    def run(coro, timeout: float = 300.0):
        return server_loop.run(coro, timeout)

    v0 = vllm_engine.policy_version
    yield run, vllm_engine, spool
    run(vllm_engine.update_weights(v0, tiny_model_dir))
    assert vllm_engine._delta_dir is None


def next_version(base: dict[str, torch.Tensor], changes: dict[str, list[int]], whole: list[str], seed: int):
    """(tensors, patches): `changes` elements of each tensor moved by a random amount (sparse patches),
    the tensors `whole` scaled (dense patches); everything else as in `base`."""
    g = torch.Generator().manual_seed(seed)
    new = {n: t.clone() for n, t in base.items()}
    patches = []
    for name, idx in changes.items():
        flat = new[name].view(-1)
        flat[idx] += torch.randn(len(idx), generator=g, dtype=flat.dtype)
        patches.append(sparse(name, new[name], idx))
    for name in whole:
        new[name].mul_(1.5)
        patches.append(dense(name, new[name]))
    return new, patches


def written_dir(tmp_path: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    d = tmp_path / name
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    return d


async def _checksums(engine) -> list[dict[str, str]]:
    return await engine._llm.compute_weight_checksums()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_delta_and_a_delta_on_it_serve_bit_for_bit_what_full_updates_serve(rig, tiny_model_dir, tmp_path):
    """v1: two elements of layer 0's q_proj (fused into qkv_proj) and of the embeddings, lm_head whole;
    v2, on v1's file: layer 1's up_proj (fused into gate_up_proj) and the final norm whole. Each delta,
    then the same version loaded whole, must sample the same tokens with the same logprobs, bit for bit,
    and give the same vLLM weight checksums; the delta's file is the served one until replaced."""
    run, engine, spool = rig
    dtype = getattr(torch, engine.settings.dtype)
    v0 = engine.policy_version
    base = served(tiny_model_dir, dtype)
    t1, p1 = next_version(
        base,
        {
            "model.layers.0.self_attn.q_proj.weight": [5, 700],
            "model.embed_tokens.weight": [999, 128 * 84 + 3],
        },
        ["lm_head.weight"],
        seed=1,
    )
    t2, p2 = next_version(
        t1, {"model.layers.1.mlp.up_proj.weight": [0, 4000, 65535]}, ["model.norm.weight"], 2
    )
    before = run(_sample(engine))

    assert run(engine.apply_weight_patches(v0 + 1, p1, digests(t1), LABEL)) == 0
    delta1, sums1 = run(_sample(engine)), run(_checksums(engine))
    assert engine.policy_version == v0 + 1 and np.all(delta1[3] == v0 + 1)
    assert not same(delta1, before), "the delta changed nothing: the comparison below would be vacuous"
    (file1,) = spool_dirs(spool)
    assert digests(load_file(str(file1 / "model.safetensors"))) == digests(t1)

    assert run(engine.apply_weight_patches(v0 + 2, p2, digests(t2), "the delta of version 2")) == 0
    delta2, sums2 = run(_sample(engine)), run(_checksums(engine))
    (file2,) = spool_dirs(spool)  # v1's file went when v2 served
    assert file2 != file1 and digests(load_file(str(file2 / "model.safetensors"))) == digests(t2)

    assert run(engine.update_weights(v0 + 3, written_dir(tmp_path, "v1", t1))) == 0
    assert spool_dirs(spool) == [], "a full update did not delete the delta's file"
    full1, full_sums1 = run(_sample(engine)), run(_checksums(engine))
    assert run(engine.update_weights(v0 + 4, written_dir(tmp_path, "v2", t2))) == 0
    full2, full_sums2 = run(_sample(engine)), run(_checksums(engine))

    assert same(delta1, full1) and same(delta2, full2)
    assert sums1 == full_sums1 and sums2 == full_sums2
    assert sums1 != sums2 and not same(delta1, delta2)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_wrong_digest_is_refused_and_the_old_version_serves_on(rig, tiny_model_dir):
    run, engine, spool = rig
    dtype = getattr(torch, engine.settings.dtype)
    v0, before = engine.policy_version, run(_sample(engine))
    new, patches = next_version(
        served(tiny_model_dir, dtype), {"model.layers.1.self_attn.v_proj.weight": [9]}, [], 3
    )
    wrong = digests(new)
    flipped = new["model.layers.1.self_attn.v_proj.weight"].clone()
    flipped.view(-1)[10] += 1  # one value off, as a patch applied on other weights would leave it
    wrong["model.layers.1.self_attn.v_proj.weight"] = digest_of(raw(flipped))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.v_proj\.weight' would be"):
        run(engine.apply_weight_patches(v0 + 1, patches, wrong, LABEL))
    after = run(_sample(engine))
    assert engine.policy_version == v0 and np.all(after[3] == v0) and same(after, before)
    assert spool_dirs(spool) == []
    # the next valid delta serves
    assert run(engine.apply_weight_patches(v0 + 1, patches, digests(new), LABEL)) == 0
    served_now = run(_sample(engine))
    assert (
        engine.policy_version == v0 + 1 and np.all(served_now[3] == v0 + 1) and not same(served_now, before)
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_a_failure_in_the_workers_restores_the_weights_that_served(rig, tiny_model_dir, monkeypatch):
    """The delta checked out, then the workers failed (simulated: a method they lack): the live model may
    be half-updated, so the engine reloads the checkpoint that served, keeps its version, deletes the file."""
    run, engine, spool = rig
    dtype = getattr(torch, engine.settings.dtype)
    v0, before = engine.policy_version, run(_sample(engine))
    new, patches = next_version(
        served(tiny_model_dir, dtype), {"model.layers.0.mlp.down_proj.weight": [1]}, [], 4
    )
    reload = engine._reload

    async def workers_fail(directory, names=None):  # the delta's reload fails in the workers, not the restore
        if names is None:
            return await reload(directory, names)
        await engine._llm.collective_rpc("maskroll_no_such_method", kwargs={})

    monkeypatch.setattr(engine, "_reload", workers_fail)
    with pytest.raises(Exception, match="maskroll_no_such_method"):
        run(engine.apply_weight_patches(v0 + 1, patches, digests(new), LABEL))
    assert engine.failure() is None and engine.policy_version == v0
    assert spool_dirs(spool) == [] and same(run(_sample(engine)), before)
