"""A model sharded across trainer ranks (FSDP2: its parameters are DTensors), written out one parameter at
a time into the checkpoint layout's safetensors file, and that file read back in chunks for PushWeights.

Every rank walks the state dict in its own order (the module tree's: identical on every rank) and joins
one gather per sharded tensor (`DTensor.full_tensor()`, an all-gather over the model's mesh: NCCL on
GPUs, gloo on CPU). Rank 0 copies each full tensor to the CPU, appends its bytes to the file, checksums
them and drops it; the other ranks drop theirs at once. So one parameter at a time is alive on any rank
(plus, on rank 0 of a GPU model, its CPU copy), never the model — gloo's all-gather itself peaks at twice
its output, and the heap is trimmed after each tensor (measured: docs/benchmarks.md "Learner: ranks and
sharded publishing"). The file's pages belong to the page cache, which the kernel writes back and
reclaims, not to the process.

Why a file and not the gathered tensors straight into the replicas' gRPC streams: a push's manifest,
its first message, carries every tensor's CRC-32 (the replica refuses a push whose bytes do not match:
server/weights/receive.py), known only once the last byte was gathered; holding the tensors until then
would be the whole model. Writing first keeps the wire contract as it is and also gives: (a) every
replica reads at its own pace (a slow one never holds the other ranks in a collective), (b) the
publisher's follower sends the same file to replicas that join later (by then the model has moved on
and the other ranks are training: no gather is possible), (c) with `save_root` it *is* the resume copy
(`<root>/v<version>/model.safetensors`, loaded by `checkpoint.load_checkpoint` or `load_sharded`). The
cost: the push starts after the gather, not during it — as a plain model's snapshot precedes its push.

The file is the safetensors layout (8-byte header length, JSON header, tensors back to back in
state-dict order) written with its header first (`proto.safetensors_layout`, the same bytes as the
replica's spool of a push), which needs only names, dtypes and global shapes: the DTensors' metadata, no
gather. Knows nothing of queues, replicas or gRPC.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from maskroll.proto.heap import trim_heap
from maskroll.proto.safetensors_layout import TORCH_NAMES, safetensors_header
from maskroll.proto.tensor_push import DEFAULT_CHUNK_BYTES, TensorSpec, WeightsManifest, digest_of
from maskroll.proto.weights_fingerprint import sample_indices, weights_fingerprint

from .checkpoint import CHECKPOINT_FILE

State = Mapping[str, torch.Tensor]


def _dtensor_type():
    from torch.distributed.tensor import DTensor  # loaded on use: a plain trainer never needs it

    return DTensor


def state_of(model: State | torch.nn.Module) -> State:
    """A module's state dict (FSDP2: DTensor shards, no communication), or the mapping given."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    if not state:
        raise ValueError("the state dict is empty: nothing to publish")
    return state


def is_sharded(model: State | torch.nn.Module) -> bool:
    """True when some tensor of the state dict is a DTensor (FSDP2's `fully_shard`, or tensor parallel):
    no rank holds the whole model, so publishing it is a collective of every rank."""
    if not torch.distributed.is_available():
        return False
    dtensor = _dtensor_type()
    return any(isinstance(t, dtensor) for t in state_of(model).values())


# torch dtype -> its safetensors name: the dtypes a push may carry (proto's table, by torch's names)
SAFETENSORS_DTYPES = {getattr(torch, torch_name): name for name, torch_name in TORCH_NAMES.items()}


def dtype_name(name: str, dtype: torch.dtype) -> str:
    """The safetensors name of tensor `name`'s dtype; ValueError naming it for one a push cannot carry."""
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {dtype}, which cannot be pushed")
    return SAFETENSORS_DTYPES[dtype]


def specs_of(state: State) -> list[TensorSpec]:
    """Name, safetensors dtype, global shape and size of every tensor, from metadata alone (a DTensor's
    shape is the global one): what the file's header needs before any byte is gathered. CRC-32 0."""
    specs = []
    for name, t in state.items():
        dtype = dtype_name(name, t.dtype)
        specs.append(TensorSpec(name, dtype, tuple(t.shape), t.numel() * t.element_size()))
    return specs


def gathered(state: State, keep: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, the whole tensor: CPU, contiguous) in state-dict order, one at a time; `keep=False` (every
    rank but the writer) yields None after joining the gather. A collective: every rank of the mesh must
    iterate to the end, in step (a rank that stops early leaves the others waiting in an all-gather)."""
    dtensor = _dtensor_type()
    for name, t in state.items():
        if isinstance(t, dtensor):
            t = t.full_tensor()  # the all-gather: every rank, this tensor only
        elif not keep:
            yield name, None
            continue
        if not keep:
            del t
            trim_heap()
            yield name, None
            continue
        yield name, t.detach().to("cpu").contiguous()
        del t
        trim_heap()  # the caller dropped its reference before asking for the next tensor


def raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (CPU, contiguous): view(uint8) first, numpy has no bfloat16."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _storage_key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    # Tied tensors (lm_head = embed_tokens) share storage; for a DTensor, its local shard's. The same
    # rule as fingerprint.model_fingerprint, which needs storage a full gathered copy no longer shares.
    local = t.to_local() if isinstance(t, _dtensor_type()) else t
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape))


@dataclass(frozen=True)
class WrittenVersion:
    """A version written by `write_gathered`: its file, the push manifest (CRC-32s of the bytes written)
    and the weights fingerprint (proto/weights_fingerprint.py) of the whole model."""

    path: Path
    manifest: WeightsManifest
    fingerprint: str

    def chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tuple[int, int, bytes]]:
        """(tensor index, byte offset, bytes) of every tensor in manifest order, at most `chunk_bytes`
        each, read from the file: one chunk in memory per reader (each replica's stream has its own)."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            pos = 8 + header_len
            for index, spec in enumerate(self.manifest.tensors):
                for offset in range(0, spec.nbytes, chunk_bytes):
                    n = min(chunk_bytes, spec.nbytes - offset)
                    data = os.pread(f.fileno(), n, pos + offset)
                    if len(data) != n:
                        raise OSError(
                            f"{self.path} ends inside tensor {spec.name!r} (truncated since written?)"
                        )
                    yield index, offset, data
                pos += spec.nbytes


def write_gathered(
    model: State | torch.nn.Module, path: str | os.PathLike | None, version: int = 0
) -> WrittenVersion | None:
    """Gather `model` one tensor at a time and, where `path` is given (rank 0 only), write it there as one
    safetensors file (under a temporary name, renamed when complete: a reader never sees half a file).
    Every rank of the model's mesh calls it; the ranks with `path=None` only join the gathers and get
    None. Returns the file, its manifest (as `version`, with a CRC-32 and an xxh3 digest per tensor) and the
    fingerprint.
    A file that cannot be written (a full disk) raises OSError on the writer only, after the last
    gather: the other ranks are never left waiting in one (the caller broadcasts the outcome)."""
    state = state_of(model)
    specs = specs_of(state)  # before any gather: a dtype that cannot be pushed fails on every rank alike
    if path is None:
        for _ in gathered(state, keep=False):
            pass
        return None
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    crcs, sums, items, seen = [], [], [], set()
    keys = [_storage_key(t) for t in state.values()]
    error: BaseException | None = None
    f = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, "wb")  # noqa: SIM115 (closed below, after the gathers that must all run)
        f.write(safetensors_header(specs))
    except OSError as e:
        error = e
    try:
        for (name, full), spec, key in zip(gathered(state, keep=True), specs, keys, strict=True):
            if error is not None:
                continue  # still in every gather; the tensor is dropped with the next one
            if tuple(full.shape) != spec.shape:  # a DTensor whose global shape lied: never push it
                error = ValueError(f"tensor {name!r} gathered as {tuple(full.shape)}, expected {spec.shape}")
                continue
            data = raw(full)
            try:
                f.write(data)
            except OSError as e:
                error = e
                continue
            crcs.append(zlib.crc32(data))
            sums.append(digest_of(data))  # what the replica checks it loaded (xxh3: 22 GB/s)
            if full.is_floating_point() and key not in seen:
                seen.add(key)
                idx = torch.from_numpy(sample_indices(full.numel()))
                items.append((name, spec.shape, full.reshape(-1)[idx].to(torch.float32).numpy()))
            del full, data  # the one parameter this rank holds extra: gone before the next gather
    finally:
        if f is not None:
            f.close()
        if error is not None or len(crcs) != len(specs):
            tmp.unlink(missing_ok=True)
    if error is not None:
        raise error
    os.replace(tmp, path)
    tensors = tuple(
        TensorSpec(s.name, s.dtype, s.shape, s.nbytes, c, digest=d)
        for s, c, d in zip(specs, crcs, sums, strict=True)
    )
    return WrittenVersion(path, WeightsManifest(version=version, tensors=tensors), weights_fingerprint(items))


def version_file(directory: str | os.PathLike) -> Path:
    """The file of a version directory in the checkpoint layout."""
    return Path(directory) / CHECKPOINT_FILE


def load_sharded(model: torch.nn.Module, directory: str | os.PathLike | None, collective) -> None:
    """Load `<directory>/model.safetensors` into a sharded (or replicated, DDP) `model`, one tensor at a
    time: rank 0 reads each tensor (`directory` is read there only: rank 0's disk) and
    `distribute_tensor` scatters it, so each rank keeps its shard; plain tensors are broadcast whole.
    A collective: every rank calls it (ranks > 0 with directory=None). A file that does not match the
    model raises ValueError on every rank (the verdict travels through `collective` before any tensor)."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    dtensor = _dtensor_type()
    state = model.state_dict()
    reader, problem = None, None
    if collective.rank == 0:
        from safetensors import safe_open

        try:
            reader = safe_open(str(version_file(directory)), framework="pt")
            odd = set(state) ^ set(reader.keys())
            if odd:
                problem = f"the checkpoint in {directory} does not match the model: {sorted(odd)}"
        except OSError as e:
            problem = f"cannot read the checkpoint in {directory}: {e}"
    problem = collective.broadcast(problem)
    if problem is not None:
        raise ValueError(problem)
    with torch.no_grad():
        for name, t in state.items():
            device = t.to_local().device if isinstance(t, dtensor) else t.device
            full = reader.get_tensor(name).to(device, t.dtype) if reader is not None else None
            if isinstance(t, dtensor):
                src = full if full is not None else torch.empty(t.shape, dtype=t.dtype, device=device)
                shard = distribute_tensor(src, t.device_mesh, t.placements, src_data_rank=0)
                t.to_local().copy_(shard.to_local())
            else:
                src = full if full is not None else torch.empty_like(t)
                dist.broadcast(src, src=0)
                t.copy_(src)
            del full


def read_written(path: str | os.PathLike, version: int) -> WrittenVersion:
    """The WrittenVersion of a file already on disk (a resumed run's copy under save_root): its manifest
    with a CRC-32 per tensor and its fingerprint, reading one tensor at a time."""
    from safetensors import safe_open

    path = Path(path)
    specs, items, seen = [], [], set()
    with path.open("rb") as raw_file:
        (header_len,) = struct.unpack("<Q", raw_file.read(8))
        header = json.loads(raw_file.read(header_len))
    header.pop("__metadata__", None)
    # the file's own order (data offsets): chunks() sends its bytes in that order
    names = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    with safe_open(str(path), framework="pt") as f:
        for name in names:
            t = f.get_tensor(name).contiguous()
            data = raw(t)
            specs.append(
                TensorSpec(
                    name,
                    dtype_name(name, t.dtype),
                    tuple(t.shape),
                    data.nbytes,
                    zlib.crc32(data),
                    digest=digest_of(data),
                )
            )
            key = (header[name]["data_offsets"][0], tuple(t.shape))
            if t.is_floating_point() and key not in seen:
                seen.add(key)
                idx = torch.from_numpy(sample_indices(t.numel()))
                items.append((name, tuple(t.shape), t.reshape(-1)[idx].to(torch.float32).numpy()))
            del t, data
    return WrittenVersion(
        path, WeightsManifest(version=version, tensors=tuple(specs)), weights_fingerprint(items)
    )
