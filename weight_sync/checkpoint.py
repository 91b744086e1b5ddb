"""The checkpoint layout a replica's `UpdateWeights` loads, written from a trainer's state dict.

Layout: `<root>/v<version>/model.safetensors`, one safetensors file holding the model's
`state_dict()` under its Hugging Face parameter names (the names the replica's engine loads: the torch
engine by `load_state_dict`, vLLM by its `load_weights` name mapping), every tensor contiguous, in the
dtype the trainer holds. `<root>` is the directory the replicas were started with as `--weights-root`
(the same volume, mounted on both sides). The file is written under a temporary name and renamed, so a
replica never reads a half-written checkpoint. Version 0 is the weights a run starts from (written
only when replicas must be brought to them, see `CheckpointPublisher.start`); 1, 2, … follow the
optimiser steps. The run's record in Redis (`maskroll:<namespace>:run`, docs/records.md) names the
latest version and its directory, which is what a resumed trainer loads (`load_checkpoint`).

Beside the checkpoints, `<root>/trained/v<version>.json`: the rollout ids each published version
trained on (the trained-ids ledger below), which keeps a resumed run from training a record twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

CHECKPOINT_FILE = "model.safetensors"


def checkpoint_dir(root: str | os.PathLike, version: int) -> Path:
    """Where version `version` lives under `root` (`<root>/v<version>`)."""
    if version < 0:
        raise ValueError(f"policy versions are >= 0 (0: the weights a run starts from), got {version}")
    return Path(root) / f"v{version}"


def save_checkpoint(
    state_dict: Mapping[str, torch.Tensor] | torch.nn.Module, root: str | os.PathLike, version: int
) -> Path:
    """Write `state_dict` (or a module's) as version `version` under `root`; returns the directory."""
    from safetensors.torch import save_file

    if isinstance(state_dict, torch.nn.Module):
        state_dict = state_dict.state_dict()
    # safetensors refuses shared or strided storage; a detached contiguous copy is what replicas load.
    tensors = {name: t.detach().contiguous() for name, t in state_dict.items()}
    if not tensors:
        raise ValueError("the state dict is empty: nothing to publish")
    out = checkpoint_dir(root, version)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{CHECKPOINT_FILE}.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, out / CHECKPOINT_FILE)  # atomic: a replica sees the whole file or none
    return out


def load_checkpoint(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Load `<directory>/model.safetensors` into `model` (strict: every parameter, no extra one), onto
    the device and dtype `model` already has."""
    from safetensors.torch import load_file

    path = Path(directory) / CHECKPOINT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (pruned, or a different weights root?)")
    model.load_state_dict(load_file(str(path)), strict=True)


# ---- the trained-ids ledger: which rollouts each published version trained on ----------------------
#
# `<root>/trained/v<version>.json`: {"version", "run_id", "rollout_ids"}, written by the trainer *before*
# it publishes `version` and read when a run resumes. A trainer killed between publishing v and acking
# the records v trained on gets those records back on resume (they were never acked); the ledger says
# they are already in a published version, so they are acked untrained instead of trained twice
# (recipes/grpo.py, integrations/trl.py). Killed before the publish recorded v, the run resumes at v − 1:
# the ledger of v is ignored (it names a version the run never reached) and its records are trained
# again — the first training never reached a replica. Pruned with the checkpoints (`prune`).

TRAINED_DIR = "trained"


def trained_path(root: str | os.PathLike, version: int) -> Path:
    """Where the ids version `version` trained on are recorded (`<root>/trained/v<version>.json`)."""
    return Path(root) / TRAINED_DIR / f"{checkpoint_dir(root, version).name}.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_trained(root: str | os.PathLike, version: int, run_id: str, rollout_ids: Iterable[str]) -> Path:
    """Record that `version` of run `run_id` is trained on `rollout_ids`; call it before publishing
    `version`. Durable when it returns: written under a temporary name, fsynced, renamed into place and
    the directory fsynced — a reader sees the whole list or the previous one, and a machine crash right
    after the publish cannot lose it (a killed process alone could not: the rename is enough there)."""
    path = trained_path(root, version)
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        _fsync_dir(path.parent.parent)  # the new directory's entry
    body = json.dumps({"version": version, "run_id": run_id, "rollout_ids": sorted(set(rollout_ids))})
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)  # the rename itself
    return path


def read_trained(root: str | os.PathLike, run_id: str, *, after: int, through: int) -> set[str]:
    """The rollout ids run `run_id`'s versions after `after` up to `through` (the run's last published
    version) were trained on. Versions above `through` are ignored: their ledgers were written before a
    publish that never recorded them. A version without a ledger (pruned, version 0, or another run's
    file under the same root) adds nothing."""
    ids: set[str] = set()
    for version in range(max(after + 1, 0), through + 1):
        path = trained_path(root, version)
        if not path.is_file():
            continue
        body = json.loads(path.read_text())
        if body.get("run_id") == run_id and body.get("version") == version:
            ids.update(body["rollout_ids"])
    return ids


def prune(root: str | os.PathLike, version: int, keep: int) -> None:
    """Remove the checkpoints and trained-ids ledgers older than the `keep` newest up to `version`
    (a replica still loading one must find it; a resume reads the newest ledger)."""
    import shutil

    for old in range(version - keep, -1, -1):
        d, ledger = checkpoint_dir(root, old), trained_path(root, old)
        if not d.exists() and not ledger.exists():
            break  # older ones were pruned by an earlier publish (or never written: v0)
        if d.exists():
            shutil.rmtree(d)
        ledger.unlink(missing_ok=True)
