"""make_engine: the engine a ServerConfig asks for, chosen once at start-up (STYLE.md §3).

The engine modules are imported here, lazily, so choosing torch never imports vllm (and the reverse);
`vllm_engine` stays the only module that imports vllm.
"""

from __future__ import annotations

from .config import ServerConfig
from .engine import Engine


def make_engine(config: ServerConfig) -> Engine:
    # dtype "auto" passes nothing: each engine keeps its own default (float32 for both today, so the
    # two engines' logprobs are comparable).
    if config.resolved_engine == "vllm":
        from .vllm_engine import VllmEngine

        dtype = {} if config.dtype == "auto" else {"dtype": config.dtype}
        return VllmEngine(
            config.model,
            max_logprobs=config.max_logprobs,
            enforce_eager=config.enforce_eager,
            extra_engine_args={"max_num_seqs": config.max_batch},
            **dtype,
        )
    import torch

    from .torch_engine import TorchEngine

    dtype = {} if config.dtype == "auto" else {"dtype": getattr(torch, config.dtype)}
    return TorchEngine(
        config.model,
        max_logprobs=config.max_logprobs,
        max_batch=config.max_batch,
        threads=config.threads,
        **dtype,
    )
