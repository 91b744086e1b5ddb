"""The model's text side for the HTTP front end: tokenizer, chat template, detokenization, tool calls.

Loaded once per process from the model directory (transformers' AutoTokenizer: tokenizer.json and the
`chat_template` of tokenizer_config.json). Engines see token ids only; every text ⇄ token conversion of
the OpenAI endpoints happens here.

Token-exact multi-turn conversations rest on one rule, `continuation`: after the model's turn, only what
comes next is tokenized — the template's end of that turn that the model did not generate itself (the
"\\n" after its end-of-turn token, or the whole end-of-turn after a length cut), then the new messages
and the next generation prompt. They are rendered after a fixed stand-in conversation and cut off it, so
the earlier turns are never re-rendered or re-tokenized: the engine keeps reading the ids it sampled.

Tool calls are read in the Hermes format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`),
which Qwen 2.5 / 3, Hermes models and `maskroll init-model`'s template use. Knows nothing of engines,
sessions or HTTP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ..errors import InvalidArgument

log = logging.getLogger(__name__)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which the ByteLevel pre-tokenizer uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


# A conversation the new messages are rendered after, then cut off: its text never reaches the engine.
_STAND_IN = ({"role": "user", "content": "?"}, {"role": "assistant", "content": "?"})
_SENTINEL = "MASKROLL-END-OF-TURN-PROBE"
_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Tokens decoded before the new ones when detokenizing incrementally: enough context for a tokenizer
# that drops or merges leading spaces (SentencePiece) to decode the new tokens as in the whole text.
_DECODE_CONTEXT = 4
# A text longer than max_model_len tokens of the vocabulary's longest token string could hold, times
# this margin (a normalizer may compose characters: NFC, NFKC), cannot fit the context: it is refused
# before it is tokenized. Without the bound a 15 MiB message (under the body limit) took 30 s of
# templating and tokenization and left the process 1 GB larger, only to be refused for its length.
TEXT_MARGIN = 4
T = TypeVar("T")


class ChatFormat:
    """The model directory's tokenizer and chat template."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_dir = model_dir
        self.has_template = bool(getattr(self.tokenizer, "chat_template", None))
        self._special = frozenset(self.tokenizer.all_special_ids)
        self._token_text: dict[int, str] = {}
        self.turn_end = self._turn_end() if self.has_template else ""
        # The longest token as a string (a byte-level token's string has a character per byte, so it is
        # never shorter than the text the token stands for).
        self.max_token_chars = max(1, max(map(len, self.tokenizer.get_vocab()), default=1))
        self.max_text_chars: int | None = None  # set by `limit`
        # Templating and tokenization run here, off the event loop, one call at a time (a fast
        # tokenizer's settings are not safe to touch from two threads at once).
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="maskroll-tokenize")

    def limit(self, max_model_len: int) -> None:
        """Refuse texts that cannot fit `max_model_len` tokens before tokenizing them (TEXT_MARGIN)."""
        self.max_text_chars = max_model_len * self.max_token_chars * TEXT_MARGIN

    def check_text(self, chars: int, what: str = "prompt_token_ids") -> None:
        """InvalidArgument, naming `what`, when `chars` characters of text cannot fit the context."""
        if self.max_text_chars is not None and chars > self.max_text_chars:
            raise InvalidArgument(
                f"{what}: the text has {chars} characters, more than the model's context can hold "
                f"(at most {self.max_text_chars} characters, for max_model_len tokens); nothing was "
                "tokenized"
            )

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` (templating, tokenization) in this tokenizer's own thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, functools.partial(fn, *args))

    # ---- tokens ⇄ text ---------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer adds to a whole prompt (BOS).
        A text longer than the context could hold is refused first (`limit`)."""
        self.check_text(len(text))
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        """Text shown to a client: special tokens (EOS, end of turn) left out, as OpenAI servers do."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (the `token` of OpenAI's logprobs); cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([int(token_id)])
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (OpenAI's `bytes`): a byte-level BPE token that is part of a UTF-8
        character decodes to U+FFFD, so its bytes come from the token string (GPT-2's byte map, or a
        SentencePiece byte-fallback piece "<0xE2>")."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(piece, str):
            if all(c in _UNICODE_TO_BYTE for c in piece):
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            if m := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
        return text.encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special

    def decoder(self, prompt_ids: Sequence[int]) -> IncrementalDecoder:
        return IncrementalDecoder(self, prompt_ids)

    # ---- chat template ---------------------------------------------------------------------------

    def render(self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
        if not self.has_template:
            raise InvalidArgument(
                f"messages: the model in {self.model_dir} has no chat template (tokenizer_config.json "
                "chat_template); use /v1/completions with a prompt"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja2's TemplateError, or the template's own raise_exception()
            raise InvalidArgument(f"messages: the model's chat template refused them: {exc}") from exc

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """A whole conversation, ready for the model's next turn (the template supplies BOS)."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True), add_special_tokens=False)

    def continuation(
        self, new_messages: list[dict], tools: list[dict] | None, *, ended_with_stop: int | None
    ) -> list[int] | None:
        """The tokens that follow the model's last turn: the rest of its end of turn, then `new_messages`
        and the generation prompt. ended_with_stop: the stop token the turn ended on (None: a length
        cut or a stop string, after which the whole end of turn follows). None when this template
        renders a conversation differently from its prefix (the caller then starts a new segment)."""
        base = self.render(list(_STAND_IN), tools, add_generation_prompt=False)
        full = self.render([*_STAND_IN, *new_messages], tools, add_generation_prompt=True)
        if not full.startswith(base):
            return None
        closing = self.turn_end
        if ended_with_stop is not None and self.is_special(ended_with_stop):
            emitted = self.token_text(ended_with_stop)
            if closing.startswith(emitted):  # the model wrote its end-of-turn token itself
                closing = closing[len(emitted) :]
        return self.encode(closing + full[len(base) :], add_special_tokens=False)

    def _turn_end(self) -> str:
        """The text the template puts after an assistant message's content (e.g. "<|im_end|>\\n")."""
        text = self.render(
            [_STAND_IN[0], {"role": "assistant", "content": _SENTINEL}], None, add_generation_prompt=False
        )
        at = text.rfind(_SENTINEL)
        if at < 0:
            log.warning("the chat template drops assistant content; turns are closed with nothing")
            return ""
        return text[at + len(_SENTINEL) :]


class IncrementalDecoder:
    """Text deltas of a growing token sequence without re-decoding all of it (vLLM's incremental
    detokenization): each step decodes a short window before the new tokens and emits what the new
    tokens add, holding back an incomplete UTF-8 character until its last byte arrives."""

    def __init__(self, chat: ChatFormat, prompt_ids: Sequence[int]) -> None:
        self._chat = chat
        self._ids = [int(t) for t in prompt_ids[-_DECODE_CONTEXT:]]
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        before = self._chat.decode(self._ids[self._prefix : self._read])
        after = self._chat.decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """What is held back at the end (an incomplete character decodes as U+FFFD)."""
        before = self._chat.decode(self._ids[self._prefix : self._read])
        after = self._chat.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a model's turn in the Hermes format; ([text], []) when it has no
    well-formed tool call (a block that is not JSON with a string "name" leaves the whole text as content)."""
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    if not calls:
        return text, []
    return (_TOOL_CALL.sub("", text).strip() or None), calls
