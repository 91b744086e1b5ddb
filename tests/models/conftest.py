"""Fixtures of the real-model tests: SmolLM2-135M-Instruct converted once (per venv: `smollm2.cached`
keeps it under <venv>/var/maskroll-models, so only the first session pays the ~30 s conversion), and
its float32 reference model loaded once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from maskroll.app import smollm2

    try:
        return smollm2.cached("float32")
    except smollm2.SmolLM2Missing as exc:  # `make test` installs it; a bare venv skips with the hint
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_dir: Path):
    """(transformers float32 model, tokenizer) of the converted directory: the reference forward pass."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(smollm2_dir)
