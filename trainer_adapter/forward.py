"""The policy's forward pass on a collated batch, as the GRPO recipe and the TRL trainer both run it: the
logits that predict the completion (`completion_logits`), and after an optimiser step the realised
direction agreement (`realised_agreement`, docs/math.md §7), which needs those logits again.

A batch is a `collate.Batch` or a dict of its tensors (TRL's micro-batches); rows are left-padded prompts
followed by right-padded completions, input_ids [B, P + T]. The model is anything called like a
Hugging Face causal LM (`input_ids`, `attention_mask`, `position_ids`, `logits_to_keep`; DDP, FSDP2 and
PEFT wrappers pass them on). Knows nothing of records, queues or optimisers.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .collate import Batch
from .config import MaskConfig
from .masks import MaskResult, compute_masks_for
from .reference import direction_agreement

Tensor = torch.Tensor


def _get(batch: Batch | Mapping[str, Tensor], name: str) -> Tensor:
    return batch[name] if isinstance(batch, Mapping) else getattr(batch, name)


def completion_logits(model: torch.nn.Module, batch: Batch | Mapping[str, Tensor]) -> Tensor:  # -> [B, T, V]
    """The logits that predict completion_ids [B, T]: position P − 1 + t predicts completion token t
    (`Batch.completion_logits_slice`), so the last T + 1 positions of input_ids [B, P + T] are the ones,
    less the very last. Only those go through the head (`logits_to_keep`): a prompt's logits [B, P, V]
    are never made."""
    t = _get(batch, "completion_ids").shape[1]
    out = model(
        input_ids=_get(batch, "input_ids"),
        attention_mask=_get(batch, "attention_mask"),
        position_ids=_get(batch, "position_ids"),
        logits_to_keep=t + 1,
    )
    return out.logits[:, :t]


@torch.no_grad()
def realised_agreement(
    model: torch.nn.Module,
    batch: Batch | Mapping[str, Tensor],
    config: MaskConfig,
    before: MaskResult,
    *,
    top_k: int | None = None,  # a dict's truncation (a Batch carries its own): as compute_masks_for
    top_p: float | None = None,
) -> dict[str, dict[str, float]]:
    """How often each rule's predicted direction matched the realised change of D after the step
    (docs/math.md §7): `batch`'s masks computed again on `model` (the step taken) and scored against
    `before` (the masks the step trained with) by `reference.direction_agreement` — per rule
    ("ratio", "predictive") agree_all / agree_far / ..., and "_sets" (far_frac, disagreement_frac_far)."""
    after = compute_masks_for(batch, completion_logits(model, batch), config=config, top_k=top_k, top_p=top_p)
    adv = _get(batch, "advantages")[:, None].expand_as(before.divergence).double()  # [B, T]
    return direction_agreement(
        adv,
        before.divergence.double(),
        after.divergence.double(),
        {"ratio": before.ratio_direction, "predictive": before.predicted_direction},
        before.far,
        response_mask=before.response_mask,
    )
