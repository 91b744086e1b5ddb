"""A tokenizer fingerprint: which id → token map a tokenizer has, in a few bytes, computed the same way by a
replica (from its `--model` directory, reported in GetInfo) and by the teacher stage (from `--tokenizer`).

Why: a teacher scores the ids a student sampled. Two tokenizers of one vocab_size that give some id
another token (another model family, a re-trained BPE) would make the teacher score other text than the
student wrote, without an error anywhere; the teacher stage compares fingerprints at start-up and refuses
such a teacher by name (docs/rewards.md "The teacher stage"). Comparing over GetInfo works for teachers
whose tokenizer is not on the stage's disk.

What is hashed: the SHA-256 of the JSON list of (id, token) pairs sorted by id — the model's vocabulary and
the added tokens (an added token wins where both name an id). Merges, normalisers and pre-tokenisers are
left out: they decide how text is split into ids, not which token an id is, and the stage only ever hands a
teacher ids. A fast Hugging Face tokenizer's `get_vocab()` is the same map, so a directory without a
tokenizer.json hashes alike through `vocab_fingerprint(get_vocab())` (its caller imports transformers;
this module is standard library only).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

PREFIX = "tok1:"  # the scheme, so a future one never compares equal to this


def vocab_fingerprint(vocab: Mapping[str, int]) -> str:
    """The fingerprint of a token → id map (a tokenizer's get_vocab(), added tokens included)."""
    pairs = sorted((int(i), str(tok)) for tok, i in vocab.items())
    return PREFIX + hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()[:32]


def tokenizer_json_vocab(path: str | Path) -> dict[str, int] | None:
    """token → id of a tokenizer.json (its model's vocab, then its added tokens), or None when the file
    holds no vocabulary this module reads (a model kind without one)."""
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    vocab = spec.get("model", {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
        out = {str(tok): int(i) for tok, i in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: [[token, score], ...] in id order
        out = {str(entry[0]): i for i, entry in enumerate(vocab)}
    else:
        return None
    by_id = {i: tok for tok, i in out.items()}
    for added in spec.get("added_tokens", []):
        i = int(added["id"])
        out.pop(by_id.get(i, ""), None)  # an added token replaces the model's entry for its id
        out[str(added["content"])] = i
    return out


def fingerprint_tokenizer_json(directory: str | Path) -> str | None:
    """The fingerprint of `directory`/tokenizer.json, or None when there is none (or no vocabulary in it)."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    vocab = tokenizer_json_vocab(path)
    return None if vocab is None else vocab_fingerprint(vocab)
