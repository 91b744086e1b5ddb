"""The one rule set new weights must pass before any engine loads them, against the model being served.

Every source (a checkpoint directory, a push, an NCCL broadcast) and both engines ask these rules; each
engine words its refusal its own way (the torch engine names the first bad key, the vLLM engine lists
them, and tests assert both), but what counts as wrong is decided only here:

- names: no tensor the model lacks; none of the model's missing, unless a tensor present shares its
  storage (a tied lm_head stored once, under either name) or the source sends a part by design (an NCCL
  broadcast: its caller ignores `missing`);
- shapes: the served tensor's;
- dtypes: floating point where the served tensor is, and not where it is not (an engine casts floating
  values to its own precision; an integer tensor in a float's place is another thing, not a precision);
- finite values: no NaN or inf in a floating tensor *as it will be served*, after the cast to the served
  dtype (a float32 value beyond bfloat16's range becomes inf there). One NaN weight makes every logit NaN.
- LoRA adapters (`check_adapter`): pairs A [r, in] / B [out, r] on the base's Linear weights, of the
  adapter's rank (at most the engine's max_lora_rank), floating and finite.

Pure rules on `Layout`s, plus the readers that build them from torch tensors and from safetensors files.
torch and safetensors are imported only to read values. Knows nothing of gRPC or of any engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import checkpoints


@dataclass(frozen=True)
class Layout:
    """What the rules know of a tensor without reading its values."""

    shape: tuple[int, ...]
    floating: bool

    @classmethod
    def of(cls, t: Any) -> Layout:  # a torch tensor
        return cls(tuple(t.shape), bool(t.is_floating_point()))


def floating_dtype(name: str) -> bool:
    """Whether a dtype named as safetensors names it (F32, BF16, F8_E4M3, I64, BOOL) or as torch does
    (float32, bfloat16, int64; vLLM's dtype_names) is floating point: every such name starts with F or
    BF, no other does."""
    return name.removeprefix("torch.").upper().startswith(("F", "BF"))


@dataclass(frozen=True)
class Mismatch:
    """How new weights differ from the served model's tensors; false when they match."""

    missing: list[str] = field(default_factory=list)  # the model's names the new weights lack, sorted
    unexpected: list[str] = field(default_factory=list)  # names the model lacks, sorted
    # (name, new shape, served shape), in the new weights' order
    wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    wrong_dtype: list[str] = field(default_factory=list)  # floating where the served one is not, or not

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.wrong_shape or self.wrong_dtype)


def compare(
    new: Mapping[str, Layout],
    served: Mapping[str, Layout],
    *,
    storage: Mapping[str, Hashable] | None = None,
) -> Mismatch:
    """The names, shapes and dtypes of `new` against `served`. storage: served name → the storage it
    shares (a data pointer); a served name absent from `new` is not missing when a tensor of `new` fills
    its storage."""
    storage = storage or {}
    filled = {storage[n] for n in new if n in storage}
    both = [(n, t, served[n]) for n, t in new.items() if n in served]
    return Mismatch(
        missing=sorted(n for n in served.keys() - new.keys() if n not in storage or storage[n] not in filled),
        unexpected=sorted(new.keys() - served.keys()),
        wrong_shape=[(n, t.shape, s.shape) for n, t, s in both if t.shape != s.shape],
        wrong_dtype=[n for n, t, s in both if t.floating != s.floating],
    )


def nonfinite(t: Any) -> int:
    """How many elements of the tensor `t` are NaN or inf (0 for a tensor that is not floating point).
    NaN and inf propagate through a sum, so a finite sum proves every element finite in one pass at memory
    speed (about 50x faster than isfinite on CPU, which dominated a weight update's load time); only a
    non-finite sum — a bad value, or finite values whose sum overflows — pays for the exact count."""
    import torch

    if not t.is_floating_point():
        return 0
    wide = torch.float32 if t.element_size() < 4 else None  # a float16 sum overflows at 65504
    if bool(torch.isfinite(t.sum(dtype=wide))):
        return 0
    return int(t.numel() - torch.isfinite(t).sum())


def finite_problem(name: str, served: Any, label: str, *, arrived: Any = None) -> str | None:
    """Why tensor `name` of `label` must not load — it holds NaN or inf — or None. `served`: the tensor as
    it will be served (cast to the served dtype); `arrived`: the dtype it came in, named in the message
    when the cast changed it."""
    bad = nonfinite(served)
    if not bad:
        return None
    cast = f" after the cast to {served.dtype}" if arrived is not None and arrived != served.dtype else ""
    return (
        f"{name!r} in {label} has {bad} non-finite values (NaN or inf{cast}); refused, the current weights "
        "are kept"
    )


def file_layouts(
    paths: list[tuple[str, str]], *, check_finite: bool = False, served_dtype: str | None = None
) -> dict[str, Layout]:
    """Tensor name → layout from the headers of the (label, path) safetensors files. With check_finite,
    every floating tensor is also read once (one at a time, so memory stays at the largest tensor), cast
    to `served_dtype` (a torch dtype name; None: as stored) and refused with a ValueError if it holds a
    NaN or inf (`finite_problem`). A file that is not safetensors is a ValueError naming it."""
    import torch
    from safetensors import safe_open

    layouts: dict[str, Layout] = {}
    cast_to = getattr(torch, served_dtype) if served_dtype else None
    for label, path in paths:
        problem = None
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                    header = f.get_slice(name)
                    layouts[name] = Layout(tuple(header.get_shape()), floating_dtype(header.get_dtype()))
                    if check_finite and problem is None and layouts[name].floating:
                        t = f.get_tensor(name)
                        served = t if cast_to is None else t.to(cast_to)
                        problem = finite_problem(name, served, label, arrived=t.dtype)
        except Exception as e:  # SafetensorError (truncated, not safetensors) is no ValueError subclass
            raise ValueError(f"{label} is not a readable safetensors file: {e}") from e
        if problem is not None:
            raise ValueError(problem)
    return layouts


def directory_layouts(directory: Path) -> dict[str, Layout]:
    """The layouts of every *.safetensors file in `directory` (a model the engine serves from disk)."""
    return file_layouts([(str(p), str(p)) for p in sorted(Path(directory).glob("*.safetensors"))])


def tied_storage(model_dir: Path) -> dict[str, str]:
    """`compare`'s storage map of a model whose config ties the output head to the input embedding
    (`tie_word_embeddings`, as SmolLM2): its files may store `lm_head.weight` beside the embedding, but a
    push carries the shared tensor once (weight_sync/delta.replica_copy) and the engine ties it back."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not config.get("tie_word_embeddings", False):
        return {}
    names = directory_layouts(model_dir)
    shared = [n for n in names if n.endswith("lm_head.weight") or n.endswith("embed_tokens.weight")]
    return {n: "tied embedding" for n in shared} if len(shared) == 2 else {}


def check_adapter(
    spec: Any, tensors: Mapping[str, Any], base_layouts: Mapping[str, Layout], *, max_rank: int
) -> None:
    """Raise ValueError, naming the module, unless `tensors` are a LoRA adapter this base can serve
    (docs/lora.md, "Names and maths"). spec: its `AdapterSpec`; tensors: {"<module>.lora_A.weight": [r, in],
    "<module>.lora_B.weight": [out, r]} (torch); base_layouts: the served base's tensors; max_rank: the
    engine's max_lora_rank.

    Each "<module>" must be a Linear of the base (a 2-D floating "<module>.weight" [out, in]) whose last
    name part, or the name itself, is in spec.target_modules (PEFT's matching; an engine that builds its
    LoRA layers from target_modules, as vLLM does, would otherwise skip it); A and B floating, of rank
    spec.rank and the Linear's in / out; every value finite (one NaN in B·A makes every logit NaN)."""
    from maskroll.proto.tensor_push import LORA_A, LORA_B

    rank = spec.rank
    if rank > max_rank:
        raise ValueError(f"adapter rank {rank} is above this replica's --max-lora-rank {max_rank}")
    modules: dict[str, dict[str, Any]] = {}
    for name, t in tensors.items():
        for suffix in (LORA_A, LORA_B):
            if name.endswith(suffix):
                modules.setdefault(name[: -len(suffix)], {})[suffix] = t
                break
        else:
            raise ValueError(
                f"tensor {name!r} is not a LoRA tensor ('<module>{LORA_A}' or '<module>{LORA_B}')"
            )
    if not modules:
        raise ValueError("the adapter has no tensors")
    targets = tuple(spec.target_modules)
    for module, pair in modules.items():
        if set(pair) != {LORA_A, LORA_B}:
            raise ValueError(f"LoRA module {module!r} has lora_A without lora_B or the reverse")
        base = base_layouts.get(module + ".weight")
        if base is None:
            raise ValueError(f"LoRA module {module!r}: the base has no weight {module + '.weight'!r}")
        if len(base.shape) != 2 or not base.floating:
            raise ValueError(
                f"LoRA module {module!r}: the base's {module + '.weight'!r} of shape {list(base.shape)} is "
                "not a Linear's floating [out, in] weight"
            )
        if targets and not any(module == t or module.endswith("." + t) for t in targets):
            raise ValueError(
                f"LoRA module {module!r} is not one of the adapter's target_modules {list(targets)}"
            )
        a, b = pair[LORA_A], pair[LORA_B]
        out_f, in_f = base.shape
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise ValueError(
                f"LoRA module {module!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the "
                f"base's [out, in] = {[out_f, in_f]} at rank {rank}: expected [{rank}, {in_f}] and "
                f"[{out_f}, {rank}]"
            )
        for suffix, t in ((LORA_A, a), (LORA_B, b)):
            if not t.is_floating_point():
                raise ValueError(f"LoRA tensor {module + suffix!r} has dtype {t.dtype}, not floating point")
            problem = finite_problem(module + suffix, t, "the adapter")
            if problem is not None:
                raise ValueError(problem)


def check_checkpoint(
    checkpoint: checkpoints.Checkpoint | Path, reference_dir: Path, *, dtype: str | None = None
) -> None:
    """Refuse a checkpoint that breaks the weight rules (names, shapes, dtypes against the served model's
    files in `reference_dir`, finite values once cast to `dtype`, the engine's; None: as stored), before an
    engine that loads in place pauses for it (the vLLM engine). Reads the files `checkpoints` checked (no
    symlink followed, same inodes).

    vLLM reloads layer by layer into the live model (model_executor/model_loader/reload/inplace.py);
    a mismatch found there leaves the replica half-updated, so it is caught here, before pausing."""
    checkpoint = checkpoints.checkpoint_of(checkpoint)
    with checkpoints.open_checked(checkpoint) as opened:
        paths = [(str(f.real), checkpoints.fd_path(fd, f.real)) for f, fd in opened]
        new = file_layouts(paths, check_finite=True, served_dtype=dtype)
    if not new:
        raise FileNotFoundError(f"no tensors in {checkpoint}")
    m = compare(new, directory_layouts(reference_dir), storage=tied_storage(reference_dir))
    if m:
        kinds = f", wrong dtype (floating point or not) {m.wrong_dtype[:5]}" if m.wrong_dtype else ""
        raise ValueError(
            f"checkpoint {checkpoint} does not match the served model: missing {m.missing[:5]}, "
            f"unexpected {m.unexpected[:5]}, wrong shape {m.wrong_shape[:5]}{kinds}"
        )
