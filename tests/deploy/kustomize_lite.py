"""Render deploy/k8s kustomizations: `kubectl kustomize` when kubectl is on PATH, else a small renderer.

The small renderer implements exactly the kustomization features deploy/k8s uses — `resources` (files
and directories), `components` (a Component's resources and patches, applied to everything accumulated
so far, before the kustomization's own transformers), `patches` (inline JSON 6902 with a target),
`namespace`, `labels` (metadata only, includeSelectors: false) and `images` — in kustomize's order
(components, patches, namespace, labels, images). A Kustomization's patch that matches nothing is
refused (a typo would otherwise do nothing); a Component's is skipped, as kustomize skips it, since one
component may serve kustomizations that hold different resources. It refuses any other field, so a
kustomization that outgrows it fails loudly instead of rendering wrong;
where kubectl exists, test_kustomize_lite compares the two outputs.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import yaml

SUPPORTED_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "namespace",
    "labels",
    "images",
    "patches",
}
COMPONENT_FIELDS = {"apiVersion", "kind", "resources", "patches"}
# Kinds our manifests use that are not namespaced (kustomize leaves their metadata.namespace unset).
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")


class RenderError(Exception):
    pass


def render(path: Path, *, kubectl: bool | None = None) -> list[dict]:
    """The resources a kustomization directory renders to. kubectl=None: kubectl if on PATH."""
    if kubectl is None:
        kubectl = shutil.which("kubectl") is not None
    if kubectl:
        out = subprocess.run(
            ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False
        )
        if out.returncode != 0:
            raise RenderError(f"kubectl kustomize {path} failed:\n{out.stderr}")
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    return render_lite(path)


def render_lite(path: Path) -> list[dict]:
    kust_file = path / "kustomization.yaml"
    k = yaml.safe_load(kust_file.read_text())
    unsupported = set(k) - SUPPORTED_FIELDS
    if unsupported:
        raise RenderError(f"{kust_file}: kustomize_lite does not implement {sorted(unsupported)}")
    resources: list[dict] = []
    for entry in k.get("resources", []):
        target = path / entry
        if target.is_dir():
            resources += render_lite(target)
        else:
            resources += [d for d in yaml.safe_load_all(target.read_text()) if d]
    for entry in k.get("components", []):
        _apply_component(resources, path / entry)
    for patch in k.get("patches", []):
        _apply_patch(resources, patch, kust_file)
    if "namespace" in k:
        for res in resources:
            if res["kind"] not in CLUSTER_SCOPED:
                res["metadata"]["namespace"] = k["namespace"]
    for label in k.get("labels", []):
        if label.get("includeSelectors", False) or label.get("includeTemplates", False):
            raise RenderError(f"{kust_file}: labels with includeSelectors/includeTemplates not implemented")
        for res in resources:
            res["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in k.get("images", []):
        for res in resources:
            _set_images(res, image)
    return resources


def _apply_component(resources: list[dict], path: Path) -> None:
    kust_file = path / "kustomization.yaml"
    c = yaml.safe_load(kust_file.read_text())
    if c.get("kind") != "Component":
        raise RenderError(f"{kust_file}: a component must be kind: Component, got {c.get('kind')!r}")
    unsupported = set(c) - COMPONENT_FIELDS
    if unsupported:
        raise RenderError(f"{kust_file}: kustomize_lite does not implement {sorted(unsupported)} (component)")
    for entry in c.get("resources", []):
        resources += [d for d in yaml.safe_load_all((path / entry).read_text()) if d]
    for patch in c.get("patches", []):
        _apply_patch(resources, patch, kust_file, required=False)


# ---- patches ----------------------------------------------------------------------------------------


def _matches(res: dict, target: dict) -> bool:
    group, _, version = res["apiVersion"].rpartition("/")
    unsupported = set(target) - {"group", "version", "kind", "name"}
    if unsupported:
        raise RenderError(f"patch target fields {sorted(unsupported)} not implemented")
    want = {"group": group, "version": version, "kind": res["kind"], "name": res["metadata"]["name"]}
    return all(want[key] == value for key, value in target.items())


def _apply_patch(resources: list[dict], patch: dict, where: Path, required: bool = True) -> None:
    if set(patch) != {"target", "patch"}:
        raise RenderError(f"{where}: only inline patches with a target are implemented, got {sorted(patch)}")
    ops = yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        raise RenderError(f"{where}: only JSON 6902 patches (a list of operations) are implemented")
    hits = [r for r in resources if _matches(r, patch["target"])]
    if not hits and required:
        raise RenderError(f"{where}: patch target {patch['target']} matches no resource")
    for res in hits:
        json_patch(res, ops)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc, parts: list[str]):
    for p in parts:
        doc = doc[int(p)] if isinstance(doc, list) else doc[p]
    return doc


def json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 in place: add, remove, replace, move, copy, test. Raises RenderError on a failed op."""
    for op in ops:
        parts = _pointer(op["path"])
        try:
            parent, key = _walk(doc, parts[:-1]), parts[-1]
            kind = op["op"]
            if kind == "test":
                if _walk(doc, parts) != op["value"]:
                    raise RenderError(
                        f"test failed at {op['path']}: {_walk(doc, parts)!r} != {op['value']!r}"
                    )
                continue
            if kind in ("move", "copy"):
                src = _pointer(op["from"])
                value = copy.deepcopy(_walk(doc, src))
                if kind == "move":
                    src_parent = _walk(doc, src[:-1])
                    src_parent.pop(int(src[-1]) if isinstance(src_parent, list) else src[-1])
                kind = "add"
            else:
                value = copy.deepcopy(op.get("value"))
            if kind == "add":
                if isinstance(parent, list):
                    index = len(parent) if key == "-" else int(key)
                    if not 0 <= index <= len(parent):
                        raise IndexError(f"index {index} out of range for a list of {len(parent)}")
                    parent.insert(index, value)
                else:
                    parent[key] = value
            elif kind == "replace":
                if isinstance(parent, list):
                    parent[int(key)] = value
                elif key not in parent:
                    raise RenderError(f"replace at missing path {op['path']}")
                else:
                    parent[key] = value
            elif kind == "remove":
                parent.pop(int(key) if isinstance(parent, list) else key)
            else:
                raise RenderError(f"unknown JSON patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError, AttributeError) as exc:
            raise RenderError(f"JSON patch {op} failed: {exc!r}") from None
    return doc


# ---- images -----------------------------------------------------------------------------------------


def split_image(ref: str) -> tuple[str, str | None, str | None]:
    """'reg:5000/a/b:tag@sha256:..' -> ('reg:5000/a/b', 'tag', 'sha256:..')."""
    name, _, digest = ref.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def _set_images(node, image: dict) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in CONTAINER_LISTS and isinstance(value, list):
                for container in value:
                    _retag(container, image)
            else:
                _set_images(value, image)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, image)


def _retag(container: dict, image: dict) -> None:
    name, tag, digest = split_image(container.get("image", ""))
    if name != image["name"]:
        return
    name = image.get("newName", name)
    if "digest" in image:
        container["image"] = f"{name}@{image['digest']}"
        return
    tag = image.get("newTag", tag)
    ref = f"{name}:{tag}" if tag else name
    container["image"] = f"{ref}@{digest}" if digest else ref
