"""The replica's end of PushWeights: a pushed state dict received into a private safetensors file.

The manifest (first message) gives every tensor's name, dtype, shape, size and CRC-32, so the
safetensors header is written before any tensor data, and each chunk's bytes go straight to their place
in the file: receiving holds one chunk in memory, never the model. Every chunk must continue its tensor
exactly where the previous one ended (manifest order, offset order); a checksum mismatch, a missing or
extra byte, or a call that ends early refuses the whole push and deletes the file, so nothing partial is
ever loaded. The file lives in a directory private to this replica (the spool: `MASKROLL_WEIGHTS_SPOOL`
or the system temp directory), not on a shared volume; the engine then loads it exactly as it loads a
checkpoint directory (`weight_sources.StreamedSource`), with the same checks (names, shapes, dtypes,
finite values). Knows nothing of gRPC beyond the converter's message types, nor of engines.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

from maskroll.client import wire
from maskroll.client.tensor_push import WeightsManifest

from .errors import FailedPrecondition, InvalidArgument

FILE_NAME = "model.safetensors"
SPOOL_ENV = "MASKROLL_WEIGHTS_SPOOL"
DISK_MARGIN = 64 << 20  # bytes the spool's filesystem keeps free after a push is written


def spool_root() -> Path:
    return Path(os.environ.get(SPOOL_ENV) or tempfile.gettempdir())


def safetensors_header(manifest: WeightsManifest) -> bytes:
    """The safetensors prefix (u64 little-endian header length + JSON header, padded to 8 bytes) of a
    file holding the manifest's tensors back to back in manifest order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in manifest.tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


class _Writer:
    """Checks each chunk's place and checksum as it writes it."""

    def __init__(self, manifest: WeightsManifest, f) -> None:
        self.m, self.f = manifest, f
        self.index, self.offset, self.crc = 0, 0, 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        # a tensor with no elements has no chunk; its checksum is that of no bytes
        while self.index < len(self.m.tensors) and self.m.tensors[self.index].nbytes == 0:
            self._close_tensor()

    def _close_tensor(self) -> None:
        t = self.m.tensors[self.index]
        if self.crc != t.crc32:
            raise InvalidArgument(
                f"tensor {t.name!r}: CRC-32 of the received bytes is {self.crc:#010x}, the manifest says "
                f"{t.crc32:#010x} (corrupted in transit?); the push is refused, the current weights are kept"
            )
        self.index, self.offset, self.crc = self.index + 1, 0, 0

    def write(self, index: int, offset: int, data: bytes) -> None:
        if self.index >= len(self.m.tensors):
            raise InvalidArgument(f"a chunk for tensor {index} arrived after the last tensor was complete")
        t = self.m.tensors[self.index]
        if index != self.index or offset != self.offset:
            raise InvalidArgument(
                f"chunk out of order: expected tensor {self.index} ({t.name!r}) at byte {self.offset}, "
                f"got tensor {index} at byte {offset}"
            )
        if not data or self.offset + len(data) > t.nbytes:
            raise InvalidArgument(
                f"tensor {t.name!r}: a chunk of {len(data)} bytes at byte {offset} does not fit its "
                f"{t.nbytes} bytes"
            )
        self.f.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.offset += len(data)
        if self.offset == t.nbytes:
            self._close_tensor()
            self._skip_empty()

    def finish(self) -> None:
        if self.index < len(self.m.tensors):
            t = self.m.tensors[self.index]
            raise InvalidArgument(
                f"the push ended early: tensor {self.index} of {len(self.m.tensors)} ({t.name!r}) has "
                f"{self.offset} of {t.nbytes} bytes; nothing was loaded"
            )


def check_manifest(manifest: WeightsManifest, spool: Path) -> None:
    try:
        manifest.check()
    except ValueError as e:
        raise InvalidArgument(f"PushWeights manifest: {e}") from e
    free = shutil.disk_usage(spool).free
    if manifest.total_bytes + DISK_MARGIN > free:
        raise FailedPrecondition(
            f"the pushed weights ({manifest.total_bytes} bytes) do not fit in the spool {str(spool)!r} "
            f"({free} bytes free); give the replica more local disk or set {SPOOL_ENV}"
        )


async def receive(manifest: WeightsManifest, rest: AsyncIterator, spool: Path | None = None) -> Path:
    """Write the pushed tensors (the data messages `rest` that follow `manifest`) into a new directory
    under the spool; returns that directory, holding one `model.safetensors`. The caller deletes it
    (`discard`). On any error — including cancellation, a dropped connection — the directory is gone."""
    spool = spool or spool_root()
    spool.mkdir(parents=True, exist_ok=True)
    check_manifest(manifest, spool)
    directory = Path(tempfile.mkdtemp(prefix=f"push-v{manifest.version}-", dir=spool))
    try:
        with open(directory / FILE_NAME, "wb") as f:
            f.write(safetensors_header(manifest))
            writer = _Writer(manifest, f)
            async for message in rest:
                try:
                    index, offset, data = wire.push_chunk_from_pb(message)
                except ValueError as e:
                    raise InvalidArgument(str(e)) from e
                # A 4 MiB write returns in about a millisecond to the page cache: not worth a thread hop.
                writer.write(index, offset, data)
            writer.finish()
    except BaseException:
        # Not in a thread: the call may be cancelled right now (the client went away), and an awaited
        # clean-up would be cancelled with it. Unlinking one file takes milliseconds.
        discard(directory)
        raise
    return directory


def discard(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
