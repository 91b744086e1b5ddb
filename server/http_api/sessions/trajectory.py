"""Agent sessions: one token-exact, multi-turn trajectory per `X-Maskroll-Session` id on this replica.

A session holds what the engine really read and sampled: the first prompt's ids, then every later token
with a loss mask (1 = sampled by the model, 0 = template scaffolding, tool results, user messages), the
turns' logprobs and policy versions. Each call is planned against it (`plan_chat`, `plan_completion`):

- the call extends the recorded conversation (its messages start with the recorded ones, the model's
  own turns exactly as they were returned; or its prompt starts with the recorded text / ids): the
  earlier ids are kept and only the new part is tokenized (`chat.ChatFormat.continuation`);
- otherwise, if its full tokenization still starts with the recorded ids, the rest is new;
- otherwise the client edited its history: the call starts a new segment, a fresh prompt whose tokens
  are recorded (loss 0) with `segment_starts` saying where; nothing re-tokenized is ever spliced into
  ids the model produced.

`record()` assembles the whole trajectory into one RolloutRecord (schema version 2). `SessionStore`
bounds how many sessions live, how long an idle one lives and how many tokens one may hold; with Redis it
is the replica's cache of the fleet's sessions (`durable`). Pure state (no engine, HTTP or Redis);
the HTTP front end runs the turns and publishes the record.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from maskroll.proto.records import (
    MULTI_TURN_SCHEMA_VERSION,
    RolloutRecord,
    SamplingOptions,
    Semantics,
    rollout_id_for,
)

from ...errors import AlreadyExists, InvalidArgument, NotFound, TooManySessions
from ..chat import ChatFormat

_SESSION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
# Finished sessions whose answer a retried finish gets again: at most this many, and at most
# ServerConfig.session_answer_mb of what is kept for them (the encoded record the answer is rebuilt from:
# 16 + 8·K bytes a token, 5 MB for 32k tokens at K = 20). Bounded by count alone, 1024 answers in JSON
# could hold tens of GB.
FINISHED_MEMORY = 1024
FINISHED_MEMORY_BYTES = 64 << 20


@dataclass
class Plan:
    """What one call adds before the model's turn."""

    prompt_ids: np.ndarray  # int32 [P]: what the engine reads
    new_ids: list[int]  # appended to the trajectory before the turn (loss 0)
    new_segment: bool = False  # new_ids are a whole fresh prompt (edited history)


@dataclass
class Turn:
    start: int  # completion index of the turn's first sampled token
    record: RolloutRecord  # the turn's own record, prompt dropped (the session holds it once)


@dataclass
class Session:
    id: str
    group_id: str
    touched: float
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex)
    kind: str = ""  # "chat" | "completion", fixed by the first call
    prompt_ids: np.ndarray | None = None  # int32 [P] of the first call
    ids: list[int] = field(default_factory=list)  # every token after the first prompt
    mask: bytearray = field(default_factory=bytearray)  # 1 = sampled
    turns: list[Turn] = field(default_factory=list)
    segment_starts: list[int] = field(default_factory=list)
    semantics: Semantics | None = None
    messages: list[dict] = field(default_factory=list)  # chat: the conversation so far, as recorded
    tools: list[dict] | None = None
    text: str | None = None  # completion: the text so far, when the prompts are text
    stop_token: int | None = None  # the stop token the last turn ended on, if any
    # Who is using the session (a call id, "finish"), or None: its calls take turns, a second one at
    # the same time is refused (409) rather than queued behind a stream the client may never read.
    busy: str | None = None
    seq: int = 0  # turns of this episode saved to Redis (durable.py); 0 = none, or no Redis

    def current(self) -> list[int]:
        return [] if self.prompt_ids is None else [*self.prompt_ids.tolist(), *self.ids]

    # ---- planning a call ---------------------------------------------------------------------------

    def plan_chat(self, chat: ChatFormat, messages: list[dict], tools: list[dict] | None) -> Plan:
        self._kind("chat")
        if not self.turns:
            return Plan(np.asarray(chat.prompt(messages, tools), np.int32), [])
        n = len(self.messages)
        if tools == self.tools and messages[:n] == self.messages:
            cont = chat.continuation(messages[n:], tools, ended_with_stop=self.stop_token)
            if cont is not None:
                return Plan(np.asarray(self.current() + cont, np.int32), cont)
        return self._by_tokens(chat.prompt(messages, tools))

    def plan_completion(self, chat: ChatFormat, prompt: str | list[int]) -> Plan:
        self._kind("completion")
        if isinstance(prompt, str):
            if self.turns and self.text is not None and prompt.startswith(self.text):
                new = chat.encode(prompt[len(self.text) :], add_special_tokens=False)
                return Plan(np.asarray(self.current() + new, np.int32), new)
            ids = chat.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
        if not self.turns:
            return Plan(ids_array(ids), [])
        return self._by_tokens(ids)

    def _by_tokens(self, ids: list[int]) -> Plan:
        cur = self.current()
        if ids[: len(cur)] == cur:
            return Plan(ids_array(ids), ids[len(cur) :])
        return Plan(ids_array(ids), list(ids), new_segment=True)

    def _kind(self, kind: str) -> None:
        """The first call fixes the session's kind: a chat trajectory and a completion trajectory have
        nothing in common (a refused first call leaves no session behind to hold it)."""
        if self.kind and self.kind != kind:
            raise InvalidArgument(
                f"X-Maskroll-Session {self.id!r} holds {self.kind} calls; one session is one kind of call"
            )
        self.kind = kind

    def check_call(self, plan: Plan, options: SamplingOptions, max_tokens: int) -> None:
        """A call may continue this session: one sample, the session's sampling semantics, and room."""
        if options.n != 1:
            raise InvalidArgument(
                f"n must be 1 in a session (X-Maskroll-Session), got {options.n}: a trajectory follows one "
                "sample; run n sessions with one X-Maskroll-Group for a group"
            )
        s = self.semantics
        if s is not None:
            for name, mine, theirs in (
                ("temperature", s.temperature, options.temperature),
                ("top_p", s.top_p, options.top_p),
                ("top_k", s.top_k, max(options.top_k, 0)),
            ):
                if mine != theirs:
                    raise InvalidArgument(
                        f"{name} = {theirs} differs from session {self.id!r}'s {mine}: one trajectory is "
                        "sampled with one temperature / top_p / top_k (its record has one semantics)"
                    )
        size = len(self.ids) + len(plan.new_ids)
        if self.turns and size >= max_tokens:
            raise InvalidArgument(
                f"session {self.id!r} would hold {size} tokens; at most max_session_tokens = {max_tokens} "
                "(finish it, or start a new session)"
            )

    # ---- recording -----------------------------------------------------------------------------------

    def add_turn(
        self,
        plan: Plan,
        rec: RolloutRecord,
        *,
        stop_token: int | None,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        text: str | None = None,
    ) -> None:
        """The model's turn of a planned call is done: its tokens join the trajectory (loss 1).
        stop_token: the stop token it ended on (None: a length cut or a stop string). messages (chat):
        the conversation including the reply as returned; text (completion): the prompt text and the
        returned text, when the prompt was text."""
        if not self.turns:
            self.prompt_ids = np.asarray(plan.prompt_ids, np.int32)
            self.semantics = rec.semantics
        else:
            if plan.new_segment:
                self.segment_starts.append(len(self.ids))
            self.ids.extend(plan.new_ids)
            self.mask.extend(b"\x00" * len(plan.new_ids))
        self.turns.append(Turn(len(self.ids), replace(rec, prompt_ids=np.zeros(0, np.int32))))
        self.ids.extend(rec.completion_ids.tolist())
        self.mask.extend(b"\x01" * rec.num_tokens)
        self.stop_token = stop_token
        self.messages, self.tools, self.text = messages or [], tools, text

    def record(
        self, *, metadata: dict[str, str], group_size: int, sample_index: int, replica_id: str, now: float
    ) -> RolloutRecord:
        """The whole trajectory as one RolloutRecord; logprob arrays zero where the model did not sample."""
        t, k = len(self.ids), self.semantics.logprobs_k
        sampled = np.zeros(t, np.float32)
        ranks = np.zeros(t, np.int32)
        topk_ids = np.zeros((t, k), np.int32)
        topk_lp = np.zeros((t, k), np.float32)
        versions = np.full(t, -1, np.int64)  # [T]; -1 until filled
        for turn in self.turns:
            r, a = turn.record, turn.start
            b = a + r.num_tokens
            sampled[a:b], ranks[a:b] = r.sampled_logprobs, r.sampled_ranks
            topk_ids[a:b], topk_lp[a:b] = r.topk_ids, r.topk_logprobs
            versions[a:b] = r.token_versions()
        versions = _forward_fill(versions, self.turns[0].record.policy_version_first)
        changed = np.flatnonzero(versions[1:] != versions[:-1]) + 1
        last = self.turns[-1].record
        key = f"session:{self.id}:{self.nonce}"
        return RolloutRecord(
            # A retried finish answers from memory (SessionStore); the nonce keeps a reused session id
            # from colliding with an earlier episode in the trainer's dedupe.
            rollout_id=rollout_id_for(key, sample_index),
            request_id=key,
            prompt_ids=self.prompt_ids,
            completion_ids=np.asarray(self.ids, np.int32),
            sampled_logprobs=sampled,
            sampled_ranks=ranks,
            topk_ids=topk_ids,
            topk_logprobs=topk_lp,
            finish_reason=last.finish_reason,
            semantics=self.semantics,
            policy_version_first=int(versions[0]) if t else last.policy_version_first,
            policy_version_last=int(versions[-1]) if t else last.policy_version_last,
            version_changes=[(int(i), int(versions[i])) for i in changed],
            # A group's sessions share its id as job id: the trainer's queue assembles groups by job.
            job_id=self.group_id or key,
            group_id=self.group_id,
            sample_index=sample_index,
            metadata=metadata,
            replica_id=replica_id,
            created_at=now,
            group_size=group_size,
            schema_version=MULTI_TURN_SCHEMA_VERSION,
            run_id=last.run_id,
            adapter=last.adapter,  # the last turn's (every token's version is in the version arrays)
            loss_mask=np.frombuffer(bytes(self.mask), np.uint8).astype(bool),
            segment_starts=list(self.segment_starts),
            num_turns=len(self.turns),
        )


def _forward_fill(versions: np.ndarray, first: int) -> np.ndarray:
    """Unsampled tokens (-1) take the version of the token before them: versions change only where the
    model sampled."""
    if versions.size == 0:
        return versions
    if versions[0] < 0:
        versions[0] = first
    filled = np.where(versions >= 0, np.arange(versions.size), 0)
    return versions[np.maximum.accumulate(filled)]


class SessionStore:
    """This replica's sessions, bounded: at most `max_sessions`, each dropped after `idle_s` without a
    call (lazily, whenever a session is looked up), each at most `max_tokens` long (Session.check_call)."""

    def __init__(
        self,
        *,
        max_sessions: int,
        idle_s: float,
        max_tokens: int,
        finished_bytes: int = FINISHED_MEMORY_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions, self.idle_s, self.max_tokens = max_sessions, idle_s, max_tokens
        self.finished_bytes = finished_bytes  # the budget of what finished sessions keep
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        # id -> (what a retried finish is answered from, its size in bytes), oldest first
        self._finished: OrderedDict[str, tuple[object, int]] = OrderedDict()
        self._finished_bytes = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def open(self, session_id: str, group_id: str) -> Session:
        """The session `session_id` (created on its first call), not busy; the caller marks it busy."""
        self.expire()
        check_id(session_id)
        s = self._sessions.get(session_id)
        if s is None:
            if len(self._sessions) >= self.max_sessions:
                raise TooManySessions(
                    f"this replica holds {len(self._sessions)} sessions (max_sessions); finish or delete "
                    "some, wait for idle ones to expire, or use another replica"
                )
            self._forget_finished(session_id)  # the id names a new episode now
            s = self._sessions[session_id] = Session(session_id, group_id, self._clock())
        elif group_id and group_id != s.group_id:
            raise InvalidArgument(
                f"X-Maskroll-Group {group_id!r} differs from session {session_id!r}'s group {s.group_id!r}"
            )
        if s.busy:
            raise AlreadyExists(f"session {session_id!r} has a call running; a session's calls take turns")
        s.touched = self._clock()
        return s

    def get(self, session_id: str) -> Session:
        self.expire()
        s = self._sessions.get(session_id)
        if s is None:
            raise NotFound(
                f"no session {session_id!r} on this replica (finished, deleted, expired or never used)"
            )
        if s.busy:
            raise AlreadyExists(f"session {session_id!r} has a call running; finish it after the call ends")
        return s

    def peek(self, session_id: str) -> Session | None:
        """The session held here under `session_id` (busy or not), or None."""
        self.expire()
        return self._sessions.get(session_id)

    def put(self, session: Session) -> None:
        """Hold `session` (loaded from Redis) in place of what this replica held under its id."""
        if session.id not in self._sessions and len(self._sessions) >= self.max_sessions:
            raise TooManySessions(
                f"this replica holds {len(self._sessions)} sessions (max_sessions); finish or delete "
                "some, wait for idle ones to expire, or use another replica"
            )
        session.touched = self._clock()
        self._sessions[session.id] = session

    @property
    def finished_held(self) -> int:
        """Bytes kept now for finished sessions' retries."""
        return self._finished_bytes

    def finished(self, session_id: str) -> object | None:
        """What was kept of a session finished recently (a retried finish is answered from it), or None."""
        kept = self._finished.get(session_id)
        return None if kept is None else kept[0]

    def close(self, session_id: str, answer: object | None = None, size: int = 0) -> bool:
        """Forget a session; with `answer` (`size` bytes), remember it for a retried finish, within
        FINISHED_MEMORY entries and `finished_bytes` (the oldest go first). Whether it existed."""
        existed = self._sessions.pop(session_id, None) is not None
        self._forget_finished(session_id)
        if answer is not None and size <= self.finished_bytes:
            self._finished[session_id] = (answer, size)
            self._finished_bytes += size
            while len(self._finished) > FINISHED_MEMORY or self._finished_bytes > self.finished_bytes:
                _, (_, old) = self._finished.popitem(last=False)
                self._finished_bytes -= old
        return existed

    def _forget_finished(self, session_id: str) -> None:
        kept = self._finished.pop(session_id, None)
        if kept is not None:
            self._finished_bytes -= kept[1]

    def discard(self, session: Session) -> None:
        """Forget `session` if it is still the one stored under its id (no finish answer kept)."""
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]

    def expire(self) -> int:
        """Drop sessions idle for idle_s (never one with a call running); returns how many."""
        cutoff = self._clock() - self.idle_s
        old = [sid for sid, s in self._sessions.items() if s.touched < cutoff and not s.busy]
        for sid in old:
            del self._sessions[sid]
        return len(old)


def ids_array(ids: list) -> np.ndarray:
    """Token ids as an array the pipeline can name bad values in (int64 holds any id it can name; a
    client's id past int64, such as 2**70, is refused here)."""
    try:
        return np.asarray(ids, np.int64)
    except OverflowError:
        bad = next(i for i, t in enumerate(ids) if not -(2**63) <= t < 2**63)
        raise InvalidArgument(f"prompt_token_ids[{bad}] = {ids[bad]} is outside the vocabulary") from None


def check_id(session_id: str) -> None:
    if not _SESSION_ID.fullmatch(session_id):
        shown = session_id if len(session_id) <= 40 else session_id[:40] + "..."
        raise InvalidArgument(f"X-Maskroll-Session {shown!r} must be 1-128 characters of A-Z a-z 0-9 _ . : -")
