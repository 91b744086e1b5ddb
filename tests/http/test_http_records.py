"""The multi-turn record on the wire (schema version 2) and the text side of the HTTP front end, without a
server: exact round trips, logprobs sent only for sampled tokens, version-1 records read as before,
malformed multi-turn payloads refused; incremental detokenization equal to decoding the whole."""

from __future__ import annotations

import numpy as np
import pytest

from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto.records import RolloutRecord, Semantics
from maskroll.server.http_api.chat import ChatFormat

K = 3


def record(mask: list[int] | None, segment_starts=(), num_turns=0) -> RolloutRecord:
    t = 8 if mask is None else len(mask)
    gen = np.ones(t, bool) if mask is None else np.array(mask, bool)
    rng = np.random.default_rng(0)
    sampled = np.where(gen, -rng.random(t), 0).astype(np.float32)
    topk = np.where(gen[:, None], -rng.random((t, K)), 0).astype(np.float32)
    return RolloutRecord(
        rollout_id="r",
        request_id="q",
        prompt_ids=np.array([256, 1, 2], np.int32),
        completion_ids=np.arange(10, 10 + t, dtype=np.int32),
        sampled_logprobs=sampled,
        sampled_ranks=gen.astype(np.int32) * 2,
        topk_ids=np.where(gen[:, None], rng.integers(0, 259, (t, K)), 0).astype(np.int32),
        topk_logprobs=topk,
        finish_reason="stop",
        semantics=Semantics(logprobs_k=K, engine="torch"),
        policy_version_first=1,
        policy_version_last=2,
        version_changes=[(5, 2)],
        loss_mask=None if mask is None else gen,
        segment_starts=list(segment_starts),
        num_turns=num_turns,
    )


MASK = [1, 1, 0, 0, 0, 1, 1, 1, 0, 1]


def test_a_multi_turn_record_round_trips_exactly_as_version_2():
    rec = record(MASK, segment_starts=[3], num_turns=3)
    msg = wire.record_to_pb(rec)
    assert msg.schema_version == 2
    g = sum(MASK)
    # only the sampled tokens' logprobs travel
    assert (len(msg.sampled_logprobs), len(msg.topk_logprobs), len(msg.loss_mask)) == (
        4 * g,
        4 * g * K,
        len(MASK),
    )
    back = wire.decode_record(msg.SerializeToString())
    for name in (
        "completion_ids",
        "sampled_logprobs",
        "sampled_ranks",
        "topk_ids",
        "topk_logprobs",
        "loss_mask",
    ):
        np.testing.assert_array_equal(getattr(back, name), getattr(rec, name), err_msg=name)
    assert (back.segment_starts, back.num_turns, back.schema_version) == ([3], 3, 2)
    assert back.version_changes == [(5, 2)] and not back.problems()


def test_a_single_turn_record_stays_version_1_and_reads_as_before():
    rec = record(None)
    msg = wire.record_to_pb(rec)
    assert msg.schema_version == 1 and not msg.loss_mask and msg.num_turns == 0
    back = wire.decode_record(msg.SerializeToString())
    assert back.loss_mask is None and back.generated.all() and back.segment_starts == []
    np.testing.assert_array_equal(back.topk_logprobs, rec.topk_logprobs)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda m: setattr(m, "schema_version", 1), "version 1 record carries multi-turn fields"),
        (lambda m: setattr(m, "loss_mask", m.loss_mask[:-1]), "loss_mask: 9 bytes"),
        (lambda m: setattr(m, "loss_mask", b"\x02" + m.loss_mask[1:]), "other than 0 and 1"),
        (lambda m: m.segment_starts.append(99), "segment_starts [3, 99]"),
        (lambda m: setattr(m, "topk_logprobs", m.topk_logprobs + b"\0\0\0\0"), "topk_logprobs"),
        (lambda m: setattr(m, "schema_version", 3), "schema_version 3"),
    ],
)
def test_malformed_multi_turn_payloads_are_refused(mutate, needle):
    msg = wire.record_to_pb(record(MASK, segment_starts=[3], num_turns=2))
    mutate(msg)
    with pytest.raises(wire.WireError, match=needle.replace("[", r"\[")):
        wire.decode_record(msg.SerializeToString())


def test_a_decoded_chunk_header_leaves_the_multi_turn_fields_empty():
    m = pb.GenerateChunk(record=wire.record_to_pb(record(None), arrays=False))
    assert wire.chunk_from_pb(m).record.loss_mask is None


def test_incremental_detokenization_equals_decoding_the_whole(tiny_model_dir):
    chat = ChatFormat(tiny_model_dir)
    text = "naïve café — 🙂 日本語 done"
    ids = list(text.encode())
    rng = np.random.default_rng(1)
    noise = [int(x) for x in rng.integers(0, 256, 40)]  # invalid UTF-8 too: U+FFFD as decode gives it
    for seq in (ids, noise, [*ids, 257, *ids]):
        d = chat.decoder([256])
        out = "".join(d.add(t) for t in seq) + d.flush()
        assert out == chat.decode(seq)
    assert chat.turn_end == "<eos>\n"
    assert chat.token_bytes(0xC3) == b"\xc3" and chat.token_text(0xC3) == "\ufffd"
    assert chat.continuation([{"role": "user", "content": "x"}], None, ended_with_stop=257) == [
        *list(b"\n<|user|>\nx"),
        257,
        *list(b"\n<|assistant|>\n"),
    ]


def test_a_tool_call_reply_sent_back_as_the_openai_client_sends_it_extends_the_session(tiny_model_dir):
    from maskroll.server.http_api.openai.protocol import normalize_messages
    from maskroll.server.http_api.sessions.trajectory import Session

    chat = ChatFormat(tiny_model_dir)
    s = Session("s", "", touched=0.0)
    first = normalize_messages([{"role": "user", "content": "2*3?"}])
    plan = s.plan_chat(chat, first, None)
    generated = [*b'<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>', 257]
    turn = record([1] * len(generated))
    turn.completion_ids = np.array(generated, np.int32)
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2*3"}'}}
    reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    s.add_turn(plan, turn, stop_token=257, messages=[*first, reply])
    # what the official client sends back: the pydantic message dumped, None fields and all
    echoed = {**reply, "refusal": None, "audio": None, "function_call": None, "annotations": None}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "6"}
    nxt = s.plan_chat(chat, normalize_messages([*first, echoed, tool]), None)
    assert not nxt.new_segment
    assert nxt.new_ids == [*b"\n<|tool|>\n6", 257, *b"\n<|assistant|>\n"]
    assert nxt.prompt_ids.tolist() == [*plan.prompt_ids.tolist(), *generated, *nxt.new_ids]
    other_id = {**echoed, "tool_calls": [{**call, "id": "call_2"}]}
    assert s.plan_chat(chat, normalize_messages([*first, other_id, tool]), None).new_segment
