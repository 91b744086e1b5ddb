"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions (pure conversions).

Requests: pydantic models of the fields maskroll serves (`n`, `temperature`, `top_p`, `max_tokens` /
`max_completion_tokens`, `stop`, `seed`, `logprobs` / `top_logprobs`, `stream`, `tools`) plus vLLM's
extensions (`top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids`). Unknown fields are ignored,
as OpenAI-compatible servers do; known fields that would change the distribution the tokens are sampled
from without the record saying so (penalties, logit_bias, min_p, guided output) are refused (400), so a
record's logprobs always describe the μ it was sampled from. `sampling_options` turns a request into
the SDK's SamplingOptions, which the pipeline validates with the same rules as gRPC.

Responses: dicts in OpenAI's JSON shapes, logprobs as OpenAI spells them (chat: `logprobs.content[i]`
with `token`, `logprob`, `bytes`, `top_logprobs`; completions: `tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), the processed top-K of the engine sorted by rank, and the token ids as
vLLM's `return_token_ids` returns them. Knows nothing of engines, sessions or HTTP.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from maskroll.proto.records import SamplingOptions

from ...errors import InvalidArgument
from ..chat import ChatFormat

ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Refused unless neutral: they change μ and a record could not say how.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16:
            raise InvalidArgument(f"stop has {len(stops)} strings; at most 16")
        if any(not s for s in stops):
            raise InvalidArgument("stop holds an empty string")
        return stops

    def _refuse_unsupported(self, extra: dict[str, bool]) -> None:
        changes = {
            "presence_penalty": bool(self.presence_penalty),
            "frequency_penalty": bool(self.frequency_penalty),
            "logit_bias": bool(self.logit_bias),
            "min_p": bool(self.min_p),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            **extra,
        }
        for name, set_ in changes.items():
            if set_:
                raise InvalidArgument(
                    f"{name} is not supported: it would change the distribution tokens are sampled from "
                    "without the record's logprobs saying so"
                )
        if self.seed is not None and self.seed < 0:
            raise InvalidArgument(f"seed must be >= 0, got {self.seed}")


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self._refuse_unsupported(
            {
                "echo": self.echo,
                "suffix": bool(self.suffix),
                "best_of": self.best_of not in (None, self.n),
            }
        )
        p = self.prompt
        if isinstance(p, list) and len(p) > 1 and not isinstance(p[0], int):
            raise InvalidArgument(f"prompt holds {len(self.prompt)} prompts; send one per request")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        return p[0] if isinstance(p, list) and p and not isinstance(p[0], int) else p

    @property
    def logprobs_k(self) -> int:
        return self.logprobs or 0


class ChatRequest(_Request):
    messages: list[Any]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

    def check(self) -> None:
        named = isinstance(self.tool_choice, dict) or self.tool_choice == "required"
        self._refuse_unsupported(
            {
                "tool_choice": named,  # forcing a call needs constrained decoding: μ would not be the model's
                "response_format": (self.response_format or {}).get("type", "text") != "text",
            }
        )
        if not self.messages:
            raise InvalidArgument("messages is empty; a conversation needs at least one message")

    @property
    def logprobs_k(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def tools_active(self) -> list[dict] | None:
        return self.tools if self.tools and self.tool_choice != "none" else None


def parse_request(cls: type[_Request], body: object) -> Any:
    """A validated request; InvalidArgument naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidArgument(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise InvalidArgument(f"{where}: {err['msg']} (got {str(err.get('input'))[:80]!r})") from None
    req.check()
    return req


def normalize_messages(raw: list[Any]) -> list[dict]:
    """Messages as the chat template renders them and a session compares them: role, content as one
    string or None (text parts joined), tool_calls as {id, type, function: {name, arguments}},
    tool_call_id and name; whatever else a client sends along (refusal, audio, None fields) is dropped."""
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise InvalidArgument(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
        msg: dict[str, Any] = {"role": role, "content": _content(m.get("content"), i)}
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise InvalidArgument(f"messages[{i}].tool_calls must be a list of tool calls")
        if calls:
            msg["tool_calls"] = [_tool_call(c, i, j) for j, c in enumerate(calls)]
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _content(content: Any, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content or None
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise InvalidArgument(f"messages[{i}].content[{j}]: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts) or None
    raise InvalidArgument(f"messages[{i}].content must be a string or a list of text parts")


def _tool_call(call: Any, i: int, j: int) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise InvalidArgument(f"messages[{i}].tool_calls[{j}] needs function.name")
    args = fn.get("arguments", "")
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else str(args)},
    }


def sampling_options(req: _Request, *, max_tokens: int, logprobs_k: int) -> SamplingOptions:
    """The SDK's options for one request (n samples); the pipeline checks them against the replica."""
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        logprobs_k=logprobs_k,
        n=req.n,
        seed=req.seed,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )


# ---- responses ----------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# μ = 0 (a token outside top-k / top-p) has logprob -inf, which JSON cannot spell: vLLM's -9999.0.
NO_PROBABILITY = -9999.0


def json_floats(a: np.ndarray) -> list:  # float32 [n] or [t, k] -> the same nesting of Python floats
    """Logprobs for JSON: -inf as NO_PROBABILITY. Each float32 widens to the float64 of the same value
    (its repr has more digits than the float32 needs, but reads back to the same float32 exactly;
    formatting it shorter in Python costs the event loop more than the bytes save)."""
    return np.maximum(a, np.float32(NO_PROBABILITY)).tolist()


def _entry(chat: ChatFormat, token_id: int, logprob: float) -> dict:
    return {"token": chat.token_text(token_id), "logprob": logprob, "bytes": list(chat.token_bytes(token_id))}


def chat_logprobs(
    chat: ChatFormat,
    token_ids: np.ndarray,  # int32 [t]
    sampled: np.ndarray,  # float32 [t]
    topk_ids: np.ndarray,  # int32 [t, K]
    topk_logprobs: np.ndarray,  # float32 [t, K], sorted by rank
    top: int,
) -> list[dict]:
    """OpenAI chat `logprobs.content` entries: the sampled token and its `top` most likely tokens."""
    rows = zip(
        token_ids.tolist(),
        json_floats(sampled),
        topk_ids[:, :top].tolist(),
        json_floats(topk_logprobs[:, :top]),
        strict=True,
    )
    return [
        {**_entry(chat, tok, lp), "top_logprobs": [_entry(chat, a, b) for a, b in zip(ids, lps, strict=True)]}
        for tok, lp, ids, lps in rows
    ]


def _by_text(chat: ChatFormat, ids: list[int], logprobs: list[float]) -> dict[str, float]:
    # Distinct tokens can share a text (byte tokens of partial UTF-8 characters all read U+FFFD): the
    # first, most likely one keeps the key, so the values stay in rank order.
    out: dict[str, float] = {}
    for t, lp in zip(ids, logprobs, strict=True):
        out.setdefault(chat.token_text(t), lp)
    return out


def completion_logprobs(
    chat: ChatFormat,
    token_ids: np.ndarray,  # int32 [t]
    sampled: np.ndarray,  # float32 [t]
    topk_ids: np.ndarray,  # int32 [t, K]
    topk_logprobs: np.ndarray,  # float32 [t, K], sorted by rank
    top: int,
    text_offset: int,
) -> dict:
    """OpenAI completions `logprobs`: parallel lists, `top_logprobs` as {token text: logprob}."""
    tokens = [chat.token_text(t) for t in token_ids.tolist()]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    tops = zip(topk_ids[:, :top].tolist(), json_floats(topk_logprobs[:, :top]), strict=True)
    return {
        "tokens": tokens,
        "token_logprobs": json_floats(sampled),
        "top_logprobs": [_by_text(chat, ids, lps) for ids, lps in tops],
        "text_offset": offsets,
    }


# ---- whole responses and streams (a prepared serving.Call and its pieces) -----------------------


def _logprobs(chat: ChatFormat, x, top: int, kind: str, offset: int = 0) -> dict | None:
    """Logprobs of a piece (token_ids) or a record (completion_ids) in `kind`'s shape; None if not asked."""
    if top < 0:
        return None
    ids = x.token_ids if hasattr(x, "token_ids") else x.completion_ids
    arrays = (ids, x.sampled_logprobs, x.topk_ids, x.topk_logprobs, top)
    if kind == "chat":
        return {"content": chat_logprobs(chat, *arrays)}
    return completion_logprobs(chat, *arrays, offset)


def _usage_of(call) -> dict:
    return usage(int(call.prompt_ids.size), sum(r.record.num_tokens for r in call.runs))


def chat_response(call, chat: ChatFormat) -> dict:
    choices = []
    for run in call.runs:
        rec = run.record
        content, calls, reason = call.reply(run)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice = {
            "index": run.index,
            "message": message,
            "logprobs": _logprobs(chat, rec, call.top, "chat"),
            "finish_reason": reason,
        }
        if call.return_token_ids:
            choice["token_ids"] = rec.completion_ids.tolist()
        choices.append(choice)
    out = {
        "id": call.id,
        "object": "chat.completion",
        "created": call.created,
        "model": call.model,
        "choices": choices,
        "usage": _usage_of(call),
    }
    if call.return_token_ids:
        out["prompt_token_ids"] = call.prompt_ids.tolist()
    return out


def completion_response(call, chat: ChatFormat) -> dict:
    choices = []
    for run in call.runs:
        rec = run.record
        choice = {
            "index": run.index,
            "text": run.text,
            "logprobs": _logprobs(chat, rec, call.top, "completion"),
            "finish_reason": rec.finish_reason,
        }
        if call.return_token_ids:
            choice["prompt_token_ids"] = call.prompt_ids.tolist()
            choice["token_ids"] = rec.completion_ids.tolist()
        choices.append(choice)
    return {
        "id": call.id,
        "object": "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": choices,
        "usage": _usage_of(call),
    }


# One encoder for every event: json.dumps with options builds a new JSONEncoder per call.
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def dumps(obj: object) -> str:
    """Compact JSON, as OpenAI servers send it."""
    return _ENCODE(obj)


def sse(obj: object) -> str:
    """One Server-Sent Event."""
    return "data: " + _ENCODE(obj) + "\n\n"


async def chat_stream(call, pieces: AsyncIterator, chat: ChatFormat) -> AsyncIterator[str]:
    """SSE events of a chat call (without the final [DONE]). With tools, a choice's content is held
    until it ends: only then is it known whether the text is a tool call."""
    head = {"id": call.id, "object": "chat.completion.chunk", "created": call.created, "model": call.model}
    for run in call.runs:
        first = {"index": run.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        event = {**head, "choices": [{**first, "finish_reason": None}]}
        if call.return_token_ids and run.index == 0:
            event["prompt_token_ids"] = call.prompt_ids.tolist()
        yield sse(event)
    async for p in pieces:
        delta: dict = {} if call.tools else {"content": p.text}
        reason = None
        if p.finished:
            run = call.runs[p.index]
            content, calls, reason = call.reply(run)
            if call.tools:
                delta = {"content": content}
                if calls:
                    delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        choice = {
            "index": p.index,
            "delta": delta,
            "logprobs": _logprobs(chat, p, call.top, "chat"),
            "finish_reason": reason,
        }
        if call.return_token_ids:
            choice["token_ids"] = p.token_ids.tolist()
        yield sse({**head, "choices": [choice]})
    if call.include_usage:
        yield sse({**head, "choices": [], "usage": _usage_of(call)})


async def completion_stream(call, pieces: AsyncIterator, chat: ChatFormat) -> AsyncIterator[str]:
    """SSE events of a completions call (without the final [DONE])."""
    head = {"id": call.id, "object": "text_completion", "created": call.created, "model": call.model}
    offsets = [0] * len(call.runs)  # text offset per choice, for logprobs.text_offset
    sent_prompt = [False] * len(call.runs)
    async for p in pieces:
        logprobs = _logprobs(chat, p, call.top, "completion", offsets[p.index])
        choice = {
            "index": p.index,
            "text": p.text,
            "logprobs": logprobs,
            "finish_reason": call.runs[p.index].record.finish_reason if p.finished else None,
        }
        if logprobs is not None:
            offsets[p.index] += sum(map(len, logprobs["tokens"]))
        if call.return_token_ids:
            if not sent_prompt[p.index]:
                choice["prompt_token_ids"] = call.prompt_ids.tolist()
                sent_prompt[p.index] = True
            choice["token_ids"] = p.token_ids.tolist()
        yield sse({**head, "choices": [choice]})
    if call.include_usage:
        yield sse({**head, "choices": [], "usage": _usage_of(call)})
