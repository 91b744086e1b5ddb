"""The weights fingerprint of a trainer's model (proto/weights_fingerprint.py says what it is and why).

Tensors that share storage (tied embeddings: `lm_head.weight` is `embed_tokens.weight`) count once,
under the first name in state-dict order, as Hugging Face checkpoints store them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from maskroll.proto.weights_fingerprint import sample_indices, weights_fingerprint


def model_fingerprint(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """The fingerprint of `model`'s floating-point tensors (a module's state dict, or a state dict)."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    items = []
    with torch.no_grad():
        for name, t in state.items():
            if not t.is_floating_point():
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key in seen:
                continue
            seen.add(key)
            idx = torch.from_numpy(sample_indices(t.numel()))
            sample = t.detach().reshape(-1)[idx.to(t.device)].to("cpu", torch.float32).numpy()
            items.append((name, tuple(t.shape), sample))
    return weights_fingerprint(items)
