"""The OpenAI-compatible calls' work: request → prompt ids → n choices through the pipeline → OpenAI JSON.

The third front end of `pipeline.Pipeline` (after gRPC and pull mode): a prompt (rendered by the chat
template, tokenized, or planned against an agent session) and its options are validated once for all n
choices (`pipeline.check`, the rules of a gRPC request with n samples), then each choice runs as a request
of its own (`pipeline.prepare_checked`) — choice i is a one-sample request seeded seed + i, exactly as
sample i of a gRPC request — so each choice can end on its own stop string: the choice's text is
decoded incrementally, and where a stop string appears the request is aborted and its record cut after
the token that completed it (finish_reason "stop"). Records are what the engine sampled; text is what
the client is shown.

A call with a session (`sessions.Session`) marks it busy from planning until `Call.close()` (the end of
its run, or its response given up); the turn joins the trajectory only when it finished ("stop" /
"length"). `finish_session` assembles the trajectory into one record and publishes it. With Redis
(`session_redis`), a session is the namespace's, not this replica's: a call takes the session's lease
(409 while a call holds it anywhere), loads the state when this replica's copy is not the latest (the
session moved: its stored ids are prefilled again, never re-tokenized), and saves the state before the
turn's last piece goes out; a finish publishes and marks the session finished in one script. Drain: like the
gRPC servicer, this refuses new calls (UNAVAILABLE) once draining and can abort every running choice.
Knows nothing of HTTP or FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from maskroll.proto import wire
from maskroll.proto.records import RolloutRecord
from maskroll.proto.redis_conn import REDIS_DOWN
from maskroll.proto.streams import StreamKeys

from ..config import ServerConfig
from ..engines.contract import Engine
from ..errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RetryLater,
    Unavailable,
    shown,
)
from ..generation import validation
from ..generation.pipeline import Generation, Pipeline
from ..metrics import Metrics
from ..pull.publisher import PublishTimeout, RolloutPublisher
from ..running import Running
from ..weights.adapters import AdapterTable
from . import openai_compat as oa
from .chat import ChatFormat, parse_tool_calls
from .session_redis import Lease, LeaseLost, SessionRedis
from .sessions import Plan, Session, SessionStore, check_id, ids_array

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# How long a session's finish waits for room in a full rollout stream (at most publish_wait_s) before it
# answers 503: a client is waiting on the answer, not a pull-mode job that can be redelivered.
FINISH_PUBLISH_WAIT_S = 10.0


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
    created: int = field(default_factory=oa.now)
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


class FinishRequest(BaseModel):
    """POST /v1/sessions/<id>/finish."""

    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, str] = Field(default_factory=dict)
    rollout_stream: str = ""  # "" = the namespace's rollout stream
    group_size: int = Field(1, ge=1, le=1_000_000)  # sessions of the X-Maskroll-Group (the GRPO group)
    sample_index: int = Field(0, ge=0)  # this session's index in its group

    @field_validator("metadata", mode="before")
    @classmethod
    def _as_strings(cls, v: object) -> object:
        # Records carry string metadata; a reward sent as 1.0 is kept as its JSON text "1.0".
        if isinstance(v, dict):
            return {k: x if isinstance(x, str) else json.dumps(x) for k, x in v.items()}
        return v

    def check(self) -> None:
        if self.sample_index >= self.group_size:
            raise InvalidArgument(f"sample_index {self.sample_index} must be < group_size {self.group_size}")
        if "session_id" in self.metadata:
            raise InvalidArgument(
                "metadata key 'session_id' is the replica's: the record's metadata names its session"
            )
        validation.check_metadata(self.metadata)


class OpenAIServing:
    """The OpenAI-compatible calls of one replica, and its agent sessions."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        chat: ChatFormat,
        metrics: Metrics,
        publisher: RolloutPublisher | None,
        run_id: Callable[[], str] = str,
        not_ready: Callable[[], str | None] = lambda: None,
        adapters: AdapterTable | None = None,
    ) -> None:
        """run_id(): the training run of the weights served now (the gRPC servicer's, set by
        UpdateWeights), which every record carries. not_ready(): why the replica may not serve yet
        (joining its run), or None. adapters: the replica's LoRA adapters (the gRPC servicer's table):
        a call samples with its own namespace's current adapter, whose run its records carry."""
        self.engine, self.chat, self.metrics, self.publisher = engine, chat, metrics, publisher
        self.run_id = run_id
        self.adapters = adapters
        self.not_ready = not_ready
        self.config = config
        self.pipeline = Pipeline(engine, config)
        self.caps = self.pipeline.caps
        self.keys = (publisher and publisher.keys) or StreamKeys(config.namespace)  # as the gRPC servicer
        self.sessions = SessionStore(
            max_sessions=config.max_sessions,
            idle_s=config.session_idle_s,
            max_tokens=config.max_session_tokens,
            finished_bytes=int(config.session_answer_mb * (1 << 20)),
        )
        # With Redis, sessions are the namespace's (any replica serves a turn); the store above caches them.
        self.durable: SessionRedis | None = None
        if publisher is not None:
            self.durable = SessionRedis(
                publisher.redis, self.keys.part(0), ttl_s=config.session_idle_s, cluster=self.keys.cluster
            )
        self.model_name = Path(engine.model_id).name or engine.model_id
        self._running = Running()

    # ---- preparing a call ------------------------------------------------------------------------

    def check_serving(self) -> None:
        if self.draining:
            raise Unavailable("the server is draining; send the request to another replica")
        if reason := self.not_ready():
            raise Unavailable(f"this replica is not ready ({reason}); send the request to another one")
        if failure := self.engine.failure():
            raise Unavailable(f"this replica's engine is out of service ({failure}); try another replica")

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.engine.model_id):
            raise NotFound(
                f"model {shown(name)} is not served here; GET /v1/models lists {self.model_name!r}"
            )

    async def prepare_chat(self, req: oa.ChatRequest, session: tuple[str, str] | None) -> Call:
        self.check_serving()
        self.check_model(req.model)
        messages, tools = oa.normalize_messages(req.messages), req.tools_active
        # Before the template renders them: a text the context cannot hold is refused unread.
        self.chat.check_text(_text_chars(messages), "messages")
        call = Call(
            "chat",
            oa.new_id("chatcmpl"),
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

    async def prepare_completion(self, req: oa.CompletionRequest, session: tuple[str, str] | None) -> Call:
        self.check_serving()
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
            oa.new_id("cmpl"),
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
            session = await self._open(call, *session_hdr) if session_hdr is not None else None
            # Templating and tokenization: off the event loop (their cost grows with the text).
            plan = await self.chat.off_loop(plan_of, session if session is not None else _Scratch())
            prompt = plan.prompt_ids
            if max_tokens is None:
                room = self.caps.max_model_len - int(prompt.size)
                max_tokens = default_max or max(1, min(self.caps.max_tokens, room))
            options = oa.sampling_options(req, max_tokens=max_tokens, logprobs_k=req.logprobs_k)
            checked = self.pipeline.check(prompt, options)  # the prompt and every option, n samples, once
            k = None
            if session is not None:
                session.check_call(plan, options, self.sessions.max_tokens)
                # The record carries the replica's K whatever the client shows: the trainer's masks need it.
                k = self.caps.max_logprobs
            stops = req.stop_strings()
            run_id = self.run_id()
            adapter = None
            if self.adapters is not None:  # the replica's own namespace (an OpenAI call names none)
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

    async def _open(self, call: Call, session_id: str, group_id: str) -> Session:
        """The session a call continues, marked busy by it (and with Redis, leased: call.lease)."""
        if self.durable is None:
            s = self.sessions.open(session_id, group_id)
            s.busy, call.session, call.source = call.id, s, "local" if s.turns else "new"
            return s
        check_id(session_id)
        local = self.sessions.peek(session_id)
        if local is not None and local.busy:
            raise AlreadyExists(f"session {session_id!r} has a call running; a session's calls take turns")
        with _redis_unreachable("the call was not run; send it again later"):
            call.lease = await self.durable.lease(session_id)
            s, call.source = await self._latest(session_id, local)
        if s is None:
            s, call.source = Session(session_id, group_id, 0.0), "new"
        elif call.source == "moved":
            call.reprefill = len(s.current())
        if group_id and group_id != s.group_id:
            raise InvalidArgument(
                f"X-Maskroll-Group {group_id!r} differs from session {session_id!r}'s group {s.group_id!r}"
            )
        self.sessions.put(s)  # 429 when a new one would pass max_sessions
        s.busy, call.session = call.id, s
        self.metrics.sessions_open.set(len(self.sessions))
        return s

    # ---- running a call --------------------------------------------------------------------------

    async def run(self, call: Call) -> AsyncIterator[Piece]:
        """Every piece of every choice in arrival order; a session's turn is recorded as it ends."""
        k = call.runs[0].gen.logprobs_k
        tracker = self.metrics.generate_started(k)
        for r in call.runs:
            self._running.add(r.gen)
        try:
            async with contextlib.aclosing(_merged(call.runs)) as pieces:
                async for piece in pieces:
                    tracker.tokens(len(piece.token_ids))
                    recorded = piece.finished and call.session is not None
                    if recorded and self._record_turn(call, call.runs[piece.index]) and self.durable:
                        # Before the client sees the turn end: its next call may go to any replica.
                        await self._save_turn(call)
                    yield piece
        finally:
            tracker.done()
            for r in call.runs:
                self._running.discard(r.gen)
            await self._end(call)

    def _release(self, call: Call) -> None:
        """The call is over: its session is free again, or gone if no turn of it was ever recorded (a
        first call that was refused or aborted must not hold one of max_sessions)."""
        s = call.session
        call.close()
        if s is not None and not s.turns and not s.busy:
            self.sessions.discard(s)
        self.metrics.sessions_open.set(len(self.sessions))

    async def _end(self, call: Call) -> None:
        """_release, and the session's lease given back before the response ends: the agent's next call,
        on any replica, must not find it still held."""
        lease, call.lease = call.lease, None
        self._release(call)
        if lease is not None:
            await lease.release()

    async def _save_turn(self, call: Call) -> None:
        """Save the session after its new turn (fenced by the call's lease). If that fails, this replica's
        copy is dropped too — the fleet's state is the one before the turn, which the agent's retry of the
        call redoes — and the call answers 503."""
        s = call.session
        try:
            await self.durable.save(call.lease, s)
        except BaseException as exc:
            self.sessions.discard(s)
            if isinstance(exc, (LeaseLost, *REDIS_DOWN)):
                raise RetryLater(
                    f"session {s.id!r}: the turn could not be saved ({type(exc).__name__}: {exc}); it is "
                    "not part of the session: send the call again"
                ) from None
            raise

    def _record_turn(self, call: Call, run: ChoiceRun) -> bool:
        """Add a finished choice's turn to the call's session; whether it was (an aborted one is not)."""
        if run.record.finish_reason not in ("stop", "length"):
            return False  # aborted (drain): the agent's turn did not happen
        self.metrics.session_turns.labels(call.source or "local").inc()
        if call.source == "moved":
            self.metrics.session_reprefill_tokens.inc(call.reprefill)
        if call.kind == "chat":
            content, calls, _ = call.reply(run)
            reply = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = calls
            conversation = [*call.messages, reply]
            call.session.add_turn(
                call.plan, run.record, stop_token=run.stop_token, messages=conversation, tools=call.tools
            )
        else:
            text = None if call.prompt_text is None else call.prompt_text + run.text
            call.session.add_turn(call.plan, run.record, stop_token=run.stop_token, text=text)
        return True

    async def collect(self, call: Call) -> None:
        """Run a call to its end (non-streaming responses read the runs' records and texts after)."""
        async with contextlib.aclosing(self.run(call)) as pieces:
            async for _ in pieces:
                pass

    # ---- sessions --------------------------------------------------------------------------------

    async def finish_session(self, session_id: str, body: object) -> dict:
        """Close a session: its trajectory as one record, published when this replica has Redis."""
        check_id(session_id)
        if self.durable is not None:
            return await self._finish_durable(session_id, body)
        done = self.sessions.finished(session_id)
        if done is not None and session_id not in self.sessions:
            # A retried finish: the same answer (rebuilt from the record kept), nothing published twice.
            data, stream = done
            return session_answer(wire.decode_record(data), session_id, stream)
        req = oa.parse_request(FinishRequest, body) if body else FinishRequest()
        s = self.sessions.get(session_id)
        if not s.turns:
            raise InvalidArgument(f"session {session_id!r} has no finished call to publish")
        stream = None
        if self.publisher is not None:
            stream = validation.rollout_stream(req.rollout_stream, self.keys)
        elif req.rollout_stream:
            raise FailedPrecondition("rollout_stream needs a server started with redis_url")
        rec = self._session_record(s, session_id, req, stream)
        s.busy = "finish"  # no call may start while the record is published
        try:
            if stream is not None:
                await self._publish(rec, stream)
        finally:
            s.busy = None
        answer = session_answer(rec, session_id, stream)
        # Kept for a retry: the encoded record (what the answer is rebuilt from), not the answer's JSON.
        data = wire.encode_record(rec)
        self.sessions.close(session_id, (data, stream), size=len(data))
        self.metrics.session_answers.set(self.sessions.finished_held)
        self.metrics.sessions_open.set(len(self.sessions))
        return answer

    async def _publish(self, rec: RolloutRecord, stream: str) -> None:
        """Publish a session's record; a full stream or Redis out of reach is 503 with Retry-After (the
        session stays open, so the client's retry of the finish publishes it), never a 500."""
        wait_s = min(self.config.publish_wait_s, FINISH_PUBLISH_WAIT_S)
        try:
            await self.publisher.publish([rec], stream, wait_s=wait_s)
        except PublishTimeout:
            raise RetryLater(
                f"rollout stream {stream} is full (its trainer is behind) or Redis is out of memory: the "
                f"record was not published within {wait_s:g} s; the session is kept, finish it again later"
            ) from None
        except REDIS_DOWN as exc:
            raise RetryLater(
                f"Redis is unreachable ({type(exc).__name__}: {exc}); the record was not published and the "
                "session is kept: finish it again later"
            ) from None

    async def _latest(self, session_id: str, local: Session | None) -> tuple[Session | None, str]:
        """(the session's latest state, where it came from: "local" | "moved"), or (None, "new") when no
        episode is open; under the session's lease."""
        stored, ended = await self.durable.status(session_id)
        if stored and local is not None and local.seq == stored:
            return local, "local"
        if stored and (loaded := await self.durable.load(session_id)) is not None:
            return loaded, "moved"
        if not stored and not ended and local is not None and local.turns:
            # Redis lost it (a restart without persistence) or expired it a moment before this replica
            # would have: the copy held here is the latest there is; the next save stores it again.
            local.seq = 0
            return local, "local"
        if local is not None and not local.turns:
            return local, "new"
        return None, "new"  # a copy held here of an episode finished or deleted elsewhere is stale

    async def _finish_durable(self, session_id: str, body: object) -> dict:
        """finish_session with Redis: under the session's lease, answer from its finished marker (a retry,
        on any replica), or publish and mark it in one script (`SessionRedis.finish`)."""
        local = self.sessions.peek(session_id)
        if local is not None and local.busy:
            raise AlreadyExists(f"session {session_id!r} has a call running; finish it after the call ends")
        with _redis_unreachable(
            "the record was not published and the session is kept: finish it again later"
        ):
            return await self._finish_leased(session_id, body, local)

    async def _finish_leased(self, session_id: str, body: object, local: Session | None) -> dict:
        lease = await self.durable.lease(session_id)
        try:
            done = await self.durable.finished(session_id)
            if done is not None:  # a retried finish: the same answer, nothing published twice
                if local is not None:
                    self.sessions.discard(local)
                return session_answer(wire.decode_record(done[0]), session_id, done[1])
            req = oa.parse_request(FinishRequest, body) if body else FinishRequest()
            s, _ = await self._latest(session_id, local)
            if s is None or not s.turns:
                if local is not None:
                    self.sessions.discard(local)
                raise NotFound(
                    f"no session {session_id!r} in namespace {self.keys.namespace!r} (finished, deleted, "
                    "expired or never used)"
                )
            stream = validation.rollout_stream(req.rollout_stream, self.keys)
            rec = self._session_record(s, session_id, req, stream)
            data = wire.encode_record(rec)
            wait_s = min(self.config.publish_wait_s, FINISH_PUBLISH_WAIT_S)
            started = time.monotonic()
            try:
                ok = await self.durable.finish(
                    lease, session_id, data, stream, max_len=self.publisher.max_len, wait_s=wait_s
                )
            except TimeoutError:
                self.metrics.publish_failures.inc()
                raise RetryLater(
                    f"rollout stream {stream} is full (its trainer is behind) or Redis is out of memory: the "
                    f"record was not published within {wait_s:g} s; the session is kept, finish it later"
                ) from None
            if not ok:
                raise RetryLater(f"session {session_id!r}: the finish's lease expired; finish it again")
            self.metrics.published.inc()
            self.metrics.published_bytes.inc(len(data))
            self.metrics.publish_seconds.observe(time.monotonic() - started)
            if local is not None:
                self.sessions.discard(local)
            self.metrics.sessions_open.set(len(self.sessions))
            return session_answer(rec, session_id, stream)
        finally:
            await lease.release()

    def _session_record(self, s: Session, session_id: str, req: FinishRequest, stream: str | None):
        rec = s.record(
            metadata={"session_id": session_id, **req.metadata},
            group_size=req.group_size,
            sample_index=req.sample_index,
            replica_id=self.config.replica_id,
            now=time.time(),
        )
        if stream is not None and not rec.run_id:
            raise FailedPrecondition(
                f"session {session_id!r} was sampled from weights of no training run: this replica serves "
                "its starting weights and no trainer has started a run on them yet, so every trainer would "
                "refuse (dead-letter) the record; it was not published. Start the trainer first "
                "(RolloutQueue(run='new') and publisher.start(model): replicas holding the model adopt the "
                "run's version 0, the others load it), then run the episode again (DELETE this session)"
            )
        return rec

    async def delete_session(self, session_id: str) -> dict:
        check_id(session_id)
        if self.durable is None:
            self.sessions.get(session_id)  # 404 / 409 as for finish
            self.sessions.close(session_id)
            self.metrics.sessions_open.set(len(self.sessions))
            return {"id": session_id, "deleted": True}
        local = self.sessions.peek(session_id)
        if local is not None and local.busy:
            raise AlreadyExists(f"session {session_id!r} has a call running; delete it after the call ends")
        with _redis_unreachable("the session was not deleted; delete it again later"):
            lease = await self.durable.lease(session_id)
            try:
                existed = await self.durable.delete(lease, session_id)
            finally:
                await lease.release()
        if local is not None:
            self.sessions.close(session_id)
        self.metrics.sessions_open.set(len(self.sessions))
        if not existed and local is None:
            raise NotFound(f"no session {session_id!r} in namespace {self.keys.namespace!r}")
        return {"id": session_id, "deleted": True}

    # ---- drain -----------------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._running.draining

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def begin_drain(self) -> None:
        self._running.begin_drain()

    async def wait_idle(self, timeout: float) -> bool:
        return await self._running.wait_idle(timeout)

    def abort_all(self) -> None:
        self._running.abort_all()


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


@contextlib.contextmanager
def _redis_unreachable(then: str):
    """Redis out of reach past the client's retry budget → 503 with Retry-After, saying what became of
    the call (`then`); the session's state in Redis is untouched."""
    try:
        yield
    except REDIS_DOWN as exc:
        raise RetryLater(f"Redis is unreachable ({type(exc).__name__}: {exc}); {then}") from None


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


def session_answer(rec: RolloutRecord, session_id: str, stream: str | None) -> dict:
    """The finish answer: the trajectory in plain JSON, and the record as the proto's JSON image."""
    from google.protobuf import json_format

    mask = rec.generated
    return {
        "id": session_id,
        "rollout_id": rec.rollout_id,
        "published": stream is not None,
        "rollout_stream": stream,
        "num_turns": rec.num_turns,
        "num_segments": 1 + len(rec.segment_starts),
        "segment_starts": rec.segment_starts,
        "prompt_token_ids": rec.prompt_ids.tolist(),
        "token_ids": rec.completion_ids.tolist(),
        "loss_mask": mask.astype(int).tolist(),
        "sampled_logprobs": [
            lp if m else None for lp, m in zip(rec.sampled_logprobs.tolist(), mask.tolist(), strict=True)
        ],
        "finish_reason": rec.finish_reason,
        "policy_version_first": rec.policy_version_first,
        "policy_version_last": rec.policy_version_last,
        "version_changes": [list(c) for c in rec.version_changes],
        "run_id": rec.run_id,
        "group_id": rec.group_id,
        "group_size": rec.group_size,
        "sample_index": rec.sample_index,
        "record": json_format.MessageToDict(wire.record_to_pb(rec), preserving_proto_field_name=True),
    }
