"""The OpenAI-compatible calls' work: request → prompt ids → n choices through the pipeline → OpenAI JSON.

A front end of the replica's core (after gRPC and pull mode), sharing its pipeline, running set (the
one drain) and serving check: a prompt (rendered by the chat template, tokenized, or planned against an
agent session) and its options are validated once for all n choices (`pipeline.check`, the rules of a
gRPC request with n samples), then each choice runs as a request of its own (`pipeline.prepare_checked`)
— choice i is a one-sample request seeded seed + i, exactly as sample i of a gRPC request — so each
choice can end on its own stop string: the choice's text is decoded incrementally, and where a stop
string appears the request is aborted and its record cut after the token that completed it
(finish_reason "stop"). Records are what the engine sampled; text is what the client is shown.

A call with a session (sessions/serving.py) opens it before planning and frees it at `Call.close()`
(the end of its run, or its response given up); each finished choice's turn is handed to the sessions
as it ends. Knows nothing of HTTP or FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from maskroll.proto.records import RolloutRecord

from ...errors import InvalidArgument, NotFound, shown
from ...generation.pipeline import Generation
from ..chat import ChatFormat, parse_tool_calls
from ..sessions.durable import Lease
from ..sessions.trajectory import Plan, Session, ids_array
from . import protocol

if TYPE_CHECKING:
    from ...core import ReplicaCore
    from ..sessions.serving import SessionServing

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Piece:
    """What one engine output adds to a choice: the tokens kept (all, unless a stop string cut them)
    and the text to show (held back while it could still be the start of a stop string)."""

    index: int
    text: str
    token_ids: np.ndarray  # int32 [t]
    sampled_logprobs: np.ndarray  # float32 [t]
    topk_ids: np.ndarray  # int32 [t, K]
    topk_logprobs: np.ndarray  # float32 [t, K]
    finished: bool = False  # the choice's last piece: ChoiceRun.record / .text are final


def truncated(rec: RolloutRecord, t: int, finish_reason: str) -> RolloutRecord:
    """`rec` cut after its first t tokens (a stop string ended the choice there)."""
    if t == rec.num_tokens and rec.finish_reason == finish_reason:
        return rec
    versions = rec.token_versions()[:t]
    return replace(
        rec,
        completion_ids=rec.completion_ids[:t],
        sampled_logprobs=rec.sampled_logprobs[:t],
        sampled_ranks=rec.sampled_ranks[:t],
        topk_ids=rec.topk_ids[:t],
        topk_logprobs=rec.topk_logprobs[:t],
        finish_reason=finish_reason,
        policy_version_last=int(versions[-1]) if t else rec.policy_version_first,
        version_changes=[(i, v) for i, v in rec.version_changes if i < t],
    )


class ChoiceRun:
    """One choice: a one-sample Generation, detokenized incrementally, cut at the first stop string."""

    def __init__(self, index: int, gen: Generation, chat: ChatFormat, stops: list[str]) -> None:
        self.index, self.gen, self._chat, self._stops = index, gen, chat, stops
        self._hold = max(map(len, stops), default=1) - 1  # chars that may begin a stop string
        self.text = ""  # the text shown, final once the last piece is out
        self.record: RolloutRecord | None = None  # final (cut at the stop string) after the last piece
        self.stopped_by_string = False
        self.reply: tuple[str | None, list[dict], str] | None = None  # Call.reply's, once finished

    async def pieces(self) -> AsyncIterator[Piece]:
        decoder = self._chat.decoder(self.gen.header.prompt_ids)
        text, shown, kept, cut = "", 0, 0, None  # cut: where the stop string starts in `text`
        async with contextlib.aclosing(self.gen.stream()) as chunks:
            async for chunk in chunks:
                take = 0
                if cut is None:
                    for tok in chunk.token_ids.tolist():
                        take += 1
                        before = len(text)
                        text += decoder.add(tok)
                        cut = self._find_stop(text, before)
                        if cut is not None:
                            self.stopped_by_string = True
                            self.gen.abort()  # the tokens after this one are not the choice's
                            break
                    if chunk.record is not None and cut is None:
                        text += decoder.flush()
                if cut is not None:
                    end = cut
                else:  # at the end all of it; before, all but what may begin a stop string
                    end = len(text) if chunk.record is not None else len(text) - self._hold
                piece = Piece(
                    self.index,
                    text[shown : max(shown, end)],
                    chunk.token_ids[:take],
                    chunk.sampled_logprobs[:take],
                    chunk.topk_ids[:take],
                    chunk.topk_logprobs[:take],
                )
                shown, kept = max(shown, end), kept + take
                if chunk.record is not None:
                    reason = "stop" if self.stopped_by_string else chunk.record.finish_reason
                    self.record = truncated(chunk.record, kept, reason)
                    self.text = text[:shown]
                    piece.finished = True
                if piece.finished or take or piece.text:
                    yield piece

    def _find_stop(self, text: str, before: int) -> int | None:
        """Where the first stop string that ends in text[before:] begins, or None."""
        hits = [i for s in self._stops if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
        return min(hits, default=None)

    @property
    def stop_token(self) -> int | None:
        """The stop token the choice ended on (None: length, a stop string, an abort)."""
        r = self.record
        if r is None or r.finish_reason != "stop" or self.stopped_by_string or not r.num_tokens:
            return None
        return int(r.completion_ids[-1])


@dataclass
class Call:
    """One OpenAI call, validated and ready to run."""

    kind: str  # "chat" | "completion"
    id: str
    model: str
    prompt_ids: np.ndarray  # int32 [P]
    runs: list[ChoiceRun]
    top: int  # logprobs entries to return per token; -1 = no logprobs
    return_token_ids: bool
    include_usage: bool
    tools: list[dict] | None = None
    messages: list[dict] = field(default_factory=list)  # chat: the request's conversation
    prompt_text: str | None = None  # completion: the prompt, when it was text
    session: Session | None = None
    plan: Plan | None = None
    created: int = field(default_factory=protocol.now)
    lease: Lease | None = None  # the session's fleet-wide lease (with Redis)
    source: str = ""  # where the session came from: "local" (this replica's copy), "moved", "new"
    reprefill: int = 0  # moved: the stored tokens the engine prefills again
    # Holds the namespace's LoRA adapter resident while the call's choices sample with it (AdapterTable.use)
    adapter_hold: contextlib.ExitStack | None = None

    def close(self) -> None:
        """Free the session for its next call (idempotent). Called when the run ends and by the HTTP
        layer whatever happens to the response; __del__ too, so a response dropped before its stream
        ever started cannot leave the session busy for good."""
        hold, self.adapter_hold = self.adapter_hold, None
        if hold is not None:
            hold.close()
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.close()
        s, self.session = self.session, None
        if s is not None and s.busy == self.id:
            s.busy = None
            s.touched = time.monotonic()

    def __del__(self) -> None:
        self.close()

    def reply(self, run: ChoiceRun) -> tuple[str | None, list[dict], str]:
        """(content, tool_calls, finish_reason) of a finished choice, made once: the tool call ids the
        client gets are the ones its session recorded."""
        if run.reply is None:
            content, calls = parse_tool_calls(run.text) if self.tools else (run.text, [])
            reason = run.record.finish_reason
            run.reply = content, calls, "tool_calls" if calls and reason == "stop" else reason
        return run.reply


class OpenAIServing:
    """The OpenAI-compatible calls of one replica, on its core (server/core.py)."""

    def __init__(self, core: ReplicaCore, chat: ChatFormat, sessions: SessionServing) -> None:
        """core: the replica's (its one pipeline, running set, adapters, the run of the weights served,
        which every record carries). sessions: the agent sessions a call may continue."""
        self.engine, self.chat, self.metrics = core.engine, chat, core.metrics
        self.config = core.config
        self.serving = core.serving
        self.pipeline, self.caps = core.serving.pipeline, core.serving.caps
        self.running = core.running
        self.adapters = core.adapters
        self.run_id = core.serving.run_id
        self.sessions = sessions
        self.model_name = Path(self.engine.model_id).name or self.engine.model_id

    # ---- preparing a call ------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.engine.model_id):
            raise NotFound(
                f"model {shown(name)} is not served here; GET /v1/models lists {self.model_name!r}"
            )

    async def prepare_chat(self, req: protocol.ChatRequest, session: tuple[str, str] | None) -> Call:
        self.serving.check()
        self.check_model(req.model)
        messages, tools = protocol.normalize_messages(req.messages), req.tools_active
        # Before the template renders them: a text the context cannot hold is refused unread.
        self.chat.check_text(_text_chars(messages), "messages")
        call = Call(
            "chat",
            protocol.new_id("chatcmpl"),
            self.model_name,
            np.zeros(0, np.int32),
            [],
            top=(req.top_logprobs or 0) if req.logprobs else -1,
            return_token_ids=req.return_token_ids,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            tools=tools,
            messages=messages,
        )
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await self._prepare(
            call, req, session, lambda s: s.plan_chat(self.chat, messages, tools), max_tokens, None
        )

    async def prepare_completion(
        self, req: protocol.CompletionRequest, session: tuple[str, str] | None
    ) -> Call:
        self.serving.check()
        self.check_model(req.model)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            self.chat.check_text(len(prompt), "prompt")
        elif len(prompt) >= self.caps.max_model_len:  # before millions of ids become an array
            raise InvalidArgument(
                f"prompt has {len(prompt)} tokens; the model's context (max_model_len "
                f"{self.caps.max_model_len}) leaves no room for a completion"
            )
        call = Call(
            "completion",
            protocol.new_id("cmpl"),
            self.model_name,
            np.zeros(0, np.int32),
            [],
            top=req.logprobs if req.logprobs is not None else -1,
            return_token_ids=req.return_token_ids,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            prompt_text=prompt if isinstance(prompt, str) else None,
        )
        return await self._prepare(
            call,
            req,
            session,
            lambda s: s.plan_completion(self.chat, prompt),
            req.max_tokens,
            COMPLETIONS_DEFAULT_MAX_TOKENS,
        )

    async def _prepare(self, call: Call, req, session_hdr, plan_of, max_tokens, default_max) -> Call:
        """Plan the prompt (against the session, if any), validate, and make one Generation per choice.
        The session is marked busy here and freed by call.close() (here, on an error)."""
        try:
            session = await self.sessions.open(call, *session_hdr) if session_hdr is not None else None
            # Templating and tokenization: off the event loop (their cost grows with the text).
            plan = await self.chat.off_loop(plan_of, session if session is not None else _Scratch())
            prompt = plan.prompt_ids
            if max_tokens is None:
                room = self.caps.max_model_len - int(prompt.size)
                max_tokens = default_max or max(1, min(self.caps.max_tokens, room))
            options = protocol.sampling_options(req, max_tokens=max_tokens, logprobs_k=req.logprobs_k)
            checked = self.pipeline.check(prompt, options)  # the prompt and every option, n samples, once
            k = None
            if session is not None:
                session.check_call(plan, options, self.sessions.store.max_tokens)
                # The record carries the replica's K whatever the client shows: the trainer's masks need it.
                k = self.caps.max_logprobs
            stops = req.stop_strings()
            run_id = self.run_id()
            adapter = None
            # the replica's own namespace's adapter (an OpenAI call names none), held while it samples
            call.adapter_hold = contextlib.ExitStack()
            adapter = call.adapter_hold.enter_context(self.adapters.use())
            for i in range(checked.n):  # each choice a request of its own, seeded seed + i
                gen = self.pipeline.prepare_checked(
                    checked.sample(i, logprobs_k=k),
                    request_id=f"{call.id}-{i}",
                    run_id=run_id,
                    adapter=adapter,
                )
                call.runs.append(ChoiceRun(i, gen, self.chat, stops))
            call.prompt_ids = call.runs[0].gen.header.prompt_ids
            call.plan = plan
            return call
        except BaseException:
            await self._end(call)
            raise

    # ---- running a call --------------------------------------------------------------------------

    async def run(self, call: Call) -> AsyncIterator[Piece]:
        """Every piece of every choice in arrival order; a session's turn is recorded as it ends."""
        k = call.runs[0].gen.logprobs_k
        tracker = self.metrics.generate_started(k)
        for r in call.runs:
            self.running.add(r.gen)
        try:
            async with contextlib.aclosing(_merged(call.runs)) as pieces:
                async for piece in pieces:
                    tracker.tokens(len(piece.token_ids))
                    if piece.finished and call.session is not None:
                        await self.sessions.turn_finished(call, call.runs[piece.index])
                    yield piece
        finally:
            tracker.done()
            for r in call.runs:
                self.running.discard(r.gen)
            await self._end(call)

    async def _end(self, call: Call) -> None:
        """The call is over: its adapter released, its session (if any) freed (sessions/serving.py)."""
        await self.sessions.end(call)

    async def collect(self, call: Call) -> None:
        """Run a call to its end (non-streaming responses read the runs' records and texts after)."""
        async with contextlib.aclosing(self.run(call)) as pieces:
            async for _ in pieces:
                pass

    # ---- sessions --------------------------------------------------------------------------------


class _Scratch:
    """Plans a call without a session: the whole prompt, every time."""

    def plan_chat(self, chat: ChatFormat, messages: list[dict], tools: list[dict] | None) -> Plan:
        return Plan(np.asarray(chat.prompt(messages, tools), np.int64), [])

    def plan_completion(self, chat: ChatFormat, prompt: str | list[int]) -> Plan:
        ids = chat.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        return Plan(ids_array(ids), [])


def _text_chars(messages: list[dict]) -> int:
    """Characters of text in normalized messages: contents, tool call names and arguments."""
    n = 0
    for m in messages:
        n += len(m["content"] or "") + len(m.get("name", "")) + len(m.get("tool_call_id", ""))
        for c in m.get("tool_calls", ()):
            n += len(c["function"]["name"]) + len(c["function"]["arguments"]) + len(c["id"])
    return n


_DONE = object()


async def _merged(runs: list[ChoiceRun]) -> AsyncIterator[Piece]:
    """The pieces of all choices in arrival order; leaving early cancels the choices still running."""
    if len(runs) == 1:
        async with contextlib.aclosing(runs[0].pieces()) as pieces:
            async for p in pieces:
                yield p
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async with contextlib.aclosing(run.pieces()) as pieces:
                async for p in pieces:
                    queue.put_nowait(p)
        except Exception as exc:  # re-raised by the consumer
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(r), name=f"choice:{r.gen.request_id}") for r in runs]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is _DONE:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
