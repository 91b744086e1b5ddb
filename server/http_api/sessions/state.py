"""An agent session's state as bytes: what Redis holds between turns so that any replica can serve the next.

A session between turns is a record in progress: `Session.record()` already assembles its trajectory
into one RolloutRecord (first prompt, every later token, loss mask, sampled logprobs, ranks and top-K,
per-token versions, segment starts). The state is that record in the records' own codec
(`wire.encode_record`: arrays as packed bytes, decoded as views) plus a small JSON header for what the
record does not carry: the kind, the nonce, the group, each turn's bounds and ending, the conversation
as recorded (chat) or the text so far (completion), and the stop token the last turn ended on. No
pickle: a replica decodes only data. `decode_state` rebuilds a `Session` whose `record()` is the one the
encoded session would have produced (tests/http/test_session_durable.py), so a moved session is
re-prefilled from its stored ids and never re-tokenized.

Pure (no Redis, no engine); `durable` stores the two parts.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np

from maskroll.proto import wire

from .trajectory import Session, Turn

STATE_VERSION = 1  # the header's layout; a replica refuses a state it does not know


class StateError(ValueError):
    """Bytes that are not a session state this replica can read."""


def encode_state(s: Session) -> tuple[bytes, bytes]:
    """(header JSON, record bytes) of a session with at least one turn."""
    if not s.turns:
        raise ValueError(f"session {s.id!r} has no turn: there is no state to keep")
    rec = s.record(metadata={}, group_size=1, sample_index=0, replica_id="", now=0.0)
    header = {
        "v": STATE_VERSION,
        "id": s.id,
        "group_id": s.group_id,
        "nonce": s.nonce,
        "kind": s.kind,
        # [start, tokens, finish_reason, run_id, policy_version_first] per turn: the record holds every
        # turn's tokens; only these tell where one turn ends and how.
        "turns": [
            [
                t.start,
                t.record.num_tokens,
                t.record.finish_reason,
                t.record.run_id,
                t.record.policy_version_first,
            ]
            for t in s.turns
        ],
        "messages": s.messages,
        "tools": s.tools,
        "text": s.text,
        "stop_token": s.stop_token,
    }
    return json.dumps(header, separators=(",", ":")).encode(), wire.encode_record(rec)


def decode_state(header: bytes, record: bytes, *, now: float | None = None) -> Session:
    """The Session `encode_state` was given (its `touched` set to `now`, default monotonic now)."""
    try:
        h = json.loads(header)
        if h.get("v") != STATE_VERSION:
            raise StateError(f"session state version {h.get('v')!r}; this replica reads {STATE_VERSION}")
        rec = wire.decode_record(record)
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, StateError):
            raise
        raise StateError(f"unreadable session state: {type(exc).__name__}: {exc}") from None
    s = Session(h["id"], h["group_id"], time.monotonic() if now is None else now, nonce=h["nonce"])
    s.kind, s.messages, s.tools, s.text, s.stop_token = (
        h["kind"],
        h["messages"],
        h["tools"],
        h["text"],
        h["stop_token"],
    )
    s.prompt_ids = np.array(rec.prompt_ids, np.int32)  # a copy: the record's arrays view `record`
    s.ids = rec.completion_ids.tolist()
    s.mask = bytearray(np.asarray(rec.loss_mask, np.uint8).tobytes())
    s.segment_starts = list(rec.segment_starts)
    s.semantics = rec.semantics
    versions = rec.token_versions()  # int64 [T]
    for start, n, finish_reason, run_id, first in h["turns"]:
        s.turns.append(Turn(start, _turn_record(rec, versions, start, n, finish_reason, run_id, first)))
    return s


def _turn_record(rec, versions: np.ndarray, a: int, n: int, finish_reason: str, run_id: str, first: int):
    """Turn tokens [a, a + n) of the assembled record as the turn's own record (prompt dropped, as
    Session.add_turn keeps it). versions: int64 [T] of the whole trajectory."""
    b = a + n
    v = versions[a:b]  # [n]
    changed = np.flatnonzero(v[1:] != v[:-1]) + 1
    return replace(
        rec,
        prompt_ids=np.zeros(0, np.int32),
        completion_ids=np.array(rec.completion_ids[a:b]),
        sampled_logprobs=np.array(rec.sampled_logprobs[a:b]),
        sampled_ranks=np.array(rec.sampled_ranks[a:b]),
        topk_ids=np.array(rec.topk_ids[a:b]),
        topk_logprobs=np.array(rec.topk_logprobs[a:b]),
        finish_reason=finish_reason,
        run_id=run_id,
        policy_version_first=int(v[0]) if n else first,
        policy_version_last=int(v[-1]) if n else first,
        version_changes=[(int(i), int(v[i])) for i in changed],
        loss_mask=None,
        segment_starts=[],
        num_turns=0,
    )
