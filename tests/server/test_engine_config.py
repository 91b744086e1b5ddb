"""From EngineConfig to the engine: vLLM's engine arguments per platform (no engine started), --vllm-arg
values parsed as `vllm serve` parses them and refused with their names, and the torch engine honouring
the settings that apply to it (context length, seed, dtype)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from maskroll.server.config import ConfigError, EngineConfig, ServerConfig
from maskroll.server.engines.contract import EngineRequest, SamplingParams

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
GIB = 1 << 30
MODEL = Path("/models/m")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("MASKROLL_"):
            monkeypatch.delenv(key)


def base(config: EngineConfig, *, cuda: bool, gpus: int = 0) -> dict:
    from maskroll.server.engines.vllm_args import base_engine_args

    return base_engine_args(MODEL, config, max_logprobs=20, max_batch=32, cuda=cuda, gpu_count=gpus)


# ---- the typed settings, per platform (pure: no vllm import) -------------------------------------------


def test_cpu_defaults_are_float32_and_a_fixed_1_gib_kv_cache():
    args = base(EngineConfig(), cuda=False)
    assert args["dtype"] == "float32" and args["kv_cache_memory_bytes"] == GIB
    assert "gpu_memory_utilization" not in args and "enable_prefix_caching" not in args
    assert (args["tensor_parallel_size"], args["seed"], args["max_model_len"], args["max_num_seqs"]) == (
        1,
        0,
        None,
        32,
    )
    # The mask contract, whatever the settings.
    assert (args["logprobs_mode"], args["skip_tokenizer_init"], args["max_logprobs"]) == (
        "processed_logprobs",
        True,
        20,
    )


def test_cuda_defaults_are_bfloat16_sized_by_memory_utilisation_and_auto_tp_is_the_gpu_count():
    args = base(EngineConfig(tensor_parallel_size="auto"), cuda=True, gpus=4)
    assert args["dtype"] == "bfloat16" and args["tensor_parallel_size"] == 4
    # No fixed size and no utilisation given: vLLM's own default fraction sizes the KV cache.
    assert "kv_cache_memory_bytes" not in args and "gpu_memory_utilization" not in args
    assert base(EngineConfig(tensor_parallel_size="auto"), cuda=False)["tensor_parallel_size"] == 1


def test_explicit_settings_reach_the_engine_arguments():
    config = EngineConfig(
        dtype="float16",
        max_model_len=256,
        seed=11,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.8,
        enable_prefix_caching=False,
        quantization="fp8",
        enforce_eager=True,
    )
    args = base(config, cuda=True, gpus=8)
    assert {k: args[k] for k in ("dtype", "max_model_len", "seed", "tensor_parallel_size")} == {
        "dtype": "float16",
        "max_model_len": 256,
        "seed": 11,
        "tensor_parallel_size": 2,
    }
    assert (args["gpu_memory_utilization"], args["enable_prefix_caching"], args["quantization"]) == (
        0.8,
        False,
        "fp8",
    )
    assert args["enforce_eager"] is True and "kv_cache_memory_bytes" not in args
    # A fixed KV cache size on CUDA, and utilisation on CPU (a fraction of RAM there).
    assert base(EngineConfig(kv_cache_gb=2.5), cuda=True)["kv_cache_memory_bytes"] == int(2.5 * GIB)
    cpu = base(EngineConfig(gpu_memory_utilization=0.3), cuda=False)
    assert cpu["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in cpu


# ---- --vllm-arg, against vLLM's own AsyncEngineArgs ---------------------------------------------------


@needs_vllm
def test_pass_through_values_are_parsed_as_vllm_serve_parses_them():
    from maskroll.server.engines.vllm_engine import parse_vllm_args

    got = parse_vllm_args(
        {
            "max_num_batched_tokens": "8k",  # human-readable, decimal k
            "enable_chunked_prefill": "false",  # --no-enable-chunked-prefill
            "cudagraph_capture_sizes": "1,2,4",  # nargs='+'
            "hf_overrides": '{"rope_theta": 20000}',  # JSON
            "kv_cache_dtype": "fp8",  # a choice
            "block_size": "32",
            "disable_log_stats": "true",  # no setting of its own, so it may replace maskroll's default
        }
    )
    assert got == {
        "max_num_batched_tokens": 8000,
        "enable_chunked_prefill": False,
        "cudagraph_capture_sizes": [1, 2, 4],
        "hf_overrides": {"rope_theta": 20000},
        "kv_cache_dtype": "fp8",
        "block_size": 32,
        "disable_log_stats": True,
    }


@needs_vllm
def test_pass_through_reaches_async_engine_args():
    from vllm.engine.arg_utils import AsyncEngineArgs

    from maskroll.server.engines.vllm_engine import engine_args

    config = EngineConfig(max_model_len=256, seed=3, vllm_args={"max_num_batched_tokens": "512"})
    args, passed = engine_args(MODEL, config, max_logprobs=20, max_batch=8)
    assert isinstance(args, AsyncEngineArgs) and passed == ["max_num_batched_tokens"]
    assert (args.max_num_batched_tokens, args.max_model_len, args.seed, args.max_num_seqs) == (512, 256, 3, 8)
    assert (args.dtype, args.kv_cache_memory_bytes) == ("float32", GIB)  # this CPU machine's defaults
    assert (args.logprobs_mode, args.skip_tokenizer_init, args.max_logprobs) == (
        "processed_logprobs",
        True,
        20,
    )


@needs_vllm
@pytest.mark.parametrize(
    ("vllm_args", "needles"),
    [
        ({"max_num_batched_token": "1"}, ["'max_num_batched_token' is not a vLLM engine argument",
                                          "did you mean max_num_batched_tokens"]),
        ({"tokens_only": "true"}, ["'tokens_only' is not a vLLM engine argument"]),  # no CLI form
        ({"block_size": "big"}, ["bad value 'big' for 'block_size'"]),
        ({"kv_cache_dtype": "fp7"}, ["bad value 'fp7' for 'kv_cache_dtype'", "'fp7' is not one of"]),
        ({"enable_chunked_prefill": "maybe"}, ["bad value 'maybe' for 'enable_chunked_prefill'"]),
        ({"hf_overrides": "{oops}"}, ["bad value '{oops}' for 'hf_overrides'"]),
        ({"logprobs_mode": "raw_logprobs"}, ["'logprobs_mode' is fixed by maskroll"]),
        ({"skip_tokenizer_init": "false"}, ["'skip_tokenizer_init' is fixed by maskroll"]),
        ({"max_logprobs": "100"}, ["'max_logprobs' is fixed by maskroll"]),
        ({"seed": "1"}, ["'seed' has its own setting: use --seed"]),
    ],
)  # fmt: skip
def test_unknown_forbidden_and_bad_pass_through_args_are_refused_by_name(vllm_args, needles):
    """Checked again in the engine module: an EngineConfig built without validation (model_construct)
    must not get the mask-contract names past it either."""
    from maskroll.server.engines.vllm_engine import parse_vllm_args

    with pytest.raises(ConfigError) as err:
        parse_vllm_args(vllm_args)
    for needle in needles:
        assert needle in str(err.value)
    assert "[--vllm-arg / MASKROLL_VLLM_ARGS]" in str(err.value)


# ---- the torch engine honours what applies ------------------------------------------------------------


def _torch_engine(model_dir: Path, **engine_config):
    from maskroll.server.engines.factory import make_engine

    config = ServerConfig(model=model_dir, engine="torch", engine_config=EngineConfig(**engine_config))
    return make_engine(config)


async def _tokens(engine, rid: str, **params) -> np.ndarray:
    req = EngineRequest(rid, np.asarray([256, 72, 105], np.int32), SamplingParams(**params))
    return np.concatenate([o.token_ids async for o in engine.generate(req)])


def _unseeded_samples(model_dir: Path, seed: int) -> list[np.ndarray]:
    async def main():
        engine = _torch_engine(model_dir, seed=seed)
        await engine.start()
        try:
            return [await _tokens(engine, f"r{i}", max_tokens=12) for i in range(2)]
        finally:
            await engine.close()

    return asyncio.run(main())


def test_torch_engine_max_model_len_dtype_and_settings(tiny_model_dir):
    engine = _torch_engine(tiny_model_dir, max_model_len=128, seed=7)
    assert engine.limits.max_model_len == 128  # the model's own is 1024
    s = engine.settings
    assert (s.dtype, s.seed, s.max_batch, s.tensor_parallel_size, s.kv_cache_tokens) == (
        "float32",
        7,
        64,
        1,
        0,
    )
    assert _torch_engine(tiny_model_dir, dtype="bfloat16").settings.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"max_model_len=2048 must be in \[2, 1024\]"):
        _torch_engine(tiny_model_dir, max_model_len=2048)


def test_torch_engine_context_ends_at_max_model_len(tiny_model_dir):
    async def main():
        engine = _torch_engine(tiny_model_dir, max_model_len=16)
        await engine.start()
        try:
            return await _tokens(engine, "long", max_tokens=100, seed=1)
        finally:
            await engine.close()

    assert len(asyncio.run(main())) == 16 - 3  # prompt of 3: the context holds 13 more tokens


def test_torch_engine_seed_fixes_requests_without_a_seed(tiny_model_dir):
    first, again, other = (_unseeded_samples(tiny_model_dir, s) for s in (5, 5, 6))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))  # restart, same seed
    assert not np.array_equal(first[0], first[1])  # two requests draw two seeds
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))
