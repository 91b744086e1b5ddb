"""Which checkpoint paths UpdateWeights accepts: realpath under weights_root, no symlink escapes, regular
files only; and that what is opened later is what was checked (a swap in between is refused)."""

from __future__ import annotations

import os

import pytest

from maskroll.server.errors import InvalidArgument, PermissionDenied
from maskroll.server.weights.checkpoints import open_checked, resolve_checkpoint


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
    assert resolve_checkpoint(str(root / "ckpt"), root).path == root / "ckpt"
    assert resolve_checkpoint("ckpt", root).path == root / "ckpt"
    assert resolve_checkpoint(str(root / "empty" / ".." / "ckpt"), root).path == root / "ckpt"
    ckpt = resolve_checkpoint("ckpt", root)
    assert [f.name for f in ckpt.files] == ["model.safetensors"] and str(ckpt) == str(root / "ckpt")


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
    assert resolve_checkpoint("latest", root).path == root / "ckpt"


def test_a_symlinked_root_is_compared_by_its_real_path(root, tmp_path):
    os.symlink(root, tmp_path / "root-link")
    assert resolve_checkpoint(str(root / "ckpt"), tmp_path / "root-link").path == root / "ckpt"


@pytest.mark.parametrize(
    ("path", "needle"),
    [("", "is empty"), ("missing", "is not a directory"), ("empty", "no *.safetensors"), ("a\x00b", "NUL")],
)
def test_bad_paths_under_the_root_are_invalid_argument(root, path, needle):
    with pytest.raises(InvalidArgument, match=needle.replace("*", r"\*")):
        resolve_checkpoint(path, root)


def test_a_fifo_named_safetensors_is_refused_without_opening_it(root):
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "model.safetensors")  # opening it for reading would wait for a writer
    with pytest.raises(
        InvalidArgument, match=r"model\.safetensors is a FIFO; checkpoint files must be regular"
    ):
        resolve_checkpoint("fifo", root)


def test_a_directory_named_safetensors_is_refused(root):
    (root / "ckpt" / "x.safetensors").mkdir()
    with pytest.raises(InvalidArgument, match=r"x\.safetensors is a directory"):
        resolve_checkpoint("ckpt", root)


def test_the_checked_files_are_the_ones_opened(root):
    ckpt = resolve_checkpoint("ckpt", root)
    with open_checked(ckpt) as opened:
        [(f, fd)] = opened
        assert f.name == "model.safetensors" and os.read(fd, 10) == b"x"


def test_a_file_swapped_for_a_symlink_after_the_check_is_refused(root, tmp_path):
    ckpt = resolve_checkpoint("ckpt", root)
    target = root / "ckpt" / "model.safetensors"
    target.unlink()
    os.symlink(tmp_path / "outside" / "model.safetensors", target)  # the check-then-load race
    swapped = pytest.raises(PermissionDenied, match=r"model\.safetensors changed after it was checked")
    with swapped, open_checked(ckpt):
        pass


def test_a_file_replaced_after_the_check_is_refused(root):
    ckpt = resolve_checkpoint("ckpt", root)
    (root / "ckpt" / "new").write_bytes(b"y")
    os.replace(root / "ckpt" / "new", root / "ckpt" / "model.safetensors")  # another inode, same name
    with pytest.raises(PermissionDenied, match="was replaced after it was checked"), open_checked(ckpt):
        pass


def test_a_directory_swapped_for_a_symlink_after_the_check_is_refused(root, tmp_path):
    ckpt = resolve_checkpoint("ckpt", root)
    os.rename(root / "ckpt", root / "ckpt-old")
    os.symlink(tmp_path / "outside", root / "ckpt")
    with pytest.raises(PermissionDenied, match="changed after it was checked"), open_checked(ckpt):
        pass


def test_a_file_added_after_the_check_is_refused(root, tmp_path):
    ckpt = resolve_checkpoint("ckpt", root)
    os.symlink(tmp_path / "outside" / "model.safetensors", root / "ckpt" / "extra.safetensors")
    with pytest.raises(PermissionDenied, match="files changed after it was checked"), open_checked(ckpt):
        pass


def test_a_symlinked_file_inside_the_root_is_opened_at_its_target(root):
    (root / "linked").mkdir()
    os.symlink(root / "ckpt" / "model.safetensors", root / "linked" / "model.safetensors")
    ckpt = resolve_checkpoint("linked", root)
    assert ckpt.files[0].real == root / "ckpt" / "model.safetensors"
    with open_checked(ckpt) as [(_, fd)]:
        assert os.read(fd, 10) == b"x"
