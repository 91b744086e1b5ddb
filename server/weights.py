"""Which checkpoint directories UpdateWeights may load, and what a failed load means for the client.

A checkpoint path must resolve — after `realpath`, so `..` and symlinks count — to a directory under the
configured `weights_root`, and so must every file in it (a symlinked *.safetensors pointing elsewhere is
refused too). Without a weights_root, UpdateWeights is refused: a bare server loads nothing it was not
told to trust. Knows nothing of gRPC; the errors are translated at the RPC boundary.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .engine import Engine
from .errors import InvalidArgument, PermissionDenied


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def resolve_checkpoint(path: str, root: Path | None) -> Path:
    """The real path of checkpoint directory `path` (absolute, or relative to `root`), checked."""
    if root is None:
        raise PermissionDenied("UpdateWeights is disabled: the server was started without a weights_root")
    if not path:
        raise InvalidArgument("checkpoint.path is empty")
    if "\x00" in path:
        raise InvalidArgument("checkpoint.path contains a NUL byte")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))  # join keeps `path` when it is absolute
    if not _under(real, real_root):
        raise PermissionDenied(
            f"checkpoint.path {path!r} is not under the server's weights_root {str(root)!r}"
        )
    if not os.path.isdir(real):
        raise InvalidArgument(f"checkpoint.path {path!r} is not a directory")
    files = sorted(Path(real).glob("*.safetensors"))
    if not files:
        raise InvalidArgument(f"checkpoint.path {path!r} contains no *.safetensors files")
    for f in files:
        if not _under(os.path.realpath(f), real_root):
            raise PermissionDenied(f"checkpoint.path {path!r}: {f.name} links outside the weights_root")
    return Path(real)


def _load_errors() -> tuple[type[Exception], ...]:
    # What a loader raises for bad *content*: truncated or foreign files (SafetensorError, OSError),
    # missing tensors (KeyError), wrong shapes or dtypes (RuntimeError, ValueError). Anything else is
    # a bug in the engine and stays INTERNAL.
    from safetensors import SafetensorError

    return (SafetensorError, OSError, KeyError, ValueError, RuntimeError, EOFError)


async def load_checkpoint(engine: Engine, version: int, checkpoint_dir: Path) -> tuple[int, float]:
    """Load and make `version` current; returns (paused requests, seconds). Bad content →
    InvalidArgument, with the engine still serving the previous weights (the engine loads atomically)."""
    t0 = time.perf_counter()
    try:
        paused = await engine.update_weights(version, checkpoint_dir)
    except _load_errors() as exc:
        raise InvalidArgument(
            f"checkpoint.path {str(checkpoint_dir)!r} could not be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    return paused, time.perf_counter() - t0
