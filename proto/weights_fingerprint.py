"""A weights fingerprint: which weights a model holds, in a few bytes, computed the same way by a replica
(from its `--model` directory's safetensors) and by a trainer (from its model's state dict).

Why: a replica still on its starting weights serves "version 0" of whatever run a trainer starts, so a
trainer whose model differs (same architecture, other weights) would train on the other model's
rollouts without a sign. With the fingerprint in GetInfo, a new run's `start()` makes replicas whose
fingerprint matches adopt its version 0 (no bytes sent) and pushes the model to the others.

What is hashed, per floating-point tensor in name order: the name, the shape, and SAMPLE values at evenly
spaced flat positions, rounded to bfloat16. Rounding to bfloat16 makes the same weights held in float32,
bfloat16 or float16 (a bf16 checkpoint loaded by a float32 trainer) hash alike; sampling keeps it cheap
at any size (a replica reads a few rows per tensor, never the whole file). It is a guard against a wrong
model, not a cryptographic commitment: two models equal at every sampled position of every tensor would
pass, which models that were trained or initialised apart never are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

SAMPLE = 256  # values read per tensor
PREFIX = "wfp1:"  # the scheme, so a future one never compares equal to this


def sample_indices(numel: int) -> np.ndarray:
    """int64 [min(numel, SAMPLE)]: evenly spaced flat positions, first and last included."""
    if numel <= SAMPLE:
        return np.arange(numel, dtype=np.int64)
    return np.linspace(0, numel - 1, SAMPLE).round().astype(np.int64)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """uint16 [n]: float32 values rounded to bfloat16 (round to nearest even), as bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def weights_fingerprint(tensors: Iterable[tuple[str, tuple[int, ...], np.ndarray]]) -> str:
    """The fingerprint of (name, shape, values at `sample_indices(numel)` as float32) per floating-point
    tensor; "" for no tensors (nothing known). Order of `tensors` does not matter."""
    h = hashlib.sha256()
    count = 0
    for name, shape, sample in sorted(tensors, key=lambda t: t[0]):
        numel = int(np.prod(shape, dtype=np.int64))
        if np.shape(sample) != (min(numel, SAMPLE),):
            raise ValueError(
                f"tensor {name!r}: sample of shape {np.shape(sample)}; expected {(min(numel, SAMPLE),)}"
            )
        h.update(f"{name}\x00{','.join(map(str, shape))}\x00".encode())
        h.update(_bf16_bits(np.asarray(sample)).tobytes())
        count += 1
    return PREFIX + h.hexdigest()[:32] if count else ""


DIGESTS_PREFIX = "wxh1:"  # a version whose every tensor was checked against its digest


def digests_fingerprint(digests: Iterable[tuple[str, str]]) -> str:
    """The weights fingerprint of a version pushed with digests (`TensorSpec.digest`: xxh3-64 of each
    tensor's bytes in the replicas' dtype): the trainer computes it from what it sent, a replica from the
    manifest it applied once every tensor of its own matched, so equal fingerprints mean equal weights bit
    for bit (a tied tensor counts once, under the name it was sent by). "" for no tensors."""
    pairs = sorted(digests)
    if not pairs:
        return ""
    h = hashlib.sha256()
    for name, digest in pairs:
        h.update(f"{name}\x00{digest}\x00".encode())
    return DIGESTS_PREFIX + h.hexdigest()[:32]
