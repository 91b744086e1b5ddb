"""What every part of the protobuf ⇄ domain converter shares (`wire` re-exports it, so callers import one
converter): its error (`WireError`), arrays as packed little-endian bytes (`pack` / `unpack`, the dtypes
they travel as), and `Semantics` both ways — a record's, and a Score result's.

Its own module so that `wire_score` builds on it without importing `wire`, which re-exports `wire_score`
(a cycle either module could be imported first into).
"""

from __future__ import annotations

import math

import numpy as np

from ._generated import rollout_pb2 as pb
from .records import Semantics

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")


class WireError(ValueError):
    """A payload that does not decode to a valid maskroll message."""


def pack(a: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def unpack(data: bytes, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise WireError(f"{what}: {len(data)} bytes, expected {expected} for shape {shape}")
    # frombuffer is a zero-copy read-only view; astype gives native-endian, writable arrays.
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


def semantics_to_pb(s: Semantics) -> pb.Semantics:
    return pb.Semantics(**s.__dict__)


def semantics_from_pb(m: pb.Semantics) -> Semantics:
    return Semantics(
        logprobs_mode=m.logprobs_mode,
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        logprobs_k=m.logprobs_k,
        engine=m.engine,
        engine_version=m.engine_version,
        model=m.model,
    )
