"""The vLLM engine's checkpoint guard on real files (no engine needed: `check_checkpoint` runs before the
engine is paused): non-finite tensors, FIFOs and files swapped after the path check are refused, so the
live model — which vLLM reloads layer by layer, in place — is never touched by them."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from maskroll.server.errors import InvalidArgument, PermissionDenied
from maskroll.server.weights import checkpoints as weights
from maskroll.server.weights.tensor_rules import check_checkpoint


@pytest.fixture
def root(tmp_path):
    ref = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    for name, tensors in {
        "ref": ref,
        "good": {"a": torch.ones(2, 3), "b": torch.ones(4)},
        "nan": {"a": torch.ones(2, 3), "b": torch.tensor([1.0, float("nan"), float("nan"), 2.0])},
        "inf": {"a": torch.full((2, 3), float("inf")), "b": torch.ones(4)},
    }.items():
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
    return tmp_path


def test_a_good_checkpoint_passes(root):
    check_checkpoint(weights.resolve_checkpoint("good", root), root / "ref")


@pytest.mark.parametrize(
    ("name", "needle"), [("nan", "'b' in .* has 2 non-finite"), ("inf", "'a' in .* has 6")]
)
def test_non_finite_tensors_are_refused(root, name, needle):
    with pytest.raises(ValueError, match=needle):
        check_checkpoint(weights.resolve_checkpoint(name, root), root / "ref")


def test_a_fifo_is_refused_without_being_opened(root):
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "model.safetensors")
    with pytest.raises(InvalidArgument, match="is a FIFO"):
        check_checkpoint(weights.resolve_checkpoint("fifo", root), root / "ref")
    with pytest.raises(InvalidArgument, match="is a FIFO"):  # a trusted path given directly, too
        check_checkpoint(root / "fifo", root / "ref")


def test_a_file_swapped_after_the_check_is_refused(root, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    save_file({"a": torch.ones(2, 3), "b": torch.ones(4)}, str(outside / "model.safetensors"))
    checked = weights.resolve_checkpoint("good", root)
    (root / "good" / "model.safetensors").unlink()
    os.symlink(outside / "model.safetensors", root / "good" / "model.safetensors")
    with pytest.raises(PermissionDenied, match="changed after it was checked"):
        check_checkpoint(checked, root / "ref")
