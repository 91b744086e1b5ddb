"""The trainer's end of delta pushes (the replica's is server/weights/delta.py): each new version sent as
what changed since the last one, in the replicas' dtype, checked on arrival bit for bit.

At RL learning rates most weights do not change in a step once rounded to the replicas' dtype: a bf16
element moves only when the float32 master weight crosses half a bf16 ulp (measured on SmolLM2-135M with
AdamW: bench/weights.py, docs/benchmarks.md "Weight updates at scale"). So the trainer keeps the last
version it pushed *in that dtype* (one copy, the one a replica that joins later is sent whole), casts the
new weights the same way (round to nearest even, as the replica's own cast would) and sends per tensor
the cheapest of:

- nothing ("same"): no element's bits changed;
- a sparse patch: the changed elements' flat indices (int32 little-endian; int64 past 2**31 elements)
  then their new values — vLLM's `CheckpointWeightPatch` coordinates (the checkpoint's names and shapes);
- the dense tensor, when the patch would be larger (more than 1/3 of a bf16 tensor changed).

Bits are compared, not values: -0.0 and 0.0 differ, and what the replica must end with is these bytes.
Every tensor, sent or not, carries the xxh3-64 digest of its new bytes (`proto.tensor_push.digest_of`):
the replica checks its result against each before the version serves, so a patch applied on other
weights, or corrupted, is refused rather than served. A full push carries the same digests, and the
digests' fingerprint (`proto.weights_fingerprint.digests_fingerprint`) names the version on both ends.

Index compression was measured (docs/benchmarks.md, "Compressing the patch indices"): zstandard on the
gaps of the sorted indices halves a delta at 200-360 MB/s per core, which loses per replica on links
faster than ~1 Gb/s but wins on the trainer's egress once N replicas share its link (below about N x 1
Gb/s); left out for now, as are uint16 gaps and bitmaps (cheaper steps the same section measures).

Pure functions over CPU tensors; the publisher (stream.py) owns the state. The sparse_nccl sender
(nccl_sparse.py) uses `replica_copy` and `changed_at` on the model's device.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from maskroll.proto.tensor_push import (
    DENSE,
    SAME,
    SPARSE,
    TensorSpec,
    WeightsManifest,
    digest_of,
    index_bytes,
)

from .sharded import dtype_name, raw

# Integer views of each item size: bits compared with one integer compare per element.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def replica_copy(
    state: Mapping[str, torch.Tensor], dtype: torch.dtype | None, device: torch.device | str | None = "cpu"
) -> dict[str, torch.Tensor]:
    """The weights as the replicas hold them: contiguous copies on `device` (None: each tensor's own, as
    the sparse_nccl sender keeps them, nccl_sparse.py), floating-point tensors cast to `dtype` (None: kept
    as they are), a tensor shared under several names (a tied embedding) once, under its first name in
    state-dict order (as Hugging Face checkpoints store it; the replicas tie it back)."""
    out = {name: _cast(t, dtype, device) for name, t in distinct(state).items()}
    if not out:
        raise ValueError("the state dict is empty: nothing to publish")
    return out


def distinct(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the later names of a tensor shared under several (same storage, offset, layout)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


def floating_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A publisher's `dtype=` (the replicas'): a floating-point torch dtype, its name ("bfloat16",
    "torch.bfloat16"), or None (the model's own); ValueError for anything else."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), dtype)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch dtype (or its name) or None: {dtype!r}")
    return dtype


def _held_as(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the replicas hold `t` in: `dtype` for a floating-point tensor (None: its own)."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _cast(
    t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str | None = "cpu"
) -> torch.Tensor:
    with torch.no_grad():
        target = t.device if device is None else device
        return t.detach().to(target, _held_as(t, dtype), copy=True).contiguous()


def digests(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """xxh3-64 of each tensor's bytes, in order (22 GB/s on one core: 12 ms for a 270 MB model)."""
    return [digest_of(raw(t)) for t in tensors.values()]


Payload = bytes | memoryview | None  # what is sent for one tensor (None: nothing)


@dataclass(frozen=True)
class Delta:
    """A version as a delta: its manifest (every tensor, its encoding and digest) and the bytes to send
    of each (None: nothing)."""

    manifest: WeightsManifest
    payloads: tuple[Payload, ...]

    def chunks(self, chunk_bytes: int) -> Iterator[tuple[int, int, bytes | memoryview]]:
        """(tensor index, byte offset, bytes) of every sent tensor in order, at most `chunk_bytes` each."""
        for index, data in enumerate(self.payloads):
            if data is None:
                continue
            view = memoryview(data)
            for offset in range(0, view.nbytes, chunk_bytes):
                yield index, offset, view[offset : offset + chunk_bytes]


def encode(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    new_digests: list[str],
    *,
    version: int,
    base_version: int,
    run_id: str = "",
) -> Delta:
    """`new` as a delta on `base` (the same names, shapes and dtypes: two `replica_copy`s of one model).
    ValueError if they differ in layout (a full push is then the only way)."""
    _check_layout(base, {name: (t.shape, t.dtype) for name, t in new.items()})
    parts = [
        _one(name, old, t, digest)
        for (name, old), t, digest in zip(base.items(), new.values(), new_digests, strict=True)
    ]
    return _delta(parts, version, base_version, run_id)


def advance(
    base: dict[str, torch.Tensor],
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None,
    *,
    version: int,
    base_version: int,
    run_id: str = "",
) -> Delta:
    """`state` (the model's, as `replica_copy` would copy it) as a delta on `base`, each of `base`'s tensors
    replaced by its new copy as soon as it is compared: `base` ends as the new version, and the trainer
    never holds two copies of the model (one tensor, and the patches, beside the one). ValueError, with
    `base` unchanged, if the layouts differ."""
    state = distinct(state)
    _check_layout(base, {name: (t.shape, _held_as(t, dtype)) for name, t in state.items()})
    parts = []
    for name, t in state.items():
        new = _cast(t, dtype)
        parts.append(_one(name, base[name], new, digest_of(raw(new))))
        base[name] = new  # the old copy goes now
    return _delta(parts, version, base_version, run_id)


def _check_layout(base: Mapping[str, torch.Tensor], new: Mapping[str, tuple]) -> None:
    if list(base) != list(new):
        raise ValueError("the new weights name other tensors than the base: a delta cannot carry them")
    for name, old in base.items():
        shape, dtype = new[name]
        if old.shape != shape or old.dtype != dtype:
            raise ValueError(
                f"tensor {name!r} changed layout ({list(old.shape)} {old.dtype} -> {list(shape)} {dtype}): a "
                "delta cannot carry it"
            )


def _one(name: str, old: torch.Tensor, t: torch.Tensor, digest: str) -> tuple[TensorSpec, Payload]:
    """One tensor's entry: (its spec, the bytes sent for it or None)."""
    dtype, numel, size = dtype_name(name, t.dtype), t.numel(), t.element_size()
    changed = changed_at(old, t)
    k = int(changed.numel())
    if k == 0:
        return TensorSpec(name, dtype, tuple(t.shape), 0, 0, SAME, 0, digest), None
    if k * (index_bytes(numel) + size) < numel * size:
        idx = changed.to(torch.int32 if index_bytes(numel) == 4 else torch.int64)
        data = idx.numpy().tobytes() + t.reshape(-1)[changed].view(torch.uint8).numpy().tobytes()
        return TensorSpec(name, dtype, tuple(t.shape), len(data), zlib.crc32(data), SPARSE, k, digest), data
    data = raw(t)
    return TensorSpec(name, dtype, tuple(t.shape), numel * size, zlib.crc32(data), DENSE, 0, digest), data


def _delta(parts: list, version: int, base_version: int, run_id: str) -> Delta:
    manifest = WeightsManifest(version, tuple(s for s, _ in parts), run_id=run_id, base_version=base_version)
    return Delta(manifest, tuple(d for _, d in parts))


def changed_at(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """int64 [k], on their device: the flat positions (increasing) where the bits of `new` differ from
    `old`'s (same shape and dtype)."""
    bits = _BITS[new.element_size()]
    if new.dtype == torch.bool:
        old, new = old.view(torch.uint8), new.view(torch.uint8)
    return torch.nonzero(old.reshape(-1).view(bits) != new.reshape(-1).view(bits)).reshape(-1)
