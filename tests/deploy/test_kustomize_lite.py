"""kustomize_lite, the renderer used where kubectl is missing: the same output as `kubectl kustomize` on
every kustomization in deploy/k8s (where kubectl exists), RFC 6902 by hand-made cases, image refs, and
a loud refusal of features it does not implement."""

from __future__ import annotations

import shutil

import pytest
from deploy_files import KUSTOMIZATIONS
from kustomize_lite import RenderError, json_patch, render, render_lite, split_image


def _key(resource: dict) -> tuple[str, str, str]:
    return resource["kind"], resource["metadata"].get("namespace", ""), resource["metadata"]["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not on PATH (kustomize_lite is in use)")
@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_same_output_as_kubectl_kustomize(name):
    by_kubectl = sorted(render(KUSTOMIZATIONS[name], kubectl=True), key=_key)
    by_lite = sorted(render_lite(KUSTOMIZATIONS[name]), key=_key)
    assert [_key(r) for r in by_lite] == [_key(r) for r in by_kubectl]
    for lite, kubectl in zip(by_lite, by_kubectl, strict=True):
        assert lite == kubectl, _key(lite)


def test_json_patch_operations():
    doc = {"a": {"b": [1, 2, 3], "c/d": 1, "e~f": 2}, "x": 0}
    json_patch(
        doc,
        [
            {"op": "test", "path": "/a/b/1", "value": 2},
            {"op": "add", "path": "/a/b/0", "value": 0},
            {"op": "add", "path": "/a/b/-", "value": 4},
            {"op": "replace", "path": "/a/c~1d", "value": 10},
            {"op": "remove", "path": "/a/e~0f"},
            {"op": "copy", "from": "/x", "path": "/y"},
            {"op": "move", "from": "/a/b/4", "path": "/z"},
            {"op": "add", "path": "/n", "value": {"k": [1]}},
        ],
    )
    assert doc == {"a": {"b": [0, 1, 2, 3], "c/d": 10}, "x": 0, "y": 0, "z": 4, "n": {"k": [1]}}


@pytest.mark.parametrize(
    "op",
    [
        {"op": "test", "path": "/a", "value": 2},
        {"op": "replace", "path": "/missing", "value": 1},
        {"op": "remove", "path": "/a/b"},
        {"op": "add", "path": "/l/9", "value": 1},
        {"op": "frobnicate", "path": "/a", "value": 1},
    ],
)
def test_json_patch_failures_raise(op):
    with pytest.raises(RenderError):
        json_patch({"a": 1, "l": []}, [op])


@pytest.mark.parametrize(
    ("ref", "parts"),
    [
        ("maskroll", ("maskroll", None, None)),
        ("redis:7.2.7-alpine", ("redis", "7.2.7-alpine", None)),
        ("reg.example:5000/team/maskroll:0.1", ("reg.example:5000/team/maskroll", "0.1", None)),
        ("reg.example:5000/maskroll", ("reg.example:5000/maskroll", None, None)),
        ("m:1@sha256:abc", ("m", "1", "sha256:abc")),
    ],
)
def test_split_image(ref, parts):
    assert split_image(ref) == parts


def test_unimplemented_fields_are_refused(tmp_path):
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\n")
    (tmp_path / "kustomization.yaml").write_text("resources: [cm.yaml]\ncommonLabels: {a: b}\n")
    with pytest.raises(RenderError, match="commonLabels"):
        render_lite(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [cm.yaml]\npatches:\n  - target: {kind: ConfigMap, name: x}\n    patch: 'data: {a: c}'\n"
    )
    with pytest.raises(RenderError, match="JSON 6902"):
        render_lite(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [cm.yaml]\npatches:\n  - target: {kind: ConfigMap, name: y}\n"
        "    patch: '[{op: remove, path: /data/a}]'\n"
    )
    with pytest.raises(RenderError, match="matches no resource"):
        render_lite(tmp_path)
