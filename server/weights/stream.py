"""The replica's end of the stream transport (PushWeights; the trainer's end is weight_sync/stream.py): a
pushed state dict received, checked chunk by chunk, into memory or into a private safetensors file, and
loaded as a `StreamedSource`.

The manifest (first message) gives every tensor's name, dtype, shape, size and CRC-32, so the place of
every byte is known before the first one arrives. Every chunk must continue its tensor exactly where the
previous one ended (manifest order, offset order); a checksum mismatch, a missing or extra byte, or a
call that ends early refuses the whole push, so nothing partial is ever loaded. Two destinations, chosen
by what the engine declares it loads (`Engine.weight_capabilities`, engines/contract.py):

- `receive_tensors`: straight into one tensor per manifest entry (an engine that loads tensors from
  memory: the torch engine). Each chunk is copied once, into its tensor; nothing touches a disk and
  nothing is read back, so the update holds one copy of the weights plus the chunk in flight.
- `receive_file`: into a safetensors file whose header is written before any data, in a directory
  private to this replica (the spool: `MASKROLL_WEIGHTS_SPOOL` or the system temp directory), for an
  engine that loads files (vLLM: its workers run in another process and read the file by path).
  Receiving holds one chunk in memory; the file is deleted on any error. A loaded file stays until the
  next update succeeds (the engine restores from it after a failed one); a refused one goes at once.

Either way the engine then applies the checks of a checkpoint (`tensor_rules`: names, shapes, dtypes,
finite values). The chunks arrive as (tensor index, byte offset, bytes), converted by the front end
(`wire.push_chunk_from_pb`): knows nothing of gRPC, protobuf or the version rule (weights/updates.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from maskroll.proto.safetensors_layout import safetensors_header
from maskroll.proto.tensor_push import DENSE, WeightsManifest, digest_of

from ..engines.contract import Engine
from ..errors import FailedPrecondition, InvalidArgument, ServiceError, shown
from . import checkpoints

# What a push's data is once converted: (tensor index in the manifest, byte offset, the bytes).
Chunks = AsyncIterator[tuple[int, int, bytes | memoryview]]

FILE_NAME = "model.safetensors"
SPOOL_ENV = "MASKROLL_WEIGHTS_SPOOL"
DISK_MARGIN = 64 << 20  # bytes the spool's filesystem keeps free after a push is written
MEMORY_MARGIN = 256 << 20  # bytes left free after a push is received into memory (checks, the cast)
MAX_TENSOR_NAME_CHARS = 1024  # a model's parameter names are a few dozen characters


def spool_root() -> Path:
    return Path(os.environ.get(SPOOL_ENV) or tempfile.gettempdir())


def _crc_error(t, got: int) -> InvalidArgument:
    return InvalidArgument(
        f"tensor {t.name!r}: CRC-32 of the received bytes is {got:#010x}, the manifest says "
        f"{t.crc32:#010x} (corrupted in transit?); the push is refused, the current weights are kept"
    )


class Writer:
    """Checks each chunk's place, then hands it to `put(index, offset, data)`. The CRC-32 of each tensor
    is checked as its chunks arrive, or, with `closed`, left to the caller: `closed(index)` is called
    when tensor `index` is complete (the memory path checksums whole tensors in a worker thread). A dense
    tensor with a digest (its bytes are its result) is checked against it as it arrives too (xxh3 runs at
    22 GB/s: a few ms per hundred MB on the event loop)."""

    def __init__(
        self,
        manifest: WeightsManifest,
        put: Callable[[int, int, bytes], object],
        closed: Callable[[int], object] | None = None,
    ) -> None:
        self.m, self.put, self.closed = manifest, put, closed
        self.index, self.offset, self.crc = 0, 0, 0
        self.hasher = None  # xxh3 of the current tensor's bytes, when it has a digest to match
        self._skip_empty()

    def _skip_empty(self) -> None:
        # a tensor with no elements has no chunk; its checksum is that of no bytes
        while self.index < len(self.m.tensors) and self.m.tensors[self.index].nbytes == 0:
            self._close_tensor()

    def _close_tensor(self) -> None:
        t = self.m.tensors[self.index]
        if self.closed is not None:
            self.closed(self.index)
        elif self.crc != t.crc32:
            raise _crc_error(t, self.crc)
        if t.digest and t.encoding == DENSE:
            got = self.hasher.hexdigest() if self.hasher is not None else digest_of(b"")
            if got != t.digest:
                raise InvalidArgument(
                    f"tensor {t.name!r}: xxh3 of the received bytes is {got}, the manifest says {t.digest} "
                    "(corrupted before it was sent, or in transit?); the push is refused, the current "
                    "weights are kept"
                )
        self.index, self.offset, self.crc, self.hasher = self.index + 1, 0, 0, None

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
        self.put(index, offset, data)
        if t.digest and t.encoding == DENSE:
            if self.hasher is None:
                import xxhash

                self.hasher = xxhash.xxh3_64()
            self.hasher.update(data)
        if self.closed is None:
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

    async def consume(self, chunks: Chunks) -> None:
        async for index, offset, data in chunks:
            # A 4 MiB copy (or write to the page cache) takes about a millisecond: not worth a thread hop.
            self.write(index, offset, data)
        self.finish()


# Bytes promised to pushes being received now, by where they go ("memory", or the spool's filesystem):
# a push's check counts what the others will still write, so two concurrent pushes that each fit the
# free space but not together are not both accepted (the second is refused before it receives a byte).
# Only the event loop touches it. A push's reservation ends when it is received (its bytes are then in
# the free-space figures) or refused.
_reserved: dict[str, int] = {}


@contextlib.contextmanager
def reserved(where: str, nbytes: int, free: int | None, margin: int, place: str, advice: str):
    """Hold `nbytes` of `where` for the block; FailedPrecondition naming `place` and `advice` if they do
    not fit `free` (None: unknown, nothing checked) less the margin and what other pushes hold."""
    held = _reserved.get(where, 0)
    if free is not None and nbytes + margin + held > free:
        others = f", {held} of them reserved by pushes being received now" if held else ""
        raise FailedPrecondition(
            f"the pushed weights ({nbytes} bytes) do not fit in {place} ({free} bytes{others}); {advice}"
        )
    _reserved[where] = held + nbytes
    try:
        yield
    finally:
        _reserved[where] -= nbytes
        if not _reserved[where]:
            del _reserved[where]


def check_manifest(manifest: WeightsManifest) -> None:
    for t in manifest.tensors:
        if len(t.name) > MAX_TENSOR_NAME_CHARS:
            raise InvalidArgument(
                f"PushWeights manifest: tensor {shown(t.name)}: the name has {len(t.name)} characters; "
                f"at most {MAX_TENSOR_NAME_CHARS}"
            )
    try:
        manifest.check()
    except ValueError as e:
        raise InvalidArgument(f"PushWeights manifest: {e}") from e


async def receive_file(manifest: WeightsManifest, rest: Chunks, spool: Path | None = None) -> Path:
    """Write the pushed tensors (the chunks `rest` that follow `manifest`) into a new directory under the
    spool; returns that directory, holding one `model.safetensors`. The caller deletes it (`discard`).
    On any error — including cancellation, a dropped connection — the directory is gone."""
    spool = spool or spool_root()
    spool.mkdir(parents=True, exist_ok=True)
    check_manifest(manifest)
    place, advice = f"the spool {str(spool)!r}", f"give the replica more local disk or set {SPOOL_ENV}"
    free = shutil.disk_usage(spool).free
    with reserved(f"disk:{os.stat(spool).st_dev}", manifest.total_bytes, free, DISK_MARGIN, place, advice):
        directory = Path(tempfile.mkdtemp(prefix=f"push-v{manifest.version}-", dir=spool))
        await _receive_file(manifest, rest, directory)
    return directory


async def _receive_file(manifest: WeightsManifest, rest: Chunks, directory: Path) -> None:
    try:
        with open(directory / FILE_NAME, "wb") as f:
            f.write(safetensors_header(manifest.tensors))
            # the writer checked the order: the bytes of the file are the chunks back to back
            await Writer(manifest, lambda _i, _o, data: f.write(data)).consume(rest)
    except BaseException:
        # Not in a thread: the call may be cancelled right now (the client went away), and an awaited
        # clean-up would be cancelled with it. Unlinking one file takes milliseconds.
        discard(directory)
        raise


def memory_available() -> int | None:
    """Bytes this process may still allocate: MemAvailable, or less where a cgroup v2 limit is nearer
    (a container's memory limit); None where neither can be read."""
    found = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError, ValueError):
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            # the cgroup's usage counts the page cache; its inactive part is reclaimed before an OOM kill
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            used = int((cgroup / "memory.current").read_text()) - int(stat.get("inactive_file", 0))
            found.append(int(limit) - used)
    return min(found) if found else None


async def receive_tensors(manifest: WeightsManifest, rest: Chunks) -> dict:
    """The pushed tensors (the chunks `rest` that follow `manifest`) as {name: CPU tensor of the
    manifest's dtype and shape}, each chunk copied once into its place. Nothing is kept on an error."""
    import torch

    check_manifest(manifest)
    place, advice = "this replica's free memory", "give it more memory"
    with reserved("memory", manifest.total_bytes, memory_available(), MEMORY_MARGIN, place, advice):
        return await _receive_tensors(manifest, rest, torch, checkpoints.torch_dtype)


async def _receive_tensors(manifest: WeightsManifest, rest: Chunks, torch, torch_dtype) -> dict:
    tensors = {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype)) for t in manifest.tensors}
    # uint8 views of the tensors' memory (numpy has no bfloat16), written in place: torch.empty leaves
    # the pages untouched until a chunk lands there, so memory grows with what was received
    raw = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors.values()]

    def put(index: int, offset: int, data: bytes) -> None:
        raw[index][offset : offset + len(data)] = np.frombuffer(data, np.uint8)

    # Each complete tensor is checksummed in one worker thread (zlib releases the GIL) while the event
    # loop copies in the next chunks: the CRC, about a sixth of the receiving CPU, leaves the critical
    # path on a machine with a core to spare, and costs the same where it has none.
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="maskroll-push-crc")
    sums: list[tuple[int, asyncio.Future]] = []

    def closed(index: int) -> None:
        sums.append((index, loop.run_in_executor(pool, zlib.crc32, raw[index])))

    try:
        await Writer(manifest, put, closed).consume(rest)
        for i, pending in sums:
            got = await pending
            if got != manifest.tensors[i].crc32:
                raise _crc_error(manifest.tensors[i], got)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return tensors


def discard(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


@dataclass(frozen=True)
class StreamedSource:
    """A received push (weights/updates.py loads it): in memory (`tensors`) or in the spool (`directory`)."""

    manifest: WeightsManifest
    directory: Path | None = None  # in the spool, holding FILE_NAME
    tensors: dict | None = None  # {name: tensor} received into memory; the engine consumes the dict

    def describe(self) -> str:
        where = "memory" if self.directory is None else "the spool"
        n, mb = len(self.manifest.tensors), self.manifest.total_bytes / 1e6
        return f"a push of {n} tensors ({mb:.1f} MB, received into {where})"

    async def load(self, engine: Engine, version: int) -> tuple[int, float]:
        """Load and make `version` current: (paused requests, seconds); InvalidArgument for bad content,
        the old weights still serving."""
        if self.tensors is not None:
            result = await _load_tensors(engine, version, self.tensors)
        else:
            try:
                result = await checkpoints.load_checkpoint(
                    engine, version, checkpoints.checkpoint_of(self.directory)
                )
            except InvalidArgument as e:
                # the message names the spool file; the caller knows the push, not that file
                raise InvalidArgument(f"pushed weights of version {version} refused: {e}") from e
        return result

    def release(self) -> None:
        """Free what the push holds here once it is loaded or refused: a refused spool file, the tensors
        the engine did not consume."""
        if self.directory is not None and self.directory not in _serving_spool.values():
            discard(self.directory)
        if self.tensors is not None:
            self.tensors.clear()


# The spool directory each engine (by id) serves its weights from. An engine that loads files (vLLM)
# restores the served weights from them after a failed update (vllm_engine._recover), so the spool file
# of the last successful push stays until another update succeeds: one model on the replica's own disk.
_serving_spool: dict[int, Path] = {}


def now_serving(engine: Engine, source: object) -> None:
    """After any successful load (weights/updates.py): keep `source`'s spool file if it is a push received
    into one, and delete the file of the push served before, whatever replaced it."""
    previous = _serving_spool.pop(id(engine), None)
    if isinstance(source, StreamedSource) and source.directory is not None:
        _serving_spool[id(engine)] = source.directory
    if previous is not None:
        discard(previous)


async def receive(engine: Engine, manifest: WeightsManifest, rest: Chunks) -> StreamedSource:
    """Receive a push (the chunks `rest` after `manifest`) where `engine` loads it from best."""
    if engine.weight_capabilities.tensors:
        return StreamedSource(manifest, tensors=await receive_tensors(manifest, rest))
    return StreamedSource(manifest, directory=await receive_file(manifest, rest))


async def _load_tensors(engine: Engine, version: int, tensors: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    try:
        paused = await engine.update_weights_from_tensors(version, tensors, "the pushed weights")
    except ServiceError:
        raise
    except checkpoints.load_errors() as exc:
        raise InvalidArgument(
            f"pushed weights of version {version} refused: {type(exc).__name__}: {exc}"
        ) from exc
    return paused, time.perf_counter() - t0
