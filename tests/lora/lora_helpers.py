"""Shared helpers of the LoRA tests (issue 22; docs: the design's "Names and maths"): random adapters
for a model directory in the wire names, the merged state dict they stand for, and PushWeights
messages of an adapter. Imported by module name (tests put this folder on sys.path), never through a
conftest.

Names: an adapter covers Linear modules of the base named as in its state dict without ".weight"
("model.layers.0.self_attn.q_proj"); tensors "<module>.lora_A.weight" [r, in] and
"<module>.lora_B.weight" [out, r]; merged W' = W + (alpha / r) · B A (PEFT's default scale)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch

from maskroll.proto.tensor_push import LORA_A, LORA_B, AdapterSpec, WeightsManifest

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def base_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The base weights of a model directory (every `*.safetensors` file), on CPU."""
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        sd.update(load_file(str(file)))
    if not sd:
        raise FileNotFoundError(f"no safetensors in {model_dir}")
    return sd


def base_fingerprint(model_dir: str | Path) -> str:
    """The fingerprint a replica started on `model_dir` reports (GetInfo.base_fingerprint)."""
    from maskroll.server.weights.dir_fingerprint import fingerprint_dir

    return fingerprint_dir(model_dir)


def target_linears(
    base_sd: Mapping[str, torch.Tensor], target_modules: tuple[str, ...] = DEFAULT_TARGETS
) -> dict[str, tuple[int, int]]:
    """{module: (out, in)} of the 2-D "<module>.weight" whose last name part is a target (PEFT's rule
    for short names), in state-dict order."""
    found = {}
    for name, t in base_sd.items():
        if not name.endswith(".weight") or t.dim() != 2:
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in target_modules:
            found[module] = (int(t.shape[0]), int(t.shape[1]))
    if not found:
        raise ValueError(f"no Linear weight of the base matches {target_modules}")
    return found


def random_adapter(
    model_dir_or_sd: str | Path | Mapping[str, torch.Tensor],
    *,
    rank: int = 4,
    alpha: float = 8.0,
    target_modules: tuple[str, ...] = DEFAULT_TARGETS,
    seed: int = 0,
    std: float = 0.05,
    dtype: torch.dtype = torch.float32,
    fingerprint: str | None = None,
) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """A random adapter for the base: (spec, {"<module>.lora_A.weight": [r, in], "<module>.lora_B.weight":
    [out, r]}). B is NOT zero (PEFT initialises it to zero, which would make the adapter a no-op and
    every "adapter changes the output" test vacuous); `std` sizes the change: with the tiny model's
    128-wide layers, std 0.05 and scale 2 move logprobs by O(0.1), enough to change sampled tokens.
    fingerprint: the spec's base_fingerprint (default: the model directory's; required for a state dict)."""
    if isinstance(model_dir_or_sd, Mapping):
        base_sd = model_dir_or_sd
        if fingerprint is None:
            raise ValueError("pass fingerprint= with a state dict (it is the model directory's by default)")
    else:
        base_sd = base_state_dict(model_dir_or_sd)
        if fingerprint is None:
            fingerprint = base_fingerprint(model_dir_or_sd)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for module, (out_f, in_f) in target_linears(base_sd, target_modules).items():
        tensors[module + LORA_A] = (torch.randn(rank, in_f, generator=g) * std).to(dtype)  # [r, in]
        tensors[module + LORA_B] = (torch.randn(out_f, rank, generator=g) * std).to(dtype)  # [out, r]
    spec = AdapterSpec(
        rank=rank, alpha=float(alpha), target_modules=tuple(target_modules), base_fingerprint=fingerprint
    )
    return spec, tensors


def merged_state_dict(
    base_sd: Mapping[str, torch.Tensor], spec: AdapterSpec, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The base with the adapter merged: W' = W + (alpha / r) · B A for every adapted module, computed in
    float64 and cast back to W's dtype; every other tensor the base's own (cloned)."""
    merged = {name: t.clone() for name, t in base_sd.items()}
    for name, a in tensors.items():
        if not name.endswith(LORA_A):
            continue
        module = name[: -len(LORA_A)]
        b = tensors[module + LORA_B]
        w = merged[module + ".weight"]  # [out, in]
        delta = spec.scale * (b.double() @ a.double())  # [out, r] @ [r, in] = [out, in]
        merged[module + ".weight"] = (w.double() + delta).to(w.dtype)
    return merged


def write_model_dir(
    src_model_dir: str | Path, state_dict: Mapping[str, torch.Tensor], dst: str | Path
) -> Path:
    """A copy of `src_model_dir` (config, tokenizer) whose weights are `state_dict`: a merged model a
    second engine can start on."""
    import shutil

    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src_model_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(dst / "model.safetensors"))
    return dst


def adapter_manifest(
    spec: AdapterSpec,
    tensors: Mapping[str, torch.Tensor],
    version: int,
    run_id: str = "",
    namespace: str = "",
) -> WeightsManifest:
    """The PushWeights manifest of an adapter (each tensor with its CRC-32, as the publisher makes it)."""
    from maskroll.weight_sync.stream import manifest_of

    m = manifest_of(tensors, version, run_id)
    return dataclasses.replace(m, adapter=spec, namespace=namespace)


def adapter_messages(
    spec: AdapterSpec,
    tensors: Mapping[str, torch.Tensor],
    version: int,
    run_id: str = "",
    namespace: str = "",
    chunk_bytes: int = 1 << 16,
    manifest: WeightsManifest | None = None,
) -> list:
    """The PushWeights messages (protobuf) of an adapter, as a list a test may edit."""
    from maskroll.proto import wire
    from maskroll.weight_sync.stream import chunks_of

    manifest = manifest or adapter_manifest(spec, tensors, version, run_id, namespace)
    return [wire.manifest_to_pb(manifest)] + [
        wire.push_chunk_to_pb(i, off, data) for i, off, data in chunks_of(tensors, chunk_bytes)
    ]


def push_adapter(
    address: str,
    spec: AdapterSpec,
    tensors: Mapping[str, torch.Tensor],
    version: int,
    run_id: str = "",
    namespace: str = "",
    token: str | None = None,
    timeout: float = 60.0,
):
    """PushWeights of an adapter to `address` over real gRPC: the UpdateWeightsResponse, or the
    `RolloutError` (code, message) the call ended with."""
    import asyncio

    import grpc

    from maskroll.client import RolloutError
    from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc

    msgs = adapter_messages(spec, tensors, version, run_id, namespace)

    async def go():
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        async with grpc.aio.insecure_channel(address) as ch:
            return await pb_grpc.RolloutServiceStub(ch).PushWeights(
                iter(msgs), metadata=metadata, timeout=timeout
            )

    try:
        return asyncio.run(go())
    except grpc.aio.AioRpcError as e:
        return RolloutError.from_rpc(e)
