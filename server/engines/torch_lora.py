"""The torch engine's LoRA: resident adapters applied per row on the base model's Linear layers.

An adapter on the Linear "<module>" (weight W [out, in]) changes its output to
    y = x Wᵀ + scale · (x Aᵀ) Bᵀ,   A [r, in], B [out, r], scale = alpha / r
(PEFT's default; no rsLoRA, DoRA or bias), which is x (W + scale · B A)ᵀ: the merged weights up to float
rounding. W is never modified, so the base and every adapter stay exact whatever is resident, and a full
weight update swaps W under the adapters without touching them.

Per row: one batched forward may hold rows of several adapters and rows of none (several runs served by
one replica). A forward hook on each Linear that some resident adapter targets adds each adapter's term to
its own rows only (`lora_rows`); a row of no adapter, and a Linear its adapter does not target, get
nothing. The engine says which rows are whose before each forward (`LoraLayers.rows`).

Threads: `check` may run anywhere (a dict lookup); `prepare` (checks and casts, changes nothing) off the
decode thread; `install`, `remove` and `rows` on the decode thread only, between forwards, so a forward
never sees an adapter half installed. Knows nothing of requests, queues or versions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from maskroll.proto.tensor_push import LORA_A, LORA_B

from .contract import AdapterRef, LoraWeights

Tensor = torch.Tensor


@dataclass(frozen=True)
class LoraPair:
    """One adapter's term on one Linear, in the engine's dtype and device (cast once, when added)."""

    a: Tensor  # [r, in]
    b: Tensor  # [out, r]
    scale: float  # alpha / r


# (the rows of the batch it applies to: int64 [n] indices, None = every row; the adapter's term)
Group = tuple[Tensor | None, LoraPair]


def lora_rows(y: Tensor, x: Tensor, groups: list[Group]) -> Tensor:
    """y[rows] += scale · (x[rows] Aᵀ) Bᵀ for each group, in place; returns y. A row is in one group at
    most; a row in none keeps the base output.

    Args:
        y: [B, ..., out] the base Linear's output x Wᵀ (+ its bias).
        x: [B, ..., in] the Linear's input; dim 0 is the batch row.
    """
    for rows, p in groups:
        if rows is None:  # one adapter for the whole batch (a prefill, a score, a batch of one run)
            y.add_((x @ p.a.T) @ p.b.T, alpha=p.scale)  # [B, ..., r] -> [B, ..., out]
        else:
            y.index_add_(0, rows, (x[rows] @ p.a.T) @ p.b.T, alpha=p.scale)  # [n, ..., out]
    return y


class LoraLayers:
    """The adapters resident in one model (at most `max_loras`, rank at most `max_rank`; 0 = LoRA off), by
    `AdapterRef.id`, and the forward hooks that apply them."""

    def __init__(self, model: torch.nn.Module, *, max_rank: int, max_loras: int) -> None:
        self.max_rank, self.max_loras = int(max_rank), int(max_loras)
        weight = next(model.parameters())  # the engine's dtype and device: adapters are cast to them
        self._model, self._dtype, self._device = model, weight.dtype, weight.device
        self._refs: dict[int, AdapterRef] = {}  # resident adapters by id
        self._pairs: dict[str, dict[int, LoraPair]] = {}  # module -> {adapter id: its term}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}  # one per module in _pairs
        self._plan: list[tuple[int, Tensor | None]] = []  # the running forward's (adapter id, rows)

    @property
    def resident(self) -> tuple[AdapterRef, ...]:
        return tuple(self._refs.values())

    def check(self, ref: AdapterRef) -> None:
        """A request's guard: ValueError unless `ref` is resident (exactly this ref under its id)."""
        if self.max_rank == 0:
            raise ValueError(
                f"adapter {ref.name!r}: the torch engine takes no LoRA adapters (max_lora_rank 0)"
            )
        if self._refs.get(ref.id) != ref:
            raise ValueError(
                f"adapter {ref.name!r} (id {ref.id}) is not resident in the torch engine (removed, or "
                f"never added); resident: {self._names()}"
            )

    def prepare(self, ref: AdapterRef, weights: LoraWeights) -> dict[str, LoraPair]:
        """{module: its term}: `weights` checked against the model and cast to the engine's dtype and
        device. The replica's tensor rules checked them already; the engine refuses on its own what it
        cannot apply, naming it (ValueError). Changes nothing."""
        spec, name = weights.spec, f"adapter {ref.name!r}"
        if self.max_rank == 0:
            raise ValueError(f"{name}: the torch engine takes no LoRA adapters (max_lora_rank 0)")
        if not 1 <= spec.rank <= self.max_rank:
            raise ValueError(f"{name}: rank {spec.rank} is not in [1, max_lora_rank {self.max_rank}]")
        if ref.id in self._refs:
            raise ValueError(f"{name}: id {ref.id} is resident already ({self._refs[ref.id].name!r})")
        halves: dict[str, dict[str, Tensor]] = {}
        for key, t in weights.tensors.items():
            suffix = LORA_A if key.endswith(LORA_A) else LORA_B if key.endswith(LORA_B) else None
            if suffix is None:
                raise ValueError(f"{name}: tensor {key!r} is not '<module>{LORA_A}' or '<module>{LORA_B}'")
            halves.setdefault(key[: -len(suffix)], {})[suffix] = t
        if not halves:
            raise ValueError(f"{name} has no tensors")
        pairs = {}
        for module, ab in halves.items():
            if len(ab) != 2:
                raise ValueError(f"{name}: module {module!r} has lora_A without lora_B or the reverse")
            a, b = ab[LORA_A], ab[LORA_B]
            try:
                layer = self._model.get_submodule(module) if module else None
            except AttributeError:
                layer = None
            if layer is None:
                raise ValueError(f"{name}: the model has no module {module!r}")
            if not isinstance(layer, torch.nn.Linear):
                raise ValueError(f"{name}: module {module!r} is a {type(layer).__name__}, not a Linear")
            want_a, want_b = (spec.rank, layer.in_features), (layer.out_features, spec.rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ValueError(
                    f"{name}: module {module!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are "
                    f"not {list(want_a)} and {list(want_b)} (rank {spec.rank})"
                )
            for half, t in ((LORA_A, a), (LORA_B, b)):
                if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{name}: {module + half!r} is not finite floating point ({t.dtype})")
            # copy=True: the engine owns its tensors (the caller's dict may be reused or freed).
            cast = {"device": self._device, "dtype": self._dtype, "copy": True}
            pairs[module] = LoraPair(a.to(**cast).contiguous(), b.to(**cast).contiguous(), spec.scale)
        return pairs

    def install(self, ref: AdapterRef, pairs: dict[str, LoraPair]) -> None:
        """Make `ref` resident with its prepared terms (decode thread, between forwards)."""
        if ref.id in self._refs:
            raise ValueError(f"adapter {ref.name!r}: id {ref.id} is resident already")
        if len(self._refs) >= self.max_loras:
            raise ValueError(
                f"adapter {ref.name!r}: max_loras {self.max_loras} adapters are resident already "
                f"({self._names()}): remove one first"
            )
        for module, pair in pairs.items():
            if module not in self._pairs:
                self._pairs[module] = {}
                layer = self._model.get_submodule(module)
                self._hooks[module] = layer.register_forward_hook(self._hook(self._pairs[module]))
            self._pairs[module][ref.id] = pair
        self._refs[ref.id] = ref

    def remove(self, ref: AdapterRef) -> None:
        """Drop `ref` (decode thread); a Linear no resident adapter targets loses its hook."""
        if self._refs.get(ref.id) != ref:
            raise ValueError(f"adapter {ref.name!r} (id {ref.id}) is not resident in the torch engine")
        del self._refs[ref.id]
        for module in list(self._pairs):
            self._pairs[module].pop(ref.id, None)
            if not self._pairs[module]:
                del self._pairs[module]
                self._hooks.pop(module).remove()

    @contextlib.contextmanager
    def rows(self, refs: list[AdapterRef | None]) -> Iterator[None]:
        """The forward run inside applies refs[i] to batch row i (None: the base alone). ValueError
        (before the forward) when one is not resident."""
        ids = []
        for ref in refs:
            if ref is not None:
                self.check(ref)
            ids.append(None if ref is None else ref.id)
        if len(set(ids)) == 1:  # one adapter (or none) for every row: no indexing
            self._plan = [] if ids[0] is None else [(ids[0], None)]
        else:
            by_id: dict[int, list[int]] = {}
            for i, a in enumerate(ids):
                if a is not None:
                    by_id.setdefault(a, []).append(i)
            self._plan = [(a, torch.tensor(rows, device=self._device)) for a, rows in by_id.items()]
        try:
            yield
        finally:
            self._plan = []

    def _names(self) -> list[str]:
        return [r.name for r in list(self._refs.values())]  # list(): one atomic copy, from any thread

    def _hook(self, pairs: dict[int, LoraPair]):
        """The forward hook of one Linear: its output plus the terms of the rows' adapters that target it.
        `pairs` is that Linear's live {adapter id: term} (install and remove edit it in place)."""

        def hook(_module: torch.nn.Module, args: tuple, out: Tensor) -> Tensor | None:
            groups = [(rows, pairs[a]) for a, rows in self._plan if a in pairs]
            return lora_rows(out, args[0], groups) if groups else None

        return hook
