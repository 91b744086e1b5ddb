"""Which checkpoint paths UpdateWeights accepts: realpath under weights_root, no symlink escapes."""

from __future__ import annotations

import os

import pytest

from maskroll.server.errors import InvalidArgument, PermissionDenied
from maskroll.server.weights import resolve_checkpoint


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    (r / "ckpt").mkdir(parents=True)
    (r / "ckpt" / "model.safetensors").write_bytes(b"x")
    (r / "empty").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"x")
    return r


def test_absolute_and_relative_paths_under_the_root_resolve(root):
    assert resolve_checkpoint(str(root / "ckpt"), root) == root / "ckpt"
    assert resolve_checkpoint("ckpt", root) == root / "ckpt"
    assert resolve_checkpoint(str(root / "empty" / ".." / "ckpt"), root) == root / "ckpt"


def test_no_weights_root_refuses_everything(root):
    with pytest.raises(PermissionDenied, match="without a weights_root"):
        resolve_checkpoint(str(root / "ckpt"), None)


@pytest.mark.parametrize("path", ["../outside", "/etc", "ckpt/../../outside", "/"])
def test_paths_outside_the_root_are_permission_denied(root, path):
    with pytest.raises(PermissionDenied, match="not under the server's weights_root"):
        resolve_checkpoint(path, root)


def test_a_sibling_with_the_root_as_prefix_is_outside(root, tmp_path):
    (tmp_path / "root2").mkdir()
    with pytest.raises(PermissionDenied):
        resolve_checkpoint(str(tmp_path / "root2"), root)


def test_symlinked_directory_escaping_the_root_is_denied(root, tmp_path):
    os.symlink(tmp_path / "outside", root / "link")
    with pytest.raises(PermissionDenied):
        resolve_checkpoint(str(root / "link"), root)


def test_symlinked_file_escaping_the_root_is_denied(root, tmp_path):
    (root / "mixed").mkdir()
    os.symlink(tmp_path / "outside" / "model.safetensors", root / "mixed" / "model.safetensors")
    with pytest.raises(PermissionDenied, match="links outside"):
        resolve_checkpoint("mixed", root)


def test_symlink_inside_the_root_is_fine(root):
    os.symlink(root / "ckpt", root / "latest")
    assert resolve_checkpoint("latest", root) == root / "ckpt"


def test_a_symlinked_root_is_compared_by_its_real_path(root, tmp_path):
    os.symlink(root, tmp_path / "root-link")
    assert resolve_checkpoint(str(root / "ckpt"), tmp_path / "root-link") == root / "ckpt"


@pytest.mark.parametrize(
    ("path", "needle"),
    [("", "is empty"), ("missing", "is not a directory"), ("empty", "no *.safetensors"), ("a\x00b", "NUL")],
)
def test_bad_paths_under_the_root_are_invalid_argument(root, path, needle):
    with pytest.raises(InvalidArgument, match=needle.replace("*", r"\*")):
        resolve_checkpoint(path, root)
