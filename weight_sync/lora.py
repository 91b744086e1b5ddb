"""A trainer's LoRA adapter (PEFT) as the replicas take it: wire names, the base it was trained on, the
merge, PEFT's directory layout on disk, and resume.

The replicas apply `y = x W^T + scale · (x A^T) B^T` per targeted Linear, scale = alpha / rank (PEFT's
default: no rsLoRA, no DoRA, no bias), from tensors named `<module>.lora_A.weight` [r, in] and
`<module>.lora_B.weight` [out, r], `<module>` being the Linear's name in the base's Hugging Face state dict
without `.weight` (`proto.tensor_push.AdapterSpec`, docs/lora.md). On the trainer PEFT names them
`base_model.model.<module>.lora_A.default.weight`; on disk (`adapter_model.safetensors`) and in vLLM
`base_model.model.<module>.lora_A.weight`. What the replicas cannot apply is refused here, at the trainer,
with the option to change, rather than published and refused by every replica (or, worse, applied
differently from what was trained).

Only the adapter named "default" (what `peft.get_peft_model` creates, and TRL) is published. peft is
imported lazily: a model can only be a PeftModel when peft is already loaded. Knows nothing of queues or
replicas.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from maskroll.proto.tensor_push import LORA_A, LORA_B, AdapterSpec

from .model_fingerprint import model_fingerprint

ADAPTER = "default"  # the PEFT adapter that is published: get_peft_model's (and TRL's) only one
PEFT_PREFIX = "base_model.model."  # PEFT's names of the wrapped model's modules, on the trainer and on disk
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FINGERPRINT_KEY = "maskroll_base_fingerprint"  # in the safetensors metadata: PEFT ignores it there

__all__ = [
    "ADAPTER",
    "LoraUnsupported",
    "adapter_of",
    "base_fingerprint",
    "is_lora",
    "load_adapter",
    "load_into",
    "merge",
    "refuse_lora",
    "save_adapter",
]


class LoraUnsupported(ValueError):
    """The PEFT model uses an option the replicas do not apply; the message names it."""


def _unwrap(model):
    """The module inside a DistributedDataParallel wrapper (DDP's `.module`), else `model`."""
    inner = getattr(model, "module", None)
    if isinstance(inner, torch.nn.Module) and type(model).__name__ == "DistributedDataParallel":
        return inner
    return model


def is_lora(model) -> bool:
    """`model` is a PEFT model with LoRA adapters (possibly inside DDP). False without importing peft
    when it was never loaded (a model cannot be a PeftModel then)."""
    peft = sys.modules.get("peft")
    if peft is None:
        return False
    model = _unwrap(model)
    if not isinstance(model, peft.PeftModel):
        return False
    config = model.peft_config.get(ADAPTER)
    return config is not None and str(getattr(config.peft_type, "value", config.peft_type)) == "LORA"


def refuse_lora(model, transport: str) -> None:
    """Raise LoraUnsupported if `model` is a PEFT LoRA model: `transport` publishes full weights only."""
    if is_lora(model):
        raise LoraUnsupported(
            f"the {transport} transport publishes full weights; this is a PEFT LoRA model, whose adapter "
            "the replicas apply on their base: LoRA runs publish with the stream transport "
            "(make_publisher('stream', ...))"
        )


def _peft_model(model):
    model = _unwrap(model)
    if not is_lora(model):
        raise TypeError(
            f"{type(model).__name__} is not a PEFT LoRA model (peft.get_peft_model(model, LoraConfig(...)))"
        )
    return model


def _check_config(model) -> None:
    """Refuse, by option name, what the replicas do not apply (the per-layer check below catches the rest)."""
    if model.active_adapter != ADAPTER:
        raise LoraUnsupported(
            f"the active PEFT adapter is {model.active_adapter!r}: only the adapter {ADAPTER!r} is published "
            "(one adapter per run)"
        )
    config = model.peft_config[ADAPTER]
    refused = {
        "use_dora": "DoRA (use_dora=True) adds a magnitude vector the replicas do not apply",
        "use_rslora": "rsLoRA (use_rslora=True) scales by alpha/sqrt(r); the replicas scale by alpha/r",
        "modules_to_save": "modules_to_save trains full copies of modules, which the replicas cannot load "
        "as an adapter",
        "rank_pattern": "rank_pattern gives modules their own rank; an adapter has one rank",
        "alpha_pattern": "alpha_pattern gives modules their own alpha; an adapter has one alpha",
        "lora_bias": "lora_bias=True trains a bias on lora_B, which the replicas do not apply",
        "fan_in_fan_out": "fan_in_fan_out=True (Conv1D layers, GPT-2) stores weights transposed; the "
        "replicas take Linear weights [out, in]",
        "trainable_token_indices": "trainable_token_indices trains embedding rows, not a LoRA adapter",
        "target_parameters": "target_parameters adapts nn.Parameters, not Linear modules",
        "layer_replication": "layer_replication changes the base's layers",
        "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) activates the adapter mid-sequence",
        "use_qalora": "QALoRA (use_qalora=True) is not plain LoRA",
    }
    for option, why in refused.items():
        if getattr(config, option, None):
            raise LoraUnsupported(f"LoraConfig({option}={getattr(config, option)!r}): {why}")
    if config.bias != "none":
        raise LoraUnsupported(
            f"LoraConfig(bias={config.bias!r}) trains the base's biases; the replicas apply LoRA's A and B "
            "only: use bias='none'"
        )
    # A base parameter left trainable would change the policy without ever reaching the replicas
    trained = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]
    if trained:
        raise LoraUnsupported(
            f"base parameters require gradients ({', '.join(trained[:3])}"
            f"{', ...' if len(trained) > 3 else ''}): only the adapter is published, so the base must "
            "stay frozen (requires_grad_(False))"
        )
    init = config.init_lora_weights
    if isinstance(init, str) and init.lower() not in ("gaussian", "true"):
        # pissa, olora, loftq, eva, corda...: they rewrite the base weights at initialisation, so the
        # replicas' base is no longer the one the adapter applies to
        raise LoraUnsupported(
            f"LoraConfig(init_lora_weights={init!r}) changes the base weights at initialisation; the "
            "replicas serve the original base: use True or 'gaussian'"
        )


def _layers(model):
    """(module name in the base, its LoRA layer) of every adapted module, after checking each is plain LoRA
    on a Linear with the config's rank and scale."""
    from peft.tuners.lora import LoraLayer

    config = model.peft_config[ADAPTER]
    expected = config.lora_alpha / config.r
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.r:  # also an Embedding's LoRA
            continue
        base = name.removeprefix(PEFT_PREFIX)
        layer = module.get_base_layer()
        # exactly Linear: a subclass (a quantised layer) does not hold the [out, in] weight the replicas adapt
        if type(layer) is not torch.nn.Linear:
            raise LoraUnsupported(
                f"LoRA target {base!r} is a {type(layer).__name__}, not a torch.nn.Linear: the replicas "
                "apply adapters to Linear weights only (choose target_modules among the Linear layers)"
            )
        if module.lora_magnitude_vector and ADAPTER in module.lora_magnitude_vector:
            raise LoraUnsupported(f"LoRA target {base!r} has a DoRA magnitude vector: use_dora=False")
        if module.lora_variant.get(ADAPTER) is not None:
            raise LoraUnsupported(
                f"LoRA target {base!r} uses the variant {type(module.lora_variant[ADAPTER]).__name__}: "
                "the replicas apply plain LoRA"
            )
        if module.r[ADAPTER] != config.r or abs(module.scaling[ADAPTER] - expected) > 1e-12 * expected:
            raise LoraUnsupported(
                f"LoRA target {base!r} has rank {module.r[ADAPTER]} and scale {module.scaling[ADAPTER]}, "
                f"not the config's rank {config.r} and scale alpha/r = {expected}: an adapter has one rank "
                "and one scale"
            )
        if module.lora_B[ADAPTER].bias is not None:
            raise LoraUnsupported(f"LoRA target {base!r} has a bias on lora_B: use lora_bias=False")
        out.append((base, module))
    if not out:
        raise LoraUnsupported("the PEFT model has no LoRA layer for the adapter 'default'")
    return out


def adapter_of(model, *, fingerprint: str | None = None) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """The adapter of `model` (a PEFT LoRA model, possibly in DDP) as the replicas take it: its spec and
    {"<module>.lora_A.weight": [r, in], "<module>.lora_B.weight": [out, r]} as CPU copies (contiguous,
    the trainer's dtype), in module order. fingerprint: the base's, when the caller already has it
    (it does not change while only the adapter trains); None computes it. Raises LoraUnsupported for
    what the replicas cannot apply."""
    model = _peft_model(model)
    _check_config(model)
    config = model.peft_config[ADAPTER]
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    with torch.no_grad():
        for base, module in _layers(model):
            targets.add(base.rsplit(".", 1)[-1])
            for suffix, linear in ((LORA_A, module.lora_A[ADAPTER]), (LORA_B, module.lora_B[ADAPTER])):
                tensors[base + suffix] = linear.weight.detach().to("cpu", copy=True).contiguous()
    spec = AdapterSpec(
        rank=int(config.r),
        alpha=float(config.lora_alpha),
        target_modules=tuple(sorted(targets)),
        base_fingerprint=fingerprint if fingerprint is not None else base_fingerprint(model),
    )
    return spec, tensors


def base_state_dict(model) -> dict[str, torch.Tensor]:
    """The base model's state dict inside a PEFT model, under the base's own names: PEFT's prefix and
    `.base_layer` removed, every adapter tensor (`lora_*`) left out. The tensors are the model's own
    (no copy)."""
    model = _peft_model(model)
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            continue
        out[name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")] = t
    return out


def base_fingerprint(model) -> str:
    """`weight_sync.model_fingerprint` of the base under a PEFT model (equal to that of the
    un-wrapped model: the replicas' base); of `model` itself when it is not a PEFT model."""
    if not is_lora(model):
        return model_fingerprint(_unwrap(model))
    return model_fingerprint(base_state_dict(model))


def _pairs(
    spec: AdapterSpec, tensors: Mapping[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A [r, in], B [out, r])}, after the wire's checks (exact pairs of this rank)."""
    from maskroll.proto.tensor_push import TensorSpec

    # the pairs and shapes only: a directory PEFT wrote names no base, which merging does not need
    spec = dataclasses.replace(spec, base_fingerprint=spec.base_fingerprint or "unknown")
    spec.check(tuple(TensorSpec(name, "F32", tuple(t.shape), 0, 0) for name, t in tensors.items()))
    return {
        name[: -len(LORA_A)]: (t, tensors[name[: -len(LORA_A)] + LORA_B])
        for name, t in tensors.items()
        if name.endswith(LORA_A)
    }


def merge(
    base_state_dict: Mapping[str, torch.Tensor], spec: AdapterSpec, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The base with the adapter merged: `W' = W + (alpha / r) · B A` for each adapted module, computed
    in float32 (at least) and stored in W's dtype and device; the other tensors are the base's own (no
    copy). The merged model computes what the replicas compute with the adapter (up to rounding)."""
    out = dict(base_state_dict)
    for module, (a, b) in _pairs(spec, tensors).items():  # a [r, in], b [out, r]
        key = module + ".weight"
        if key not in out:
            raise KeyError(f"the adapter adapts {module!r}, but the base has no {key!r}")
        w = out[key]  # [out, in]
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise ValueError(
                f"{module!r}: base weight {list(w.shape)} is not [out, in] = [{b.shape[0]}, {a.shape[1]}] of "
                "the adapter"
            )
        dtype = torch.promote_types(w.dtype, torch.float32)
        delta = b.to(w.device, dtype) @ a.to(w.device, dtype)  # [out, in]
        out[key] = (w.to(dtype) + spec.scale * delta).to(w.dtype)
    return out


def peft_config_dict(spec: AdapterSpec, base_model: str = "") -> dict:
    """adapter_config.json as PEFT writes it for this spec (read by `PeftModel.from_pretrained`, vLLM)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": list(spec.target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_adapter(
    directory: str | os.PathLike,
    spec: AdapterSpec,
    tensors: Mapping[str, torch.Tensor],
    *,
    base_model: str = "",
) -> Path:
    """Write the adapter as PEFT does (`adapter_config.json` + `adapter_model.safetensors`, names
    `base_model.model.<module>.lora_X.weight`), the base fingerprint in the safetensors metadata; each
    file under a temporary name, renamed when complete. `peft.PeftModel.from_pretrained(base, directory)`
    reads it. base_model: `base_model_name_or_path` in the config (a path or hub name; "" leaves it
    null). Returns the directory."""
    from safetensors.torch import save_file

    _pairs(spec, tensors)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    on_disk = {PEFT_PREFIX + name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    tmp = out / f".{WEIGHTS_FILE}.tmp"
    save_file(on_disk, str(tmp), metadata={"format": "pt", FINGERPRINT_KEY: spec.base_fingerprint})
    os.replace(tmp, out / WEIGHTS_FILE)
    tmp = out / f".{CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(peft_config_dict(spec, base_model), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / CONFIG_FILE)
    return out


def load_adapter(directory: str | os.PathLike) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """(spec, wire-named CPU tensors) of an adapter directory in PEFT's layout (save_adapter's, or PEFT's
    own `save_pretrained` of a plain LoRA). The base fingerprint is "" when the directory names none
    (not written by maskroll). Raises LoraUnsupported for what the replicas cannot apply."""
    from safetensors import safe_open

    d = Path(directory)
    config = json.loads((d / CONFIG_FILE).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraUnsupported(f"{d / CONFIG_FILE}: peft_type {config['peft_type']!r} is not LORA")
    for option in ("use_dora", "use_rslora", "modules_to_save", "rank_pattern", "alpha_pattern", "lora_bias"):
        if config.get(option):
            raise LoraUnsupported(f"{d / CONFIG_FILE}: {option}={config[option]!r} is not plain LoRA")
    if config.get("bias", "none") != "none":
        raise LoraUnsupported(
            f"{d / CONFIG_FILE}: bias={config['bias']!r}; the replicas apply bias='none' only"
        )
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(d / WEIGHTS_FILE), framework="pt") as f:
        fingerprint = (f.metadata() or {}).get(FINGERPRINT_KEY, "")
        for name in f.keys():  # noqa: SIM118 — safe_open has keys(), no __iter__
            wire = name.removeprefix(PEFT_PREFIX).replace(f".{ADAPTER}.", ".")
            tensors[wire] = f.get_tensor(name)
    targets = config.get("target_modules") or ()
    if isinstance(targets, str):  # a regular expression in PEFT: name the modules actually adapted
        targets = sorted({n[: -len(LORA_A)].rsplit(".", 1)[-1] for n in tensors if n.endswith(LORA_A)})
    spec = AdapterSpec(
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        target_modules=tuple(sorted(targets)),
        base_fingerprint=fingerprint,
    )
    _pairs(spec, tensors)
    return spec, tensors


def load_into(model, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy wire-named adapter tensors (load_adapter's) into `model`'s adapter "default" (resuming a run),
    onto the device and dtype the model holds. Strict: every adapter tensor of the model, no other one,
    the same shapes."""
    model = _peft_model(model)
    params: dict[str, torch.Tensor] = {}
    for base, module in _layers(model):
        params[base + LORA_A] = module.lora_A[ADAPTER].weight
        params[base + LORA_B] = module.lora_B[ADAPTER].weight
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or extra:
        raise KeyError(
            f"adapter tensors do not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{name}: {list(t.shape)} does not fit the model's {list(p.shape)}")
            p.copy_(t)
