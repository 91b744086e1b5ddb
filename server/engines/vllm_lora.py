"""The vLLM engine's adapters: a pushed adapter (`LoraWeights`, the wire names) written as the PEFT adapter
directory vLLM's LoRA loader reads, and the bookkeeping of which are resident and in use
(`ResidentAdapters`). Pure: imports no vllm (the engine module hands the directory to `AsyncLLM.add_lora`).

Layout (what PEFT's `save_pretrained` writes and vLLM reads: lora/peft_helper.py PEFTHelper.from_local_dir,
lora/lora_model.py LoRAModel.from_local_checkpoint):
- adapter_config.json: peft_type LORA, r, lora_alpha, target_modules, bias none, task_type CAUSAL_LM;
  no rsLoRA / DoRA, so vLLM's scale is alpha / r, the one the trainer used (docs: the LoRA design).
- adapter_model.safetensors: "base_model.model.<module>.lora_A.weight" [r, in] and ".lora_B.weight"
  [out, r], the pushed dtype (vLLM casts to its lora_dtype, the model's by default).

Each adapter gets its own fresh directory under the replica's private spool (`weights.stream.spool_root`),
named by its never-reused id: vLLM keys its prefix cache by (adapter name, path), and re-reads the
directory whenever its worker has dropped the adapter (a weight reload), so the directory lives exactly as
long as the adapter is resident.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from maskroll.proto.tensor_push import AdapterSpec

PEFT_PREFIX = "base_model.model."  # PEFT's wrapper names on disk, which vLLM strips (lora/utils.py)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def lora_linear_suffixes(model_dir: Path) -> list[str]:
    """The last name parts of the base's Linear weights (2-D "<module>.weight"), without the token
    embedding and the output head (any weight with a vocab_size dimension, and lm_head / embed_tokens by
    name): the modules a CPU replica gives LoRA layers (vllm_args' shim). Reads safetensors headers only."""
    from ..weights.tensor_rules import directory_layouts

    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    suffixes = set()
    for name, layout in directory_layouts(model_dir).items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(layout.shape) != 2 or not layout.floating or vocab in layout.shape:
            continue
        suffixes.add(module.rpartition(".")[2])
    suffixes -= {"lm_head", "embed_tokens"}
    if not suffixes:
        raise ValueError(f"{model_dir}: no Linear weight to give LoRA layers")
    return sorted(suffixes)


def peft_config(spec: AdapterSpec) -> dict[str, Any]:
    """adapter_config.json of an adapter (the fields vLLM's PEFTHelper reads, as PEFT spells them)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(spec.rank),
        "lora_alpha": float(spec.alpha),
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
    }


def peft_tensors(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Wire names "<module>.lora_A.weight" -> PEFT's on-disk "base_model.model.<module>.lora_A.weight",
    each tensor contiguous on the CPU (safetensors writes only those)."""
    return {PEFT_PREFIX + name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}


def write_peft_dir(root: Path, adapter_id: int, spec: AdapterSpec, tensors: Mapping[str, Any]) -> Path:
    """A new directory under `root` (mode 0700: the spool is the replica's own) holding the adapter in
    PEFT's layout. Nothing is left behind when writing fails."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix=f"maskroll-lora-{adapter_id}-", dir=root))
    try:
        (directory / CONFIG_FILE).write_text(json.dumps(peft_config(spec), indent=1))
        save_file(peft_tensors(tensors), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


class ResidentAdapters:
    """The engine's resident adapters (id -> ref and PEFT directory) and how many requests are sampling or
    scoring with each. Pure bookkeeping on the engine's event loop; the rules that keep vLLM safe:

    - at most `capacity` resident: vLLM would otherwise evict its least recently used adapter on its own
      (lora/worker_manager.py add_adapter), one the adapter table still counts as resident;
    - a request may name only a resident adapter, and an adapter in use cannot be removed: vLLM's worker
      loads an adapter it lacks from its directory inside a model step, so a request naming a removed
      adapter would fail there (or read a deleted directory) instead of being refused by name."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: dict[int, tuple[Any, Path]] = {}  # id -> (AdapterRef, directory)
        self._users: dict[int, int] = {}  # id -> requests naming it now

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[Any, Path]]:
        return list(self._entries.values())

    def check_room(self, ref: Any) -> None:
        if ref.id in self._entries:
            raise ValueError(f"adapter id {ref.id} is resident already ({self._entries[ref.id][0].name!r})")
        if len(self._entries) >= self.capacity:
            raise ValueError(
                f"{len(self._entries)} adapters resident, max_loras is {self.capacity}: remove one first"
            )

    def put(self, ref: Any, directory: Path) -> None:
        self.check_room(ref)
        self._entries[ref.id] = (ref, directory)

    def directory(self, ref: Any) -> Path:
        """The directory of a resident adapter; ValueError naming it (and what is resident) otherwise."""
        entry = self._entries.get(ref.id)
        if entry is None or entry[0].name != ref.name:
            resident = ", ".join(r.name for r, _ in self._entries.values()) or "none"
            raise ValueError(
                f"adapter {ref.name!r} (id {ref.id}) is not resident on this engine (removed, or never "
                f"added); resident: {resident}"
            )
        return entry[1]

    def take(self, ref: Any) -> Path:
        """Forget a resident adapter no request uses; its directory (for the caller to delete)."""
        directory = self.directory(ref)
        if self._users.get(ref.id):
            raise RuntimeError(
                f"adapter {ref.name!r} is in use by {self._users[ref.id]} request(s); "
                "remove it once they finish"
            )
        del self._entries[ref.id]
        return directory

    def clear(self) -> list[Path]:
        directories = [d for _, d in self._entries.values()]
        self._entries.clear()
        return directories

    def hold(self, ref: Any | None, delta: int) -> None:
        """Count a request naming `ref` in (+1) or out (-1); None (the base) counts nothing."""
        if ref is None:
            return
        n = self._users.get(ref.id, 0) + delta
        if n > 0:
            self._users[ref.id] = n
        else:
            self._users.pop(ref.id, None)

    @contextlib.contextmanager
    def holding(self, ref: Any | None) -> Iterator[None]:
        self.hold(ref, +1)
        try:
            yield
        finally:
            self.hold(ref, -1)
