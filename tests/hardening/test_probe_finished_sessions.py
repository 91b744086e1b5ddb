"""Item 4 of the hardening issue: finished sessions were remembered by count, not size — up to 1024 whole
finish answers with their top-K arrays (8.6 MB of JSON each at K = 20 and 32k tokens), tens of GB at
the bound. Now a finished session keeps what a retried finish needs (the encoded record its answer is
rebuilt from), within a byte budget (--session-answer-mb): past it the oldest are forgotten, the bytes
held stay under the budget, /healthz keeps answering within a second while each finish is answered, and
the most recent finish retried still gets its answer.

Tens of GB cannot be generated in a test: the replica here gets a 1 MB budget and K = 256 (2 KB of record
a sampled token), so that a few sessions of a few hundred tokens pass it.
"""

from __future__ import annotations

import pytest
from probe_helpers import HealthzWatch, HttpServe

pytestmark = pytest.mark.slow
SESSIONS = 6
TOKENS = 250  # sampled a session: about 0.5 MB of record at K = 256
BUDGET_MB = 1


@pytest.fixture(scope="module")
def big_sessions(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("finished") / "serve.log"
    s = HttpServe(model_dir, log, "--max-logprobs", "256", "--session-answer-mb", str(BUDGET_MB))
    yield s
    assert s.stop() == 0


def _episode(s: HttpServe, h, sid: str) -> dict:
    headers = {"x-maskroll-session": sid}
    turn = {"model": s.model, "prompt": "x", "max_tokens": TOKENS, "ignore_eos": True}
    r = h.post("/v1/completions", json=turn, headers=headers)
    assert r.status_code == 200, r.text
    with HealthzWatch(s.base) as watch:
        done = h.post(f"/v1/sessions/{sid}/finish")
    assert done.status_code == 200, done.text
    assert watch.worst < 1.0, f"/healthz took {watch.worst:.2f} s while a finish was answered"
    assert len(done.json()["token_ids"]) == TOKENS
    return done.json()


def test_finished_sessions_keep_their_answers_within_a_byte_budget(big_sessions):
    s = big_sessions
    with s.http(timeout=120) as h:
        answers = [_episode(s, h, f"big-{i}") for i in range(SESSIONS)]
        held = s.metric("maskroll_session_answer_bytes")
        assert 0 < held <= BUDGET_MB << 20, f"{held} bytes held for finished sessions"
        again = h.post(f"/v1/sessions/big-{SESSIONS - 1}/finish")
        assert again.status_code == 200 and again.json() == answers[-1]  # rebuilt, the same answer
        oldest = h.post("/v1/sessions/big-0/finish")
        assert oldest.status_code == 404, oldest.text  # forgotten to stay within the budget
        assert "no session 'big-0' on this replica" in oldest.json()["error"]["message"]
    s.completion_served()
