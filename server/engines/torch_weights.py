"""The torch engine's weights: the served model loaded, and new weights read and checked against it.

Owns: the model loaded from its directory, with parameters this process owns (not file pages); a
checkpoint's tensors read through the files `weights` checked (plain reads, no mmap: an update holds one
copy of the weights); and new tensors — a checkpoint's or a push's — checked by the weight rules
(`weights.tensor_rules`: names, shapes, dtypes, finite values) against the model's state dict and cast to
each parameter's dtype and device. Nothing here changes the served model: the engine swaps checked tensors
in between decode steps. Refusals name the first bad key (tests and operators read them).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..weights import tensor_rules
from .contract import WeightPatch

if TYPE_CHECKING:
    from ..weights.checkpoints import Checkpoint

Tensor = torch.Tensor


def load_model(model_dir: Path, *, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """(the causal LM of `model_dir` on `device` in `dtype`, ready to serve; the keyword its forward takes
    the KV cache by)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    # from_pretrained maps the safetensors file: on the CPU, parameters the cast left alone are
    # file pages faulted in lazily, not this process's memory. The first weight update would then
    # materialise the whole model next to the update's own copy (RSS + 2 models, bench/weights.py),
    # and the served weights would depend on the file staying unchanged. Owning them from the start
    # makes the steady state what serving really holds.
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type == "cpu":
            t.data = t.data.clone()
    # transformers 5 renamed `past_key_values` to `cache` (the old name is deprecated until 5.40).
    params = inspect.signature(model.forward).parameters
    return model, "cache" if "cache" in params else "past_key_values"


def read_checkpoint(checkpoint: Checkpoint | Path) -> tuple[dict[str, Tensor], str]:
    """(every tensor of the checkpoint's *.safetensors, the directory that names them in errors), read
    through the files `weights` checked (no symlink followed, inode unchanged)."""
    # Imported here, as before the split: loading the engine module loads no gRPC (the path checks'
    # errors are gRPC statuses).
    from ..weights import checkpoints

    checkpoint = checkpoints.checkpoint_of(checkpoint)
    directory = checkpoint.path
    tensors: dict[str, Tensor] = {}
    with checkpoints.open_checked(checkpoint) as opened:
        for f, fd in opened:
            # plain reads, no mmap: the update holds one copy of the weights (docs/architecture.md)
            for key, t in checkpoints.read_safetensors(fd, str(f.real)):
                if key in tensors:
                    raise ValueError(f"{key!r} appears in more than one file of {directory}")
                tensors[key] = t
    return tensors, str(directory)


def checked(model: torch.nn.Module, tensors: dict[str, Tensor], label: str, device: torch.device) -> dict:
    """`tensors` checked against the model's state dict by the weight rules and cast in place to each
    parameter's dtype and device; `label` names them in errors. Changes nothing in the model."""
    state = model.state_dict()
    m = tensor_rules.compare(
        {k: tensor_rules.Layout.of(t) for k, t in tensors.items()},
        {k: tensor_rules.Layout.of(t) for k, t in state.items()},
        # A tied parameter (lm_head = embeddings) may be stored once under either name.
        storage={k: t.data_ptr() for k, t in state.items()},
    )
    if m.unexpected:
        raise ValueError(f"unexpected key {m.unexpected[0]!r} in {label} ({len(m.unexpected)} unexpected)")
    if m.missing:
        raise ValueError(f"missing key {m.missing[0]!r} in {label} ({len(m.missing)} missing)")
    if m.wrong_shape:
        key, new, served = m.wrong_shape[0]
        raise ValueError(f"shape of {key!r}: checkpoint {new}, model {served}")
    if m.wrong_dtype:
        key = m.wrong_dtype[0]
        want = (
            "a floating-point tensor"
            if state[key].is_floating_point()
            else f"{state[key].dtype}, as the model"
        )
        raise ValueError(f"{key!r} has dtype {tensors[key].dtype}; expected {want}")
    for key, t in tensors.items():
        cast = t.to(device=device, dtype=state[key].dtype)
        # After the cast: a float32 value beyond float16's range becomes inf here. One NaN weight makes
        # every logit NaN, so the whole checkpoint is refused and the old weights serve on.
        problem = tensor_rules.finite_problem(key, cast, label, arrived=t.dtype)
        if problem:
            raise ValueError(problem)
        tensors[key] = cast
    return tensors


def prepared_patches(
    model: torch.nn.Module, patches: list[WeightPatch], digests: dict[str, str], label: str
) -> list[tuple[Tensor, Tensor | None, Tensor]]:
    """A delta checked against the served model without changing it: every tensor's result (its patch
    applied to a copy, one tensor at a time; an unpatched tensor as it is) must have the digest the
    trainer sent, so the version is verified bit for bit before a single weight changes. Returns
    (parameter, int64 flat indices or None for a whole tensor, values in the parameter's dtype) per patch,
    for `apply_patches` on the decode thread. ValueError naming the first bad tensor."""
    from maskroll.proto.tensor_push import digest_of

    state = model.state_dict(keep_vars=True)
    # A tied parameter (lm_head = embeddings) is one tensor, digested once under either of its names.
    names_of: dict[int, list[str]] = {}
    for name, t in state.items():
        names_of.setdefault(id(t), []).append(name)
    unknown = sorted(set(digests) - set(state))
    if unknown:
        raise ValueError(f"{label}: tensor {unknown[0]!r} is not in the served model ({len(unknown)} such)")
    by_name = {p.name: p for p in patches}
    if len(by_name) != len(patches) or not set(by_name) <= set(digests):
        raise ValueError(f"{label}: every patch needs one digest, and a tensor one patch")
    prepared = []
    for names in names_of.values():
        sent = [n for n in names if n in digests]
        if len(sent) != 1:
            what = "no digest" if not sent else f"digests under {len(sent)} of its names"
            raise ValueError(f"{label}: tensor {names[0]!r} has {what}: the delta does not cover the model")
        name = sent[0]
        param, patch = state[name], by_name.get(name)
        served = param.detach().reshape(-1)
        if patch is None:
            result = served
        else:
            indices, values = _checked_patch(patch, param, label)
            if indices is None:
                result = values
            else:
                result = served.clone()
                result[indices] = values
            prepared.append((param, indices, values))
        got = digest_of(result.cpu().view(torch.uint8).numpy())
        if got != digests[name]:
            raise ValueError(
                f"{label}: tensor {name!r} would be {got} once applied, the trainer's is {digests[name]} "
                "(a patch on other weights, or corrupted): the version is refused, nothing changed"
            )
    return prepared


def _checked_patch(patch: WeightPatch, param: Tensor, label: str) -> tuple[Tensor | None, Tensor]:
    values, numel = patch.values, param.numel()
    if tuple(patch.shape) != tuple(param.shape) or values.dtype != param.dtype or values.dim() != 1:
        raise ValueError(
            f"{label}: patch of {patch.name!r} is {list(patch.shape)} of {values.dtype}; the served tensor "
            f"is {list(param.shape)} of {param.dtype}"
        )
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        raise ValueError(f"{label}: patch of {patch.name!r} has non-finite values")
    if patch.indices is None:
        if values.numel() != numel:
            raise ValueError(f"{label}: dense patch of {patch.name!r} has {values.numel()} of {numel} values")
        return None, values.to(param.device)
    indices = patch.indices.to(torch.int64)
    n = indices.numel()
    if n != values.numel() or n == 0:
        raise ValueError(f"{label}: patch of {patch.name!r} has {n} indices for {values.numel()} values")
    # strictly increasing and in range: unique positions, so the result does not depend on write order
    increasing = n == 1 or bool((indices[1:] > indices[:-1]).all())
    if int(indices[0]) < 0 or int(indices[-1]) >= numel or not increasing:
        raise ValueError(f"{label}: patch of {patch.name!r}: indices not increasing within [0, {numel})")
    return indices.to(param.device), values.to(param.device)


def apply_patches(prepared: list[tuple[Tensor, Tensor | None, Tensor]]) -> None:
    """The checked patches written into the parameters in place (between decode steps)."""
    with torch.no_grad():
        for param, indices, values in prepared:
            flat = param.data.view(-1)  # parameters are contiguous (load_model owns them)
            if indices is None:
                flat.copy_(values)
            else:
                flat.index_copy_(0, indices, values)
