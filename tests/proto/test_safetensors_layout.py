"""proto/safetensors_layout.py: the dtype tables against torch and the safetensors library's own names,
and the header byte for byte against the library's output for the same tensors."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from maskroll.proto.safetensors_layout import (
    ITEM_SIZES,
    METADATA,
    SAFETENSORS_NAMES,
    TORCH_NAMES,
    safetensors_header,
)
from maskroll.proto.tensor_push import TensorSpec


def _library_header(data: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def test_the_tables_name_the_same_dtypes_and_invert_each_other() -> None:
    assert set(TORCH_NAMES) == set(ITEM_SIZES) == set(SAFETENSORS_NAMES.values())
    assert len(SAFETENSORS_NAMES) == len(TORCH_NAMES) == 12  # one torch name per safetensors name
    for name, torch_name in TORCH_NAMES.items():
        assert SAFETENSORS_NAMES[torch_name] == name
    assert TORCH_NAMES["BF16"] == "bfloat16" and SAFETENSORS_NAMES["float8_e4m3fn"] == "F8_E4M3"


@pytest.mark.parametrize("name", sorted(TORCH_NAMES))
def test_each_name_is_torchs_dtype_and_the_librarys_name_of_it(name: str) -> None:
    dtype = getattr(torch, TORCH_NAMES[name])  # the one way the torch side maps a name
    assert isinstance(dtype, torch.dtype)
    assert torch.empty((), dtype=dtype).element_size() == ITEM_SIZES[name]
    # safetensors itself names this dtype so: save one 3-element tensor, read its header
    _, header = _library_header(st_save({"t": torch.zeros(3, dtype=dtype)}))
    assert header["t"]["dtype"] == name
    assert header["t"]["data_offsets"] == [0, 3 * ITEM_SIZES[name]]


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "model.norm.weight": torch.ones(5, dtype=torch.bfloat16),
        "lm_head.bias": torch.zeros(0, dtype=torch.float16),  # no bytes: an empty slot in the offsets
        "scale": torch.tensor(2.5, dtype=torch.float64),  # shape []
        "mask": torch.tensor([True, False, True]),
        "ids": torch.tensor([[1, 2], [3, 4]], dtype=torch.int64),
        "q": torch.zeros(7, dtype=torch.float8_e4m3fn),
    }


def _spec(name: str, t: torch.Tensor) -> TensorSpec:
    st = SAFETENSORS_NAMES[str(t.dtype).removeprefix("torch.")]
    return TensorSpec(name, st, tuple(t.shape), t.numel() * ITEM_SIZES[st])


def test_the_header_is_the_librarys_byte_for_byte() -> None:
    everything = _tensors()
    padding = set()
    for n_tensors in range(1, len(everything) + 1):  # headers of several lengths: padded and not
        tensors = dict(list(everything.items())[:n_tensors])
        data = st_save(tensors, metadata=METADATA)
        n, header = _library_header(data)
        # the library writes the tensors in an order of its own (alignment, then name): ours in the same
        order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        ours = safetensors_header(_spec(k, tensors[k]) for k in order)
        assert ours == data[: 8 + n]
        assert n % 8 == 0  # the data section starts 8-aligned
        padding.add(n - len(data[8 : 8 + n].rstrip(b" ")))
    assert len(padding) > 1  # some of these headers needed spaces, some none


def test_a_file_with_this_header_is_one_the_library_reads() -> None:
    tensors = _tensors()
    specs = [_spec(k, t) for k, t in tensors.items()]  # state-dict order, as the trainer writes it
    body = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
    loaded = st_load(safetensors_header(specs) + body)
    assert list(loaded) != [] and set(loaded) == set(tensors)
    for k, t in tensors.items():
        assert loaded[k].dtype == t.dtype and loaded[k].shape == t.shape
        assert torch.equal(loaded[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_offsets_run_back_to_back_in_the_order_given() -> None:
    specs = [
        TensorSpec("a", "F32", (2, 3), 24),
        TensorSpec("b", "BF16", (5,), 10),
        TensorSpec("c", "U8", (), 1),
    ]
    raw = safetensors_header(specs)
    (n,) = struct.unpack("<Q", raw[:8])
    assert n == len(raw) - 8 and n % 8 == 0
    header = json.loads(raw[8:])
    assert header == {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [5], "data_offsets": [24, 34]},
        "c": {"dtype": "U8", "shape": [], "data_offsets": [34, 35]},
    }
    assert list(header) == ["__metadata__", "a", "b", "c"]


def test_the_manifest_checks_sizes_with_the_same_table() -> None:
    TensorSpec("w", "BF16", (3, 4), 24).check()  # 12 elements x 2 bytes
    with pytest.raises(ValueError, match=r"nbytes 48 != 24 \(shape \[3, 4\] of BF16\)"):
        TensorSpec("w", "BF16", (3, 4), 48).check()
    with pytest.raises(ValueError, match="dtype 'F4' is not one of"):
        TensorSpec("w", "F4", (3,), 3).check()
