"""collate: a batch of rollout records → padded tensors for compute_masks / policy_loss (docs/math.md §6).

Records are duck-typed (the numpy `RolloutRecord` of maskroll.client has the fields used here), so this
module needs neither grpc nor redis (from maskroll.client it takes only the stdlib-pure temperature rule).
It also enforces the sampling semantics a trainer must match: processed logprobs, one K per batch, a
valid temperature, and no truncated records unless the trainer replays truncation.

Multi-turn records (an agent session: docs/architecture.md, "The record") carry a loss mask over their
completion — the model's tokens and, between its turns, tool results and template text it only read:
the response mask is that loss mask, so compute_masks and policy_loss see only what the model sampled.
A record whose client edited its history has segments (`segment_starts`), each a context of its own:
each becomes a row, its prompt the segment's tokens before its first sampled one (`record_index` maps
rows to records; a row carries its record's reward and advantage).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from maskroll.proto.sampling import temperature_problem

Tensor = torch.Tensor


class SemanticsError(ValueError):
    """The records cannot be trained on as they are (docs/math.md §6)."""


@dataclass
class Batch:
    """Padded tensors, one row per record (per segment of a multi-turn record with edited history).
    Completion token t of row b is predicted by the logits at position prompt_len − 1 + t of input_ids
    (prompts are left-padded to a common prompt_len)."""

    input_ids: Tensor  # [B, P + T] long: left-padded prompt, right-padded completion
    attention_mask: Tensor  # [B, P + T] long
    position_ids: Tensor  # [B, P + T] long, 0 at each sequence's first real token
    completion_ids: Tensor  # [B, T] long
    response_mask: Tensor  # [B, T] bool: the tokens the model sampled (a multi-turn record's loss mask)
    sampled_logprobs: Tensor  # [B, T] float32, log μ_a
    topk_ids: Tensor  # [B, T, K] long
    topk_logprobs: Tensor  # [B, T, K] float32
    rewards: Tensor  # [B] float32
    advantages: Tensor  # [B] float32, group-normalised
    temperature: Tensor  # [B] float64, per sequence
    top_k: int | None  # the batch's truncation (None: off)
    top_p: float | None
    policy_versions: Tensor  # [B] long, version at each row's first token
    prompt_len: int  # P
    record_index: Tensor | None = None  # [B] long: the record of each row (None: row b is record b)
    # The teacher's scores (the teacher stage, docs/math.md §10) when every record carries them, else None
    # (a batch mixing taught and untaught records is refused: `teacher_k`). Zero where padded.
    teacher_topk_ids: Tensor | None = None  # [B, T, K_teacher] long
    teacher_topk_logprobs: Tensor | None = None  # [B, T, K_teacher] float32, log π_teacher
    teacher_sampled_logprobs: Tensor | None = None  # [B, T] float32, log π_teacher(completion token)

    @property
    def completion_logits_slice(self) -> slice:
        """logits[:, slice] are the [B, T, V] logits that predict completion_ids."""
        t = self.completion_ids.shape[1]
        return slice(self.prompt_len - 1, self.prompt_len - 1 + t)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in self.__dict__.items()})


def group_advantages(
    rewards: np.ndarray,  # [B]
    groups: Sequence[str],  # [B] group key per record
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:  # [B] float32
    """GRPO: A = (r − mean_group) / (std_group + eps), std unbiased; a group of one gets A = 0.
    normalize_std=False gives Dr. GRPO's r − mean_group."""
    rewards = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(rewards)
    keys = np.asarray(groups, dtype=object)
    for g in dict.fromkeys(keys):
        idx = np.flatnonzero(keys == g)
        r = rewards[idx]
        centred = r - r.mean()
        if normalize_std and len(idx) > 1:
            centred = centred / (r.std(ddof=1) + eps)
        out[idx] = centred if len(idx) > 1 else 0.0
    return out.astype(np.float32)


def _truncation(rec: Any) -> tuple[int | None, float | None]:
    s = rec.semantics
    top_k = int(s.top_k) if s.top_k and s.top_k > 0 else None
    top_p = float(s.top_p) if s.top_p and s.top_p < 1.0 else None
    return top_k, top_p


def check_semantics(
    records: Sequence[Any], *, allow_truncation: bool = False
) -> tuple[int | None, float | None]:
    """Refuse records a trainer would misread; return the batch's (top_k, top_p)."""
    if not records:
        raise SemanticsError("empty batch")
    modes = {r.semantics.logprobs_mode for r in records}
    if modes != {"processed"}:
        raise SemanticsError(
            f"logprobs_mode {sorted(modes)}: only 'processed' logprobs describe μ (docs/math.md §6)"
        )
    ks = {r.logprobs_k for r in records}  # the record's one K (RolloutRecord.logprobs_k)
    if len(ks) != 1:
        raise SemanticsError(f"records carry different K {sorted(ks)}; collate one K per batch")
    # The SDK's rule (maskroll.proto.sampling), which the server applied when it sampled them.
    bad = [p for r in records if (p := temperature_problem(float(r.semantics.temperature)))]
    if bad:
        raise SemanticsError(f"semantics.{bad[0]} ({len(bad)} of {len(records)} records)")
    truncs = {_truncation(r) for r in records}
    if len(truncs) != 1:
        raise SemanticsError(f"records mix truncation settings (top_k, top_p) {sorted(truncs, key=str)}")
    trunc = truncs.pop()
    if trunc != (None, None) and not allow_truncation:
        raise SemanticsError(
            f"records were sampled with truncation (top_k, top_p) = {trunc}: μ is renormalised over the kept "
            "set. Collate with allow_truncation=True and mask with MaskConfig(replay_truncation=True)."
        )
    return trunc


def _rows(rec: Any) -> list[tuple[np.ndarray, slice]]:
    """(prompt ids, completion slice) of each row of a record: one, or one per segment."""
    t = len(rec.completion_ids)
    starts = [0, *(int(s) for s in getattr(rec, "segment_starts", ()) or ()), t]
    mask = getattr(rec, "loss_mask", None)
    rows = [(np.asarray(rec.prompt_ids), slice(0, starts[1]))]
    for a, b in itertools.pairwise(starts[1:]):
        # A fresh prompt: the segment's tokens up to its first sampled one are the row's context.
        sampled = np.flatnonzero(np.asarray(mask[a:b], bool)) if mask is not None else np.zeros(0, int)
        g = a + int(sampled[0]) if sampled.size else b
        rows.append((np.asarray(rec.completion_ids[a:g]), slice(g, b)))
    return rows


def record_rewards(records: Sequence[Any]) -> np.ndarray:  # -> float64 [B]
    """The rewards the records carry (set by the reward stage, docs/rewards.md). Every record must carry
    one: a batch that mixes scored and unscored records is refused, naming one of each by rollout_id (a
    reward of 0 for the unscored ones would be invented), and so is a batch with none."""
    scored = [r for r in records if getattr(r, "reward", None) is not None]
    if len(scored) == len(records) and records:
        return np.array([float(r.reward) for r in records], np.float64)
    if not scored:
        raise ValueError(
            f"none of the {len(records)} records carries a reward: pass rewards=[...] to collate, or score "
            "them with a reward stage (`maskroll reward`, RolloutQueue(reward_stage=True))"
        )
    unscored = next(r for r in records if getattr(r, "reward", None) is None)
    raise ValueError(
        f"the batch mixes scored and unscored records ({len(scored)} of {len(records)} carry a reward): "
        f"{scored[0].rollout_id!r} is scored ({scored[0].reward:g}), {unscored.rollout_id!r} is not; "
        "read every record of a run through the reward stage, or pass rewards=[...] for all of them"
    )


def teacher_k(records: Sequence[Any]) -> int | None:
    """K_teacher of a batch whose records all carry a teacher's scores, None when none does. A batch that
    mixes taught and untaught records, or teachers of another K / temperature / truncation, is refused
    naming one record of each (a zero teacher distribution for the untaught ones would be invented)."""
    taught = [r for r in records if getattr(r, "teacher_semantics", None) is not None]
    if not taught:
        return None
    if len(taught) != len(records):
        untaught = next(r for r in records if getattr(r, "teacher_semantics", None) is None)
        raise SemanticsError(
            f"the batch mixes records a teacher scored and records none did ({len(taught)} of "
            f"{len(records)}): {taught[0].rollout_id!r} has a teacher, {untaught.rollout_id!r} has not; "
            "read every record of a run through the teacher stage (maskroll teacher)"
        )

    def how(r) -> tuple:
        s = r.teacher_semantics
        return (s.logprobs_k, float(s.temperature), int(s.top_k or 0), float(s.top_p or 1.0))

    first = how(taught[0])
    other = next((r for r in taught if how(r) != first), None)
    if other is not None:
        raise SemanticsError(
            f"the batch mixes teacher distributions: {taught[0].rollout_id!r} was scored at (K, temperature, "
            f"top_k, top_p) = {first}, {other.rollout_id!r} at {how(other)}"
        )
    return first[0]


def collate(
    records: Sequence[Any],
    rewards: Sequence[float] | np.ndarray | None = None,
    *,
    pad_id: int = 0,
    normalize_std: bool = True,
    allow_truncation: bool = False,
) -> Batch:
    """Pad a batch of records and attach group-normalised advantages (group = group_id, else job_id).

    rewards: one per record; None takes the records' own (`record_rewards`: scored by the reward stage,
    every record or none). Advantages always come from whole groups, here on the learner."""
    top_k, top_p = check_semantics(records, allow_truncation=allow_truncation)
    rewards = record_rewards(records) if rewards is None else np.asarray(rewards, dtype=np.float64)
    if rewards.shape != (len(records),):
        raise ValueError(f"rewards has shape {rewards.shape}; expected ({len(records)},), one per record")
    rows = [(i, prompt, part) for i, r in enumerate(records) for prompt, part in _rows(r)]
    b = len(rows)
    k = records[0].logprobs_k
    p_max = max(len(prompt) for _, prompt, _ in rows)
    t_max = max(1, max(part.stop - part.start for _, _, part in rows))
    input_ids = np.full((b, p_max + t_max), pad_id, np.int64)
    attention = np.zeros((b, p_max + t_max), np.int64)
    completion = np.full((b, t_max), pad_id, np.int64)
    mask = np.zeros((b, t_max), bool)
    sampled = np.zeros((b, t_max), np.float32)
    topk_ids = np.zeros((b, t_max, k), np.int64)
    topk_lp = np.zeros((b, t_max, k), np.float32)
    kt = teacher_k(records)
    if kt is not None:
        t_ids = np.zeros((b, t_max, kt), np.int64)
        t_lp = np.zeros((b, t_max, kt), np.float32)
        t_sampled = np.zeros((b, t_max), np.float32)
    first_versions = np.zeros(b, np.int64)
    for i, (j, prompt, part) in enumerate(rows):
        r = records[j]
        p, t = len(prompt), part.stop - part.start
        input_ids[i, p_max - p : p_max] = prompt
        input_ids[i, p_max : p_max + t] = r.completion_ids[part]
        attention[i, p_max - p : p_max + t] = 1
        completion[i, :t] = r.completion_ids[part]
        loss_mask = getattr(r, "loss_mask", None)
        mask[i, :t] = True if loss_mask is None else np.asarray(loss_mask[part], bool)
        sampled[i, :t] = r.sampled_logprobs[part]
        topk_ids[i, :t] = r.topk_ids[part]
        topk_lp[i, :t] = r.topk_logprobs[part]
        if kt is not None:
            t_ids[i, :t] = r.teacher_topk_ids[part]
            t_lp[i, :t] = r.teacher_topk_logprobs[part]
            t_sampled[i, :t] = r.teacher_sampled_logprobs[part]
        first_versions[i] = r.token_versions()[part.start] if t else r.policy_version_first
    positions = np.clip(np.cumsum(attention, axis=1) - 1, 0, None)
    groups = [r.group_id or r.job_id or r.rollout_id for r in records]
    record_index = np.array([j for j, _, _ in rows], np.int64)
    adv = group_advantages(rewards, groups, normalize_std=normalize_std)[record_index]
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        position_ids=torch.from_numpy(positions),
        completion_ids=torch.from_numpy(completion),
        response_mask=torch.from_numpy(mask),
        sampled_logprobs=torch.from_numpy(sampled),
        topk_ids=torch.from_numpy(topk_ids),
        topk_logprobs=torch.from_numpy(topk_lp),
        rewards=torch.from_numpy(rewards.astype(np.float32)[record_index]),
        advantages=torch.from_numpy(adv),
        temperature=torch.tensor(
            [float(records[j].semantics.temperature) for j, _, _ in rows], dtype=torch.float64
        ),
        top_k=top_k,
        top_p=top_p,
        policy_versions=torch.from_numpy(first_versions),
        prompt_len=p_max,
        record_index=torch.from_numpy(record_index),
        teacher_topk_ids=None if kt is None else torch.from_numpy(t_ids),
        teacher_topk_logprobs=None if kt is None else torch.from_numpy(t_lp),
        teacher_sampled_logprobs=None if kt is None else torch.from_numpy(t_sampled),
    )
