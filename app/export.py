"""`maskroll export-model`: a run's saved version as a Hugging Face model (or a PEFT adapter) to evaluate
and serve elsewhere.

    maskroll export-model --weights-root ROOT [--version V] --model BASE_DIR --out DIR [--merge]

ROOT is a run's save root (`weight_sync/checkpoint.py`'s layout, `<root>/v<version>/`): of a LoRA run each
version directory holds the adapter as `weight_sync.lora.save_adapter` writes it (PEFT's layout, the base
fingerprint in the safetensors metadata), of a full run `model.safetensors`. BASE_DIR is the model the
run started from (the replicas' `--model`): its config, tokenizer files and chat template go with every
exported model, and an adapter is merged into its weights.

What is written to DIR:
- a LoRA version with --merge: the merged model, `W' = W + (alpha / r) · B A` per adapted Linear
  (`lora.merge`, in the base's dtype) in one `model.safetensors`, beside the base's other files: what
  `transformers` and `maskroll serve --model DIR` load;
- a LoRA version without --merge: the PEFT adapter directory (`peft.PeftModel.from_pretrained(base, DIR)`,
  vLLM's `LoRARequest`), its `base_model_name_or_path` naming BASE_DIR;
- a full version (either way): the version's `model.safetensors` beside the base's other files.

Refused, before anything is written: a version that does not exist (the versions that do are named), an
adapter trained on another base than BASE_DIR (fingerprints differ: the merge would be silently wrong),
full weights that do not fit BASE_DIR's tensors, and a DIR that exists and is not empty. The output is
written to a temporary directory beside DIR and renamed into place, so DIR is whole or absent. Progress
goes to stderr. Knows nothing of queues, replicas or runs in Redis.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# The base's files that are weights (replaced by the export's) rather than config / tokenizer / template.
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|gguf)$|.*\.safetensors\.index\.json$")
_VERSION_DIR = re.compile(r"v(\d+)")


class ExportError(ValueError):
    """What `export-model` refuses; the message says why and what to do."""


def _stderr(line: str) -> None:
    print(f"export-model: {line}", file=sys.stderr, flush=True)


def saved_versions(root: str | os.PathLike) -> dict[int, str]:
    """{version: "lora" | "full"} of every complete version directory under `root`."""
    from maskroll.weight_sync.checkpoint import CHECKPOINT_FILE
    from maskroll.weight_sync.lora import CONFIG_FILE, WEIGHTS_FILE

    found: dict[int, str] = {}
    for d in Path(root).iterdir() if Path(root).is_dir() else ():
        m = _VERSION_DIR.fullmatch(d.name)
        if m is None or not d.is_dir():
            continue
        # the files are renamed into place when complete: a version being written has neither yet
        if (d / CONFIG_FILE).is_file() and (d / WEIGHTS_FILE).is_file():
            found[int(m.group(1))] = "lora"
        elif (d / CHECKPOINT_FILE).is_file():
            found[int(m.group(1))] = "full"
    return dict(sorted(found.items()))


def _choose(root: Path, version: int | None) -> tuple[int, str]:
    versions = saved_versions(root)
    if not versions:
        raise ExportError(
            f"{root} holds no saved version (no v<N>/ with model.safetensors or an adapter): is it the "
            "run's save root (MaskrollConfig.weights_root, the recipe's --save-root)?"
        )
    if version is None:
        version = max(versions)
    if version not in versions:
        listed = ", ".join(str(v) for v in versions)
        raise ExportError(f"version {version} is not saved under {root}; saved versions: {listed}")
    return version, versions[version]


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory: choose a new one")


def _base_weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"--model {model_dir} has no *.safetensors: the base's weights are needed")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _copy_base_files(model_dir: Path, dst: Path) -> list[str]:
    """The base's config, generation config, tokenizer files and chat template (every top-level file
    that is not weights) copied to `dst`; their names."""
    copied = []
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and not _WEIGHT_FILE.fullmatch(f.name):
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    if "config.json" not in copied:
        raise ExportError(f"--model {model_dir} has no config.json: is it a Hugging Face model directory?")
    return copied


def _check_fits(base: Path, weights: Path) -> None:
    """Full weights against the base's tensors: the same names (a tied lm_head may be either side's
    extra) and shapes, or the base's config does not describe them."""
    from safetensors import safe_open

    def shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
        out = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[name] = tuple(f.get_slice(name).get_shape())
        return out

    want, have = shapes(sorted(base.glob("*.safetensors"))), shapes([weights])
    tied = {"lm_head.weight"}
    missing, extra = sorted(set(want) - set(have) - tied), sorted(set(have) - set(want) - tied)
    wrong = sorted(n for n in set(want) & set(have) if want[n] != have[n])
    if missing or extra or wrong:
        detail = "; ".join(
            f"{what} {names[:3]}{' …' if len(names) > 3 else ''}"
            for what, names in (("missing", missing), ("unexpected", extra), ("other shapes", wrong))
            if names
        )
        raise ExportError(f"{weights} does not fit --model {base}'s tensors ({detail}): another base model?")


def _save_state(state: dict, path: Path) -> None:
    from safetensors.torch import save_file

    # {"format": "pt"}: transformers refuses a safetensors file without it
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})


def export_model(
    weights_root: str | os.PathLike,
    model_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    version: int | None = None,
    merge: bool = False,
    progress: Callable[[str], None] = _stderr,
) -> Path:
    """Export version `version` (default: the newest) of the run saved under `weights_root`, the base
    being `model_dir`, into `out` (see the module docstring for what is written); returns `out`.
    Raises ExportError for what is refused."""
    from maskroll.server.weights.dir_fingerprint import fingerprint_dir
    from maskroll.weight_sync import lora
    from maskroll.weight_sync.checkpoint import CHECKPOINT_FILE, checkpoint_dir

    root, base, out = Path(weights_root), Path(model_dir), Path(out)
    if not base.is_dir():
        raise ExportError(f"--model {base} is not a directory")
    _check_out(out)
    version, kind = _choose(root, version)
    src = checkpoint_dir(root, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if kind == "full":
            progress(f"version {version} of {root}: full weights ({src / CHECKPOINT_FILE})")
            _check_fits(base, src / CHECKPOINT_FILE)
            _copy_base_files(base, tmp)
            shutil.copy2(src / CHECKPOINT_FILE, tmp / CHECKPOINT_FILE)
            what = "the model"
        else:
            try:
                spec, tensors = lora.load_adapter(src)
            except lora.LoraUnsupported as e:
                raise ExportError(f"version {version}'s adapter: {e}") from e
            modules = len(tensors) // 2
            progress(
                f"version {version} of {root}: LoRA adapter, rank {spec.rank}, alpha {spec.alpha:g}, "
                f"{modules} modules ({', '.join(spec.target_modules)})"
            )
            served = fingerprint_dir(base)
            if not spec.base_fingerprint:
                progress("the adapter names no base fingerprint (not saved by maskroll): base not checked")
            elif spec.base_fingerprint != served:
                raise ExportError(
                    f"version {version}'s adapter was trained on base {spec.base_fingerprint}, but --model "
                    f"{base} is {served or 'a directory without safetensors'}: pass the model the run "
                    "started from"
                )
            else:
                progress(f"base {base} matches the adapter's ({served})")
            if merge:
                state = _base_weights(base)
                progress(f"merging W + {spec.scale:g}·B·A into {modules} weights of {len(state)} tensors")
                try:
                    merged = lora.merge(state, spec, tensors)
                except (KeyError, ValueError) as e:
                    raise ExportError(f"the adapter does not fit --model {base}: {e}") from e
                _copy_base_files(base, tmp)
                _save_state(merged, tmp / CHECKPOINT_FILE)
                what = "the merged model"
            else:
                lora.save_adapter(tmp, spec, tensors, base_model=str(base.resolve()))
                what = "the PEFT adapter (--merge writes the merged model)"
        # mkdtemp's 0700 and safetensors' 0600 would keep a serving container of another user out
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            out.rmdir()  # empty (checked above); the rename below needs the name free
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.iterdir())
    progress(f"wrote {what} to {out} ({len(list(out.iterdir()))} files, {size / 1e6:.1f} MB)")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="maskroll export-model",
        description="Export a run's saved version as a Hugging Face model directory (--merge: a LoRA "
        "adapter merged into its base) or as a PEFT adapter directory.",
    )
    p.add_argument(
        "--weights-root",
        required=True,
        type=Path,
        help="the run's save root: <root>/v<version>/ holds each saved version",
    )
    p.add_argument("--version", type=int, default=None, help="the version to export (default: the newest)")
    p.add_argument(
        "--model",
        required=True,
        type=Path,
        help="the base model directory the run started from (config, tokenizer; an adapter's base)",
    )
    p.add_argument("--out", required=True, type=Path, help="output directory (new, or empty)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA version: write the merged model (base + scale·B·A) instead of the PEFT adapter",
    )
    a = p.parse_args(argv)
    try:
        export_model(a.weights_root, a.model, a.out, version=a.version, merge=a.merge)
    except ExportError as e:
        print(f"maskroll export-model: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
