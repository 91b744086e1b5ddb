"""The weights fingerprint of a replica's starting weights: its `--model` directory's safetensors
(proto/weights_fingerprint.py says what it is and why). Read by rows, so a large model costs a few pages per
tensor, not the file; "" when the directory has no safetensors (nothing to compare: trainers push)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from maskroll.proto.weights_fingerprint import sample_indices, weights_fingerprint

log = logging.getLogger("maskroll.weights")


def _tied_output(model_dir: Path) -> bool:
    """config.json ties the output embedding to the input one (tie_word_embeddings)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False))


def fingerprint_dir(model_dir: str | Path) -> str:
    import torch
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    # A tied lm_head is the input embedding: a trainer's model counts it once (shared storage,
    # weight_sync/model_fingerprint.py), and transformers saves it once; a directory that stores it anyway
    # (SmolLM2's conversion did) must not count it twice, or no trainer's model ever matches this base.
    skip = {"lm_head.weight"} if _tied_output(model_dir) else set()
    items = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in skip:
                    continue
                part = f.get_slice(name)
                shape = tuple(part.get_shape())
                if part.get_dtype() not in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"):
                    continue
                numel = int(np.prod(shape, dtype=np.int64))
                idx = sample_indices(numel)
                if len(shape) == 0:
                    values = f.get_tensor(name).reshape(-1)
                else:
                    inner = numel // shape[0] if shape[0] else 0
                    rows: dict[int, torch.Tensor] = {}
                    picked = []
                    for i in idx.tolist():
                        r = i // inner
                        if r not in rows:
                            rows[r] = part[r : r + 1].reshape(-1)
                        picked.append(rows[r][i - r * inner])
                    values = torch.stack(picked) if picked else torch.zeros(0)
                items.append((name, shape, values.to(torch.float32).numpy()))
    fingerprint = weights_fingerprint(items)
    if files:
        log.info("weights: starting weights %s (fingerprint %s)", model_dir, fingerprint)
    return fingerprint
