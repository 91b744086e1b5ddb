"""Agent sessions over the OpenAI API (the official client, a real replica with Redis): a 3-turn tool
session captured token-exactly with the right loss mask, published as one record a trainer collates;
edited history recorded as a new segment; text-prompt sessions; the bounds on sessions."""

from __future__ import annotations

import re
import threading

import httpx
import numpy as np
import openai
import pytest
import redis
from http_fixtures import NAMESPACE, make_served

from maskroll.app.model_init import BOS_ID, EOS_ID
from maskroll.proto import wire
from maskroll.proto.streams import F_RECORD, StreamKeys
from maskroll.server.http_api.sessions.trajectory import SessionStore
from maskroll.trainer_adapter import collate

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def ids_of(text: str) -> list[int]:
    """The tiny model's ids of template text: a byte per byte, <bos> / <eos> as their special ids."""
    out = []
    for part in re.split(r"(<bos>|<eos>)", text):
        out += [BOS_ID] if part == "<bos>" else [EOS_ID] if part == "<eos>" else list(part.encode())
    return out


def closing(generated: list[int]) -> list[int]:
    """What follows the model's turn before the next message: the template closes a turn with
    "<eos>\\n"; a model that stopped on <eos> wrote its first part itself."""
    return ids_of("\n") if generated[-1] == EOS_ID else ids_of("<eos>\n")


def turn(client, session: str, messages, group: str = "", **kw):
    headers = {"X-Maskroll-Session": session}
    if group:
        headers["X-Maskroll-Group"] = group
    out = client.chat.completions.create(
        model="model",
        messages=messages,
        max_tokens=kw.pop("max_tokens", 6),
        extra_headers=headers,
        extra_body={"return_token_ids": True, **kw.pop("extra_body", {})},
        **kw,
    )
    choice = out.choices[0]
    return out.model_extra["prompt_token_ids"], choice.model_extra["token_ids"], choice


def records_in_redis(url: str, stream: str) -> list:
    r = redis.Redis.from_url(url)
    try:
        return [wire.decode_record(fields[F_RECORD]) for _, fields in r.xrange(stream)]
    finally:
        r.close()


def test_a_three_turn_tool_session_is_one_token_exact_record_with_its_loss_mask(served):
    c = served.openai()
    messages = [
        {"role": "system", "content": "You can use a calculator."},
        {"role": "user", "content": "What is 17*23?"},
    ]
    kw = dict(tools=[CALCULATOR], logprobs=True, top_logprobs=20, seed=7)
    p1, g1, ch1 = turn(c, "agent-1", messages, group="g-1", **kw)
    tools_text = '[{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]'  # noqa: E501
    assert p1 == ids_of(
        f"<bos><|tools|>\n{tools_text}<eos>\n<|system|>\nYou can use a calculator.<eos>\n"
        "<|user|>\nWhat is 17*23?<eos>\n<|assistant|>\n"
    )
    messages += [ch1.message, {"role": "tool", "tool_call_id": "call-1", "content": "391"}]
    p2, g2, ch2 = turn(c, "agent-1", messages, group="g-1", **kw)
    tool_part = closing(g1) + ids_of("<|tool|>\n391<eos>\n<|assistant|>\n")
    assert p2 == p1 + g1 + tool_part  # turn 1's sampled ids kept, only the new message tokenized
    messages += [ch2.message, {"role": "user", "content": "So?"}]
    p3, g3, ch3 = turn(c, "agent-1", messages, group="g-1", **kw)
    user_part = closing(g2) + ids_of("<|user|>\nSo?<eos>\n<|assistant|>\n")
    assert p3 == p2 + g2 + user_part

    with served.http() as h:
        r = h.post("/v1/sessions/agent-1/finish", json={"metadata": {"reward": "1.0"}, "group_size": 1})
    assert r.status_code == 200, r.text
    done = r.json()
    completion = g1 + tool_part + g2 + user_part + g3
    mask = [1] * len(g1) + [0] * len(tool_part) + [1] * len(g2) + [0] * len(user_part) + [1] * len(g3)
    assert done["prompt_token_ids"] == p1
    assert done["token_ids"] == completion and done["loss_mask"] == mask
    assert (done["num_turns"], done["num_segments"], done["published"]) == (3, 1, True)
    logprobs = [e.logprob for ch in (ch1, ch2, ch3) for e in ch.logprobs.content]
    assert [x for x in done["sampled_logprobs"] if x is not None] == pytest.approx(logprobs, abs=1e-6)
    assert [x is None for x in done["sampled_logprobs"]] == [m == 0 for m in mask]

    (rec,) = [
        x
        for x in records_in_redis(served.redis_url, done["rollout_stream"])
        if x.rollout_id == done["rollout_id"]
    ]
    assert done["rollout_stream"] == StreamKeys(NAMESPACE).rollouts
    assert (rec.schema_version, rec.num_turns, rec.group_id, rec.job_id) == (2, 3, "g-1", "g-1")
    assert rec.prompt_ids.tolist() == p1 and rec.completion_ids.tolist() == completion
    assert rec.loss_mask.astype(int).tolist() == mask and rec.metadata["reward"] == "1.0"
    assert rec.semantics.logprobs_k == 20 and not rec.problems()
    tops = [[t.logprob for t in e.top_logprobs] for ch in (ch1, ch2, ch3) for e in ch.logprobs.content]
    np.testing.assert_allclose(rec.topk_logprobs[rec.generated], tops, rtol=0, atol=1e-6)
    assert not rec.topk_logprobs[~rec.generated].any() and not rec.sampled_ranks[~rec.generated].any()

    batch = collate([rec], [1.0])
    t = len(completion)
    assert batch.response_mask[0, :t].tolist() == [bool(m) for m in mask]
    assert batch.input_ids[0, batch.prompt_len - len(p1) :].tolist() == p1 + completion
    assert batch.record_index.tolist() == [0]

    with served.http() as h:  # finishing again answers the same, publishing nothing twice
        again = h.post("/v1/sessions/agent-1/finish").json()
    assert again["rollout_id"] == done["rollout_id"]
    assert (
        len(
            [
                x
                for x in records_in_redis(served.redis_url, done["rollout_stream"])
                if x.rollout_id == done["rollout_id"]
            ]
        )
        == 1
    )


def test_edited_history_starts_a_new_segment_never_a_mix(served):
    c = served.openai()
    messages = [{"role": "user", "content": "Hi"}]
    p1, g1, _ch1 = turn(c, "edit-1", messages, seed=1)
    edited = [
        *messages,
        {"role": "assistant", "content": "(rewritten by the agent)"},
        {"role": "user", "content": "Go on"},
    ]
    p2, g2, _ = turn(c, "edit-1", edited, seed=2)
    fresh = ids_of(
        "<bos><|user|>\nHi<eos>\n<|assistant|>\n(rewritten by the agent)<eos>\n"
        "<|user|>\nGo on<eos>\n<|assistant|>\n"
    )
    assert p2 == fresh  # re-rendered from the edited messages, not appended to turn 1's ids
    with served.http() as h:
        done = h.post("/v1/sessions/edit-1/finish").json()
    assert done["segment_starts"] == [len(g1)] and done["num_segments"] == 2
    assert done["token_ids"] == g1 + fresh + g2
    assert done["loss_mask"] == [1] * len(g1) + [0] * len(fresh) + [1] * len(g2)
    (rec,) = [
        x
        for x in records_in_redis(served.redis_url, done["rollout_stream"])
        if x.rollout_id == done["rollout_id"]
    ]
    batch = collate([rec], [0.5])
    # each segment is a row with its own context: the second row's prompt is the fresh prompt
    assert batch.record_index.tolist() == [0, 0] and batch.rewards.tolist() == [0.5, 0.5]
    assert batch.input_ids[0, batch.prompt_len - len(p1) : batch.prompt_len].tolist() == p1
    assert batch.input_ids[1, batch.prompt_len - len(fresh) : batch.prompt_len].tolist() == fresh
    assert batch.completion_ids[1, : len(g2)].tolist() == g2 and batch.response_mask[1].sum() == len(g2)


def test_the_returned_message_as_a_plain_dict_extends_the_session_too(served):
    c = served.openai()
    messages = [{"role": "user", "content": "Hi"}]
    p1, g1, ch1 = turn(c, "plain-1", messages, seed=4)
    again = [
        *messages,
        {"role": "assistant", "content": ch1.message.content},
        {"role": "user", "content": "?"},
    ]
    p2, _, _ = turn(c, "plain-1", again, seed=5)
    assert p2 == p1 + g1 + closing(g1) + ids_of("<|user|>\n?<eos>\n<|assistant|>\n")
    with served.http() as h:
        assert h.delete("/v1/sessions/plain-1").json() == {"id": "plain-1", "deleted": True}
        assert h.post("/v1/sessions/plain-1/finish").status_code == 404


def test_a_text_completion_session_tokenizes_only_the_new_text(served):
    c = served.openai()
    h = {"X-Maskroll-Session": "text-1"}
    kw = dict(model="model", max_tokens=5, seed=3, extra_headers=h, extra_body={"return_token_ids": True})
    first = c.completions.create(prompt="Q: 2+2=", **kw).choices[0]
    follow = "Q: 2+2=" + first.text + "\nQ: 3+3="
    second = c.completions.create(prompt=follow, **kw).choices[0]
    g1 = first.model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"] == [BOS_ID, *b"Q: 2+2=", *g1, *list(b"\nQ: 3+3=")]
    with httpx.Client(base_url=served.base_url, headers=served.headers) as x:
        done = x.post(
            "/v1/sessions/text-1/finish", json={"rollout_stream": StreamKeys(NAMESPACE).rollouts + ":text"}
        ).json()
    assert done["rollout_stream"] == f"maskroll:{NAMESPACE}:rollouts:text"
    assert done["loss_mask"] == [1] * len(g1) + [0] * len(b"\nQ: 3+3=") + [1] * len(
        second.model_extra["token_ids"]
    )


def test_session_rules_and_bounds(http_loop, http_engine, tiny_model_dir):
    with make_served(http_loop, http_engine, tiny_model_dir, max_sessions=2, max_session_tokens=60) as s:
        c = s.openai()
        msgs = [{"role": "user", "content": "Hi"}]
        turn(c, "a", msgs, max_tokens=2)
        turn(c, "b", msgs, max_tokens=2)
        with pytest.raises(openai.RateLimitError, match="holds 2 sessions"):
            turn(c, "c", msgs, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="n must be 1 in a session"):
            turn(c, "a", msgs, n=2)
        with pytest.raises(openai.BadRequestError, match=r"temperature = 0\.5 differs from session 'a'"):
            turn(c, "a", msgs, temperature=0.5)
        with pytest.raises(openai.BadRequestError, match="X-Maskroll-Session"):
            turn(c, "bad id!", msgs)
        long = [{"role": "user", "content": "x" * 80}]
        with pytest.raises(openai.BadRequestError, match="at most max_session_tokens = 60"):
            turn(c, "a", long, max_tokens=2)  # an edited history: its fresh prompt would overflow
        with s.http() as h:
            r = h.post("/v1/sessions/a/finish", json={"metadata": {f"k{i}": "v" for i in range(65)}})
            assert r.status_code == 400 and "metadata has 65 entries" in r.json()["error"]["message"]
            r = h.post("/v1/sessions/a/finish", json={"group_size": 2, "sample_index": 2})
            assert r.status_code == 400 and "sample_index 2 must be < group_size 2" in r.text
            r = h.post("/v1/sessions/a/finish", json={"rollout_stream": "x"})
            assert r.status_code == 400 and "rollout_stream needs a server started with redis_url" in r.text
            done = h.post("/v1/sessions/a/finish").json()
            assert done["published"] is False and done["num_turns"] == 1
            assert h.post("/v1/sessions/nope/finish").status_code == 404
        with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
            turn(c, "z", msgs, max_tokens=0)  # a refused first call leaves no session behind...
        turn(c, "c", msgs, max_tokens=2)  # ...so a finished one made room for this one

        # one call at a time per session: a second call while a stream runs is refused (409)
        started = threading.Event()

        def long_stream():
            stream = c.chat.completions.create(
                model="model", messages=msgs, max_tokens=900, stream=True,
                extra_headers={"X-Maskroll-Session": "b"}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in stream:
                started.set()

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(30)
        with pytest.raises(openai.ConflictError, match="has a call running"):
            turn(c, "b", msgs, max_tokens=2)
        t.join(60)


def test_idle_sessions_expire_and_busy_ones_do_not():
    now = [0.0]
    store = SessionStore(max_sessions=3, idle_s=10, max_tokens=100, clock=lambda: now[0])
    _a, b = store.open("a", ""), store.open("b", "g")
    b.busy = "call-1"
    now[0] = 11
    assert store.expire() == 1 and "a" not in store and "b" in store
    b.busy = None
    now[0] = 22
    store.open("c", "")
    assert "b" not in store and len(store) == 1
    with pytest.raises(Exception, match="differs from session 'c'"):
        store.open("c", "other-group")
