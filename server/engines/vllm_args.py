"""The vLLM engine's configuration, translated both ways: maskroll's settings → vLLM engine arguments, and
vLLM's resolved config → the `EngineSettings` a replica reports. Pure: imports no vllm.

Owns: the engine arguments from EngineConfig's typed settings with their per-platform defaults (dtype,
tensor parallelism, KV cache sizing) and the arguments the mask contract fixes (processed logprobs, token
ids only); --vllm-arg NAME=VALUE values converted exactly as `vllm serve` converts them, given vLLM's own
argparse actions (which `vllm_engine` builds: it is the one module that imports vllm); the cache and IPC
directories vLLM reads from the environment; and the effective settings read back from a started engine.
What the running engine does with them is `vllm_engine`'s.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import CPU_KV_CACHE_GB, ConfigError, EngineConfig, vllm_arg_problem
from .contract import EngineSettings

# vLLM reads these when its modules load and when it spawns the engine-core process. The defaults
# (~/.cache/vllm, /tmp/torchinductor_$USER) are shared by every user and venv on the machine; keeping
# them under the environment that installed vLLM isolates replicas and test runs from each other.
_CACHE_ENV = {
    "VLLM_CACHE_ROOT": "vllm",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "VLLM_RPC_BASE_PATH": "rpc",
}


def default_cache_env(root: Path | None = None) -> dict[str, str]:
    """Set (if unset) and return vLLM's cache / IPC directories, by default under `sys.prefix`."""
    root = root or Path(sys.prefix) / "var" / "maskroll-vllm"
    out = {}
    for var, sub in _CACHE_ENV.items():
        path = os.environ.setdefault(var, str(root / sub))
        Path(path).mkdir(parents=True, exist_ok=True)
        out[var] = path
    return out


# ---- engine arguments ---------------------------------------------------------------------------------

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
_VLLM_ARG = "[--vllm-arg / MASKROLL_VLLM_ARGS]"
# Shim: the max_lora_rank values vLLM accepts (config/lora.py MaxLoRARanks); its LoRA kernels and the
# per-slot buffers are sized for one of these. tests/lora/test_vllm_lora.py checks it against vLLM's.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that is >= `rank` (a smaller adapter is zero-padded into
    the slot, so any rank up to it is served)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"max_lora_rank {rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")


def base_engine_args(
    model_dir: Path,
    config: EngineConfig,
    *,
    max_logprobs: int,
    max_batch: int,
    cuda: bool,
    gpu_count: int,
    max_lora_rank: int = 0,
    max_loras: int = 1,
    lora_modules: list[str] | None = None,
) -> dict[str, Any]:
    """AsyncEngineArgs keywords from the typed settings, defaults resolved for the platform (`cuda`:
    a CUDA-like device, `gpu_count` of them visible); LoRA on when `max_lora_rank` > 0, with
    `max_loras` adapters resident and, off CUDA, LoRA layers on `lora_modules` only (the base's Linear
    suffixes without embedding and head: `vllm_lora.lora_linear_suffixes`). Pure: no vllm import."""
    dtype = config.dtype if config.dtype != "auto" else "bfloat16" if cuda else "float32"
    tp = config.tensor_parallel_size
    if tp == "auto":
        tp = max(gpu_count, 1) if cuda else 1
    kv_gb = config.kv_cache_gb
    if kv_gb is None and config.gpu_memory_utilization is None and not cuda:
        kv_gb = CPU_KV_CACHE_GB
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "seed": config.seed,
        "max_model_len": config.max_model_len,
        "tensor_parallel_size": tp,
        "quantization": config.quantization,
        "enforce_eager": config.enforce_eager,
        "max_num_seqs": max_batch,
        "disable_log_stats": True,
        # The mask contract (never from --vllm-arg, config.MASK_CONTRACT_ARGS). μ must be the
        # distribution sampled from: after temperature, top-k and top-p (docs/math.md §6).
        "logprobs_mode": "processed_logprobs",
        # We exchange token ids only; no tokenizer is loaded and nothing is detokenised.
        "skip_tokenizer_init": True,
        "max_logprobs": max_logprobs,
    }
    if kv_gb is not None:
        args["kv_cache_memory_bytes"] = int(kv_gb * (1 << 30))
    if config.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.enable_prefix_caching is not None:  # unset: vLLM's default for the model
        args["enable_prefix_caching"] = config.enable_prefix_caching
    if max_lora_rank > 0:
        # max_loras is both the batch's adapter slots and vLLM's CPU-side cache: the adapter table keeps
        # at most max_loras resident, so vLLM's own LRU (worker_manager.py, capacity max_cpu_loras) never
        # evicts one behind its back.
        # Shim: off CUDA, vLLM's LoRA ops are plain torch (lora/ops/torch_ops/lora_ops.py bgmv_shrink /
        # bgmv_expand) and gather `weights[lora_indices]` with index -1 for a row without an adapter,
        # which is the LAST slot: a base row batched with adapter rows gets the last slot's adapter
        # added (prefill skips only a batch with no adapter at all, punica_cpu.py `no_lora`). One spare
        # slot that never holds an adapter (slots are taken first-free, model_manager.py
        # activate_adapter; the engine keeps at most max_loras resident) stays zero, so -1 adds nothing.
        # The CUDA kernels skip -1 (lora/ops/triton_ops/lora_shrink_op.py, lora_expand_op.py).
        slots = max_loras if cuda else max_loras + 1
        args.update(
            enable_lora=True,
            max_lora_rank=vllm_lora_rank(max_lora_rank),
            max_loras=slots,
            max_cpu_loras=slots,
        )
        if not cuda:
            # Shim: off CUDA, the output head's LoRA layer (lora/layers/logits_processor.py, through
            # punica_cpu.py add_lora_logits) gathers one adapter per *request* for a prompt-logprobs pass
            # that has one row per *prompt token*: a Score batched with any other request fails in
            # torch.einsum and kills the engine core. Naming the Linear modules (vLLM's
            # lora_target_modules) leaves the head and the embedding without LoRA layers, so an adapter
            # of those is refused when added, and scoring works.
            if not lora_modules:
                raise ValueError("a CPU vLLM engine with LoRA needs the base's Linear modules")
            args["lora_target_modules"] = list(lora_modules)
    return args


def _split_list(raw: str) -> list[str]:
    raw = raw.strip()
    if raw.startswith("["):
        return [v if isinstance(v, str) else json.dumps(v) for v in json.loads(raw)]
    return raw.replace(",", " ").split()


def _parse_one(raw: str, action: argparse.Action) -> Any:
    """One --vllm-arg value, converted as `vllm serve --name value` converts it (`action` is that
    option's argparse action)."""
    word = raw.strip().lower()
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if word not in _TRUE | _FALSE:
            raise ValueError(f"expected true or false, got {raw!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return word in _TRUE
        return action.const if word in _TRUE else action.default
    if action.nargs == "?" and action.const is True and word in _TRUE:  # a bool-or-string option
        return True
    convert = action.type or str
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        values = [convert(v) for v in _split_list(raw)]
        if isinstance(action.nargs, int) and len(values) != action.nargs:
            raise ValueError(f"expected {action.nargs} values, got {len(values)}")
        value: Any = values
    else:
        value = convert(raw)
        values = [value]
    bad = [v for v in values if action.choices is not None and v not in action.choices]
    if bad:
        raise ValueError(f"{bad[0]!r} is not one of {[c for c in action.choices if c is not None]}")
    return value


def convert_vllm_args(vllm_args: Mapping[str, str], actions: Mapping[str, argparse.Action]) -> dict[str, Any]:
    """--vllm-arg NAME=VALUE strings -> AsyncEngineArgs keywords, given `actions` (AsyncEngineArgs field
    -> the argparse action `vllm serve` parses it with). An unknown name, a name maskroll sets itself, or
    a value that does not convert is a ConfigError naming it."""
    out: dict[str, Any] = {}
    for name, raw in vllm_args.items():
        problem = vllm_arg_problem(name)
        if problem is None and name not in actions:
            near = difflib.get_close_matches(name, list(actions), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            problem = f"{name!r} is not a vLLM engine argument (AsyncEngineArgs, as `vllm serve` takes){hint}"
        if problem is not None:
            raise ConfigError(f"invalid configuration:\n  vllm_args: {problem} {_VLLM_ARG}")
        try:
            out[name] = _parse_one(raw, actions[name])
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise ConfigError(
                f"invalid configuration:\n  vllm_args: bad value {raw!r} for {name!r}: {e} {_VLLM_ARG}"
            ) from None
    return out


# ---- the settings in effect ---------------------------------------------------------------------------


def effective_settings(vllm_config: Any) -> EngineSettings:
    """What the started engine runs with, read back from vLLM's resolved config (after its defaults,
    the platform's overrides and the KV cache sizing), not from what was asked for. Shim: the frontend's
    copy of `num_gpu_blocks` is filled in by the engine-core handshake (v1/engine/core_client.py)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    fixed = int(cc.kv_cache_memory_bytes or 0)
    return EngineSettings(
        dtype=str(mc.dtype).removeprefix("torch."),
        seed=int(mc.seed or 0),
        max_batch=int(vllm_config.scheduler_config.max_num_seqs),
        tensor_parallel_size=int(vllm_config.parallel_config.tensor_parallel_size),
        quantization=str(mc.quantization or ""),
        prefix_caching=bool(cc.enable_prefix_caching),
        kv_cache_bytes=fixed,
        gpu_memory_utilization=0.0 if fixed else float(cc.gpu_memory_utilization),
        kv_cache_tokens=int(cc.num_gpu_blocks or 0) * int(cc.block_size or 0),
    )
