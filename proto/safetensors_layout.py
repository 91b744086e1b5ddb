"""The safetensors layout both sides write and read: the dtype names (safetensors' own, F32, BF16, ...)
with their item sizes and torch names, and the prefix of a file that holds tensors back to back.

A push's manifest names dtypes as safetensors does (`tensor_push.TensorSpec`); the trainer writes a
version's file from its tensors (`weight_sync.sharded`, `weight_sync.stream`) and the replica spools a
push into one (`server/weights`), so the two must write the same header for the same tensors, and both
must turn a name into a torch dtype alike. Stdlib only, so it names torch dtypes by their attribute name:
the torch side maps them with `getattr(torch, TORCH_NAMES[name])`. Knows nothing of torch, files or the
wire.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tensor_push import TensorSpec

# safetensors dtype name -> torch's name for it (getattr(torch, name)): every dtype a push may carry
TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
# torch's name -> the safetensors name (the inverse: one safetensors name per torch dtype)
SAFETENSORS_NAMES = {torch_name: name for name, torch_name in TORCH_NAMES.items()}
# safetensors dtype name -> bytes per element
ITEM_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# The header's metadata as transformers' save_pretrained writes it: the framework that wrote the file
METADATA = {"format": "pt"}


def safetensors_header(tensors: Iterable[TensorSpec]) -> bytes:
    """The safetensors prefix — u64 little-endian header length, then the JSON header padded with spaces
    to a multiple of 8 bytes (safetensors aligns the data section to 8) — of a file that holds `tensors`'
    bytes back to back in the order given. Only each spec's name, dtype, shape and nbytes are read."""
    header: dict = {"__metadata__": METADATA}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
