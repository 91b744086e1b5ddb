"""Which checkpoint files UpdateWeights may load, how they are opened, and what a failed load means.

A checkpoint path must resolve — after `realpath`, so `..` and symlinks count — to a directory under the
configured `weights_root`, and so must every *.safetensors file in it (a symlinked file pointing
elsewhere is refused too); each must be a regular file (a FIFO would block the reader forever).
`resolve_checkpoint` does that check once and returns a `Checkpoint`: the real directory and the files
it checked, by real path and inode. Engines then open exactly those files (`open_checked`), walking
every path component without following a symlink and comparing inodes, so a file swapped for a symlink
or another file between the check and the load is refused instead of loaded. Without a weights_root,
UpdateWeights is refused: a bare server loads nothing it was not told to trust. Knows nothing of gRPC;
the errors are translated at the RPC boundary.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from maskroll.proto.safetensors_layout import TORCH_NAMES

from ..engines.contract import Engine
from ..errors import InvalidArgument, PermissionDenied, ServiceError, shown

SUFFIX = ".safetensors"
MAX_PATH_CHARS = 4096  # PATH_MAX: a longer checkpoint.path names no file


@dataclass(frozen=True)
class CheckedFile:
    name: str  # the entry in the checkpoint directory
    real: Path  # its real path: the file itself, or a symlink's target (under the root)
    dev: int  # identity at check time: what is opened later must be this very file
    ino: int


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory as `resolve_checkpoint` checked it. Reads as its path (str, os.fspath)."""

    path: Path  # the real directory
    files: tuple[CheckedFile, ...]

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _safetensors_names(directory: str | int) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX))


def _regular(st: os.stat_result, label: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else ""
        raise InvalidArgument(
            f"{label} is {kind or 'not a regular file'}; checkpoint files must be regular files"
        )


def resolve_checkpoint(path: str, root: Path | None) -> Checkpoint:
    """The checkpoint directory `path` (absolute, or relative to `root`) and its files, checked."""
    if root is None:
        raise PermissionDenied("UpdateWeights is disabled: the server was started without a weights_root")
    if not path:
        raise InvalidArgument("checkpoint.path is empty")
    if len(path) > MAX_PATH_CHARS:
        raise InvalidArgument(f"checkpoint.path has {len(path)} characters; at most {MAX_PATH_CHARS}")
    if "\x00" in path:
        raise InvalidArgument("checkpoint.path contains a NUL byte")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))  # join keeps `path` when it is absolute
    if not _under(real, real_root):
        raise PermissionDenied(
            f"checkpoint.path {shown(path, 256)} is not under the server's weights_root {str(root)!r}"
        )
    if not os.path.isdir(real):
        raise InvalidArgument(f"checkpoint.path {shown(path, 256)} is not a directory")
    names = _safetensors_names(real)
    if not names:
        raise InvalidArgument(f"checkpoint.path {shown(path, 256)} contains no *.safetensors files")
    files = []
    shown_path = shown(path, 256)
    for name in names:
        target = os.path.realpath(os.path.join(real, name))
        if not _under(target, real_root):
            raise PermissionDenied(f"checkpoint.path {shown_path}: {name} links outside the weights_root")
        st = os.stat(target)  # never opens: a FIFO is only looked at
        _regular(st, f"checkpoint.path {shown_path}: {name}")
        files.append(CheckedFile(name, Path(target), st.st_dev, st.st_ino))
    return Checkpoint(Path(real), tuple(files))


def checkpoint_of(directory: str | os.PathLike) -> Checkpoint:
    """A trusted directory (an engine called directly: tests, benchmarks) as a Checkpoint: its regular
    *.safetensors files, symlinks resolved, with no weights_root to check them against."""
    if isinstance(directory, Checkpoint):
        return directory
    real = os.path.realpath(directory)
    if not os.path.isdir(real):
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    files = []
    for name in _safetensors_names(real):
        target = os.path.realpath(os.path.join(real, name))
        st = os.stat(target)
        _regular(st, f"{directory}/{name}")
        files.append(CheckedFile(name, Path(target), st.st_dev, st.st_ino))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    return Checkpoint(Path(real), tuple(files))


def _open_nofollow(real: Path, *, directory: bool = False) -> int:
    """Open an absolute real path component by component, never following a symlink: ELOOP / ENOTDIR
    if any component became a symlink since the path was resolved. O_NONBLOCK: opening a FIFO must not
    wait for a writer (the caller refuses it after fstat)."""
    parts = real.parts
    fd = os.open(parts[0], os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts[1:], start=1):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            flags |= os.O_DIRECTORY if (directory or not last) else os.O_NONBLOCK
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def open_checked(checkpoint: Checkpoint) -> Iterator[list[tuple[CheckedFile, int]]]:
    """The checkpoint's files opened for reading, each verified to be the file that was checked (same
    inode, reached with no symlink): (file, fd) pairs, closed on exit. Refuses, with PermissionDenied,
    a file or directory swapped since the check and a *.safetensors entry added since."""
    label = f"checkpoint {str(checkpoint.path)!r}"
    opened: list[tuple[CheckedFile, int]] = []
    try:
        try:
            dfd = _open_nofollow(checkpoint.path, directory=True)
        except OSError as e:
            raise PermissionDenied(
                f"{label} changed after it was checked (a symlink swapped in?): {e}"
            ) from e
        try:
            names = _safetensors_names(dfd)
        finally:
            os.close(dfd)
        if names != [f.name for f in checkpoint.files]:
            raise PermissionDenied(f"{label}: its *.safetensors files changed after it was checked: {names}")
        for f in checkpoint.files:
            try:
                fd = _open_nofollow(f.real)
            except OSError as e:
                raise PermissionDenied(
                    f"{label}: {f.name} changed after it was checked (a symlink swapped in?): {e}"
                ) from e
            opened.append((f, fd))
            st = os.fstat(fd)
            _regular(st, f"{label}: {f.name}")
            if (st.st_dev, st.st_ino) != (f.dev, f.ino):
                raise PermissionDenied(f"{label}: {f.name} was replaced after it was checked")
        yield opened
    finally:
        for _, fd in opened:
            os.close(fd)


def fd_path(fd: int, fallback: Path) -> str:
    """A path that opens the file behind `fd` itself (Linux /proc/self/fd), for readers that take a
    path (safetensors mmaps it); elsewhere the checked real path (a narrow race remains there)."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(fallback)


MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name (F32, BF16, ...); KeyError for an unknown one."""
    import torch

    return getattr(torch, TORCH_NAMES[name])


def read_safetensors(fd: int, label: str) -> Iterator[tuple[str, object]]:
    """The tensors of the safetensors file open at `fd`, one at a time, each read with plain reads into
    its own new tensor: no mmap, so the file's pages never count in this process's RSS and the reader
    holds one copy of the weights, not two (safetensors' load_file maps the file and copies out of
    it). ValueError naming `label` for a malformed or truncated file."""
    import json

    import torch

    def exact(n: int, what: str) -> bytes:
        data = os.pread(fd, n, pos[0])
        if len(data) != n:
            raise ValueError(f"{label} is truncated: {what} needs {n} bytes, {len(data)} left")
        pos[0] += n
        return data

    pos = [0]
    (size,) = struct.unpack("<Q", exact(8, "the header length"))
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"{label} is not a safetensors file (header length {size})")
    try:
        header = json.loads(exact(size, "the header"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{label} is not a safetensors file: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{label} is not a safetensors file (header is not an object)")
    base = pos[0]
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = torch_dtype(meta["dtype"])
            shape = [int(d) for d in meta["shape"]]
            start, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{label}: tensor {name!r} has a malformed header entry {meta!r}") from e
        t = torch.empty(shape, dtype=dtype)
        nbytes = t.numel() * t.element_size()
        if end - start != nbytes:
            raise ValueError(f"{label}: tensor {name!r} spans {end - start} bytes, its shape needs {nbytes}")
        buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        got, off = 0, base + start
        while got < nbytes:  # preadv may return less than asked for large reads
            n = os.preadv(fd, [buf[got:]], off + got)
            if n == 0:
                raise ValueError(f"{label} is truncated in tensor {name!r}: {got} of {nbytes} bytes")
            got += n
        yield name, t


def load_errors() -> tuple[type[Exception], ...]:
    # What a loader raises for bad *content*: truncated or foreign files (SafetensorError, OSError),
    # missing tensors (KeyError), wrong shapes, dtypes or non-finite values (RuntimeError, ValueError).
    # Anything else is a bug in the engine and stays INTERNAL.
    from safetensors import SafetensorError

    return (SafetensorError, OSError, KeyError, ValueError, RuntimeError, EOFError)


async def load_checkpoint(engine: Engine, version: int, checkpoint: Checkpoint | Path) -> tuple[int, float]:
    """Load and make `version` current; returns (paused requests, seconds). Bad content →
    InvalidArgument, with the engine still serving the previous weights (the engine loads atomically);
    a file swapped since the check → PermissionDenied; a dead engine → EngineDead (UNAVAILABLE)."""
    t0 = time.perf_counter()
    try:
        paused = await engine.update_weights(version, checkpoint)
    except ServiceError:
        raise  # already says what is wrong (a file swapped after the check)
    except load_errors() as exc:
        raise InvalidArgument(
            f"checkpoint.path {str(checkpoint)!r} could not be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    return paused, time.perf_counter() - t0
