"""`trim_heap`: give freed heap memory back to the system — what both ends of a weight push need.

glibc raises its mmap threshold to the size of the largest block freed (up to 32 MiB), so after one
update most weight tensors and every chunk-sized buffer of a push (gRPC's, the message's, its bytes) come
from its arenas, which keep freed memory. Without a trim the replica kept the replaced weights resident
after a directory update (RSS + one model until the next update) and a push left tens of MB behind
(bench/weights.py); on the trainer side, a sharded publish's RSS climbed by up to a shard though one
gathered parameter was alive at a time (bench/learner.py). Standard library only (ctypes).
"""

from __future__ import annotations

import functools


def trim_heap() -> None:
    """glibc's malloc_trim(0); elsewhere (musl, macOS) nothing."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc: nothing to trim
        return None
