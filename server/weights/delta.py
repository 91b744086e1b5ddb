"""The replica's end of a delta push (PushWeights whose manifest names a `base_version`; the trainer's end
is weight_sync/delta.py): what changed since the version this replica serves, applied in place by the
engine and verified bit for bit before the new version serves.

A delta lists every tensor of the model: "same" (nothing sent), "sparse" (flat indices, then the new values
at them) or "dense" (the whole tensor), each with the xxh3-64 digest of its bytes *once applied*
(`proto.tensor_push`). The rules:

- **Only on its base.** A replica that does not serve exactly (run, base_version) — restarted, joined late,
  refused an earlier version — or whose engine applies no deltas refuses the push on its manifest, before
  any byte is received (FAILED_PRECONDITION saying `NEEDS_FULL`); the trainer then sends it the full
  version. Asked again under the weights lock (another update may have won it meanwhile).
- **Verified, or nothing changes.** The engine (`Engine.apply_weight_patches`) computes every tensor's
  result and checks it against its digest before it writes a weight; a mismatch (a patch on other weights,
  a value flipped in flight that kept its CRC) refuses the version with the old one serving, and the trainer
  falls back to a full push for this replica.
- Patches are small: received into memory, whatever the engine (one buffer per sent tensor, each chunk
  copied once; the CRC of what was sent is checked as it arrives, as for a full push).

Knows nothing of gRPC or protobuf; the version rule is weights/updates.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from maskroll.proto.tensor_push import DENSE, SAME, SPARSE, WeightsManifest, index_bytes

from ..engines.contract import Engine, WeightPatch
from ..errors import FailedPrecondition, InvalidArgument
from . import checkpoints, stream

# What a refusal a full push would cure says; the trainer's fallback does not depend on it (any failed
# delta is followed by the full version), an operator reading the log does.
NEEDS_FULL = "send the full version instead"


def check_base(manifest: WeightsManifest, served: tuple[str, int], engine: Engine) -> None:
    """FailedPrecondition unless `engine` applies deltas and serves `manifest`'s base, (run, version)."""
    if not engine.weight_capabilities.patches:
        raise FailedPrecondition(f"the {engine.name} engine applies no weight deltas; {NEEDS_FULL}")
    run, version = served
    if (run, version) != (manifest.run_id, manifest.base_version):
        held = f"version {version} of run {run}" if run else "its starting weights"
        raise FailedPrecondition(
            f"a delta on version {manifest.base_version} of run {manifest.run_id}, but this replica serves "
            f"{held}: a patch applies only on its own base; {NEEDS_FULL}"
        )


async def receive_patches(manifest: WeightsManifest, rest: stream.Chunks) -> list[WeightPatch]:
    """The delta's sent tensors (the chunks `rest` after `manifest`) as patches in manifest order; the
    unchanged ones send nothing and are not among them."""
    stream.check_manifest(manifest)
    place, advice = "this replica's free memory", "give it more memory"
    with stream.reserved(
        "memory", manifest.total_bytes, stream.memory_available(), stream.MEMORY_MARGIN, place, advice
    ):
        buffers = [np.empty(t.nbytes, np.uint8) for t in manifest.tensors]

        def put(index: int, offset: int, data: bytes) -> None:
            buffers[index][offset : offset + len(data)] = np.frombuffer(data, np.uint8)

        await stream.Writer(manifest, put).consume(rest)
    return [_patch(t, buf) for t, buf in zip(manifest.tensors, buffers, strict=True) if t.encoding != SAME]


def _patch(t, buf: np.ndarray) -> WeightPatch:
    import torch

    raw = torch.from_numpy(buf)
    dtype = checkpoints.torch_dtype(t.dtype)
    if t.encoding == DENSE:
        return WeightPatch(t.name, t.shape, raw.view(dtype))
    cut = t.changed * index_bytes(t.numel)  # SPARSE: the indices, then the values
    indices = raw[:cut].view(torch.int32 if index_bytes(t.numel) == 4 else torch.int64)
    return WeightPatch(t.name, t.shape, raw[cut:].view(dtype), indices)


@dataclass
class DeltaSource:
    """A received delta (weights/updates.py loads it, as any `WeightSource`)."""

    manifest: WeightsManifest
    patches: list[WeightPatch] = field(default_factory=list)

    def describe(self) -> str:
        m = self.manifest
        count = {e: sum(t.encoding == e for t in m.tensors) for e in (SPARSE, DENSE, SAME)}
        return (
            f"a delta on version {m.base_version} ({count[SPARSE]} tensors patched, {count[DENSE]} sent "
            f"whole, {count[SAME]} unchanged; {m.total_bytes / 1e6:.2f} MB)"
        )

    async def load(self, engine: Engine, version: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        digests = {t.name: t.digest for t in self.manifest.tensors}
        label = f"the delta of version {version}"
        try:
            paused = await engine.apply_weight_patches(version, self.patches, digests, label)
        except ValueError as exc:
            raise InvalidArgument(f"{exc}; {NEEDS_FULL}") from exc
        return paused, time.perf_counter() - t0

    def release(self) -> None:
        self.patches.clear()
