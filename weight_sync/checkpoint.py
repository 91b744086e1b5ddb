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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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
