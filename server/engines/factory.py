"""make_engine: the engine a ServerConfig asks for, chosen once at start-up (STYLE.md §3).

The engine modules are imported here, lazily, so choosing torch never imports vllm (and the reverse);
`vllm_engine` stays the only module that imports vllm. Settings the torch engine cannot honour were
refused by ServerConfig already (EngineConfig.vllm_only).
"""

from __future__ import annotations

from ..config import ConfigError, ServerConfig
from .contract import Engine


def make_engine(config: ServerConfig) -> Engine:
    ec = config.engine_config
    if config.resolved_engine == "vllm":
        from .vllm_engine import VllmEngine

        return VllmEngine(
            config.model,
            max_logprobs=config.max_logprobs,
            max_batch=config.max_batch,
            config=ec,
            max_lora_rank=config.max_lora_rank,
            max_loras=config.max_loras,
        )
    import torch

    from .torch_engine import TorchEngine

    # The torch engine runs on the CPU, where dtype auto is float32 (as for vLLM on CPU, so the two
    # engines' logprobs are comparable).
    dtype = getattr(torch, "float32" if ec.dtype == "auto" else ec.dtype)
    try:
        return TorchEngine(
            config.model,
            max_logprobs=config.max_logprobs,
            max_batch=config.max_batch,
            threads=config.threads,
            dtype=dtype,
            max_model_len=ec.max_model_len,
            seed=ec.seed,
            max_lora_rank=config.max_lora_rank,
            max_loras=config.max_loras,
        )
    except ValueError as e:  # a setting the model cannot take (a context longer than its own)
        raise ConfigError(f"invalid configuration:\n  {e}") from e
