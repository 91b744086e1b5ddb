"""Agent sessions across their calls: the lifecycle of `X-Maskroll-Session` trajectories on this replica.

An OpenAI call with a session (openai/serving.py) opens it here (`open`: marked busy by the call, and
with Redis leased fleet-wide) before its prompt is planned against the trajectory; each finished choice's
turn joins it (`turn_finished`: only "stop" / "length", an aborted turn did not happen); the call's end
frees it (`end`). `finish` assembles the trajectory into one record (trajectory.py) and publishes it;
`delete` drops it. With Redis (durable.py), a session is the namespace's, not this replica's: a call takes
the session's lease (409 while a call holds it anywhere), loads the state when this replica's copy is not
the latest (the session moved: its stored ids are prefilled again, never re-tokenized), and saves the
state before the turn's last piece goes out; a finish publishes and marks the session finished in one
script. Without Redis the sessions live in this process (`SessionStore`) and are lost with it. Knows
nothing of HTTP or FastAPI.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from maskroll.proto import wire
from maskroll.proto.records import RolloutRecord
from maskroll.proto.redis_conn import REDIS_DOWN
from maskroll.proto.streams import StreamKeys

from ...config import ServerConfig
from ...errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, RetryLater
from ...generation import validation
from ...metrics import Metrics
from ...pull.publisher import PublishTimeout, RolloutPublisher
from ..openai.protocol import parse_request
from .durable import LeaseLost, SessionRedis
from .trajectory import Session, SessionStore, check_id

if TYPE_CHECKING:
    from ..openai.serving import Call, ChoiceRun

# How long a session's finish waits for room in a full rollout stream (at most publish_wait_s) before it
# answers 503: a client is waiting on the answer, not a pull-mode job that can be redelivered.
FINISH_PUBLISH_WAIT_S = 10.0


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


class SessionServing:
    """The agent sessions of one replica (with Redis, its namespace's)."""

    def __init__(
        self, config: ServerConfig, metrics: Metrics, publisher: RolloutPublisher | None, keys: StreamKeys
    ) -> None:
        """publisher: --namespace's (None without Redis: sessions stay in this process, unpublished);
        keys: its layout."""
        self.config, self.metrics, self.publisher, self.keys = config, metrics, publisher, keys
        self.store = SessionStore(
            max_sessions=config.max_sessions,
            idle_s=config.session_idle_s,
            max_tokens=config.max_session_tokens,
            finished_bytes=int(config.session_answer_mb * (1 << 20)),
        )
        # With Redis, sessions are the namespace's (any replica serves a turn); the store above caches them.
        self.durable: SessionRedis | None = None
        if publisher is not None:
            self.durable = SessionRedis(
                publisher.redis, keys.part(0), ttl_s=config.session_idle_s, cluster=keys.cluster
            )

    # ---- a call's session ------------------------------------------------------------------------

    async def open(self, call: Call, session_id: str, group_id: str) -> Session:
        """The session a call continues, marked busy by it (and with Redis, leased: call.lease)."""
        if self.durable is None:
            s = self.store.open(session_id, group_id)
            s.busy, call.session, call.source = call.id, s, "local" if s.turns else "new"
            return s
        check_id(session_id)
        local = self.store.peek(session_id)
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
        self.store.put(s)  # 429 when a new one would pass max_sessions
        s.busy, call.session = call.id, s
        self.metrics.sessions_open.set(len(self.store))
        return s

    # ---- running a call --------------------------------------------------------------------------

    def release(self, call: Call) -> None:
        """The call is over: its session is free again, or gone if no turn of it was ever recorded (a
        first call that was refused or aborted must not hold one of max_sessions)."""
        s = call.session
        call.close()
        if s is not None and not s.turns and not s.busy:
            self.store.discard(s)
        self.metrics.sessions_open.set(len(self.store))

    async def end(self, call: Call) -> None:
        """`release`, and the session's lease given back before the response ends: the agent's next call,
        on any replica, must not find it still held."""
        lease, call.lease = call.lease, None
        self.release(call)
        if lease is not None:
            await lease.release()

    async def turn_finished(self, call: Call, run: ChoiceRun) -> None:
        """A choice of a session's call has finished: its turn joins the trajectory (unless it was
        aborted), and with Redis the session is saved before the client sees the turn end — its next call
        may go to any replica."""
        if self._record_turn(call, run) and self.durable is not None:
            await self._save_turn(call)

    async def _save_turn(self, call: Call) -> None:
        """Save the session after its new turn (fenced by the call's lease). If that fails, this replica's
        copy is dropped too — the fleet's state is the one before the turn, which the agent's retry of the
        call redoes — and the call answers 503."""
        s = call.session
        try:
            await self.durable.save(call.lease, s)
        except BaseException as exc:
            self.store.discard(s)
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

    # ---- finish and delete -----------------------------------------------------------------------

    async def finish(self, session_id: str, body: object) -> dict:
        """Close a session: its trajectory as one record, published when this replica has Redis."""
        check_id(session_id)
        if self.durable is not None:
            return await self._finish_durable(session_id, body)
        done = self.store.finished(session_id)
        if done is not None and session_id not in self.store:
            # A retried finish: the same answer (rebuilt from the record kept), nothing published twice.
            data, stream = done
            return session_answer(wire.decode_record(data), session_id, stream)
        req = parse_request(FinishRequest, body) if body else FinishRequest()
        s = self.store.get(session_id)
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
        self.store.close(session_id, (data, stream), size=len(data))
        self.metrics.session_answers.set(self.store.finished_held)
        self.metrics.sessions_open.set(len(self.store))
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
        local = self.store.peek(session_id)
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
                    self.store.discard(local)
                return session_answer(wire.decode_record(done[0]), session_id, done[1])
            req = parse_request(FinishRequest, body) if body else FinishRequest()
            s, _ = await self._latest(session_id, local)
            if s is None or not s.turns:
                if local is not None:
                    self.store.discard(local)
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
                self.store.discard(local)
            self.metrics.sessions_open.set(len(self.store))
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

    async def delete(self, session_id: str) -> dict:
        check_id(session_id)
        if self.durable is None:
            self.store.get(session_id)  # 404 / 409 as for finish
            self.store.close(session_id)
            self.metrics.sessions_open.set(len(self.store))
            return {"id": session_id, "deleted": True}
        local = self.store.peek(session_id)
        if local is not None and local.busy:
            raise AlreadyExists(f"session {session_id!r} has a call running; delete it after the call ends")
        with _redis_unreachable("the session was not deleted; delete it again later"):
            lease = await self.durable.lease(session_id)
            try:
                existed = await self.durable.delete(lease, session_id)
            finally:
                await lease.release()
        if local is not None:
            self.store.close(session_id)
        self.metrics.sessions_open.set(len(self.store))
        if not existed and local is None:
            raise NotFound(f"no session {session_id!r} in namespace {self.keys.namespace!r}")
        return {"id": session_id, "deleted": True}

    # ---- drain -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _redis_unreachable(then: str):
    """Redis out of reach past the client's retry budget → 503 with Retry-After, saying what became of
    the call (`then`); the session's state in Redis is untouched."""
    try:
        yield
    except REDIS_DOWN as exc:
        raise RetryLater(f"Redis is unreachable ({type(exc).__name__}: {exc}); {then}") from None


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
