"""Record building as pure functions: version history, the record = concatenation of its chunks, the
engine-contract check, and the abort record."""

from __future__ import annotations

import numpy as np
import pytest

from maskroll.proto.records import RecordAssembler, rollout_id_for
from maskroll.server.engines.contract import EngineOutput, SamplingParams
from maskroll.server.generation.records_builder import (
    RecordHeader,
    SampleBuilder,
    check_output,
    semantics_for,
)

K = 3


def out(tokens, version, finish=None, k=K) -> EngineOutput:
    t = len(tokens)
    base = np.asarray(tokens, np.float32)
    return EngineOutput(
        token_ids=np.asarray(tokens, np.int32),
        sampled_logprobs=-base / 10,
        sampled_ranks=np.arange(1, t + 1, dtype=np.int32),
        topk_ids=(np.asarray(tokens, np.int32)[:, None] + np.arange(k, dtype=np.int32)).reshape(t, k),
        topk_logprobs=(-base[:, None] / 10 - np.arange(k, dtype=np.float32)).reshape(t, k),
        policy_version=version,
        finish_reason=finish,
    )


def header(job_id="job", k=K) -> RecordHeader:
    params = SamplingParams(max_tokens=10, temperature=0.5, top_p=0.9, top_k=4, logprobs_k=k)
    return RecordHeader(
        request_id="req",
        job_id=job_id,
        group_id="grp",
        metadata={"m": "1"},
        prompt_ids=np.array([7, 8], np.int32),
        semantics=semantics_for(params, engine="torch", engine_version="5", model="tiny"),
        replica_id="rep",
    )


def record_of(outs, current_version=99, k=K):
    b = SampleBuilder(header(k=k), 0)
    for o in outs:
        b.hold(o)
    return b.record("stop", current_version, now=0.0)


def versions(rec):
    return rec.policy_version_first, rec.policy_version_last, rec.version_changes


def test_version_history_marks_each_change_at_its_first_token():
    # an output without tokens (version 9) carries no version
    outs = [out([1, 2], 3), out([], 9), out([3], 3), out([4, 5, 6], 4), out([7], 4), out([8], 6)]
    assert versions(record_of(outs)) == (3, 6, [(3, 4), (7, 6)])


def test_version_history_without_tokens_uses_the_current_version():
    assert versions(record_of([], current_version=7)) == (7, 7, [])
    assert versions(record_of([out([], 2, "stop")], current_version=7)) == (7, 7, [])


def test_record_is_the_concatenation_of_the_chunks_and_carries_the_header():
    b = SampleBuilder(header(), sample_index=2)
    chunks = [
        b.add(out([1, 2], 0), now=1.0),
        b.add(out([3], 1), now=2.0),
        b.add(out([4], 1, "length"), now=3.0),
    ]
    assert [c.start_index for c in chunks] == [0, 2, 3]
    assert [c.record is None for c in chunks] == [True, True, False]
    rec = chunks[-1].record
    np.testing.assert_array_equal(rec.completion_ids, [1, 2, 3, 4])
    np.testing.assert_array_equal(rec.sampled_logprobs, np.float32([-0.1, -0.2, -0.3, -0.4]))
    np.testing.assert_array_equal(rec.sampled_ranks, [1, 2, 1, 1])
    np.testing.assert_array_equal(rec.topk_ids[3], [4, 5, 6])
    assert rec.topk_logprobs.shape == (4, K) and rec.topk_logprobs.dtype == np.float32
    assert (rec.policy_version_first, rec.policy_version_last, rec.version_changes) == (0, 1, [(2, 1)])
    assert rec.rollout_id == rollout_id_for("job", 2) and rec.sample_index == 2
    assert (rec.request_id, rec.group_id, rec.metadata, rec.replica_id, rec.created_at) == (
        "req",
        "grp",
        {"m": "1"},
        "rep",
        3.0,
    )
    assert (
        rec.finish_reason == "length"
        and rec.semantics.top_k == 4
        and rec.semantics.logprobs_mode == "processed"
    )
    # What a client reassembles from the same chunks (header without arrays) is the same record.
    assembler = RecordAssembler()
    for c in chunks:
        got = assembler.add(c)
    for name in ("completion_ids", "sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs"):
        np.testing.assert_array_equal(getattr(got, name), getattr(rec, name))


def test_abort_ends_the_sample_with_what_it_has():
    b = SampleBuilder(header(), sample_index=0)
    b.add(out([1, 2], 5), now=1.0)
    last = b.abort(current_version=6, now=2.0)
    assert len(last.token_ids) == 0 and last.start_index == 2 and last.topk_ids.shape == (0, K)
    rec = last.record
    assert rec.finish_reason == "abort" and rec.num_tokens == 2 and rec.policy_version_last == 5
    with pytest.raises(RuntimeError, match="finished twice"):
        b.abort(current_version=6, now=3.0)


def test_abort_before_any_token_gives_an_empty_record_with_k_columns():
    rec = SampleBuilder(header(job_id=""), sample_index=1).abort(current_version=4, now=0.0).record
    assert rec.topk_ids.shape == (0, K) and rec.num_tokens == 0
    assert (rec.policy_version_first, rec.policy_version_last) == (4, 4)
    assert rec.rollout_id == rollout_id_for("req", 1)  # no job id: the request id stands in


def test_k_zero_records_have_zero_width_topk():
    rec = record_of([out([1, 2], 0, "stop", k=0)], k=0)
    assert rec.topk_ids.shape == (2, 0) and rec.topk_logprobs.shape == (2, 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("topk_ids", np.zeros((2, K + 1), np.int32)),  # K + 1 entries: the sampled token leaked in
        ("topk_logprobs", np.zeros((2, K - 1), np.float32)),
        ("sampled_logprobs", np.zeros(3, np.float32)),
        ("sampled_ranks", np.zeros(1, np.int32)),
        ("token_ids", np.array([[1], [2]], np.int32)),  # [t, 1]: would make a 2-D completion
    ],
)
def test_misshaped_engine_output_is_refused(field, value):
    o = out([1, 2], 0)
    setattr(o, field, value)
    with pytest.raises(RuntimeError, match=field):
        check_output(o, K)
    with pytest.raises(RuntimeError, match=field):  # and when held: nothing of it is kept
        SampleBuilder(header(), 0).hold(o)


def test_unknown_finish_reason_is_refused():
    with pytest.raises(RuntimeError, match="finish_reason"):
        check_output(out([1], 0, "eos"), K)


def test_held_outputs_go_as_one_chunk_and_the_record_joins_the_chunks():
    b = SampleBuilder(header(), sample_index=0)
    b.hold(out([1, 2], 0))
    b.hold(out([3], 0))
    assert (b.held_tokens, b.sent_tokens) == (3, 0)
    first = b.take_chunk()
    assert (first.start_index, first.policy_version, first.record) == (0, 0, None)
    np.testing.assert_array_equal(first.token_ids, [1, 2, 3])
    np.testing.assert_array_equal(first.topk_ids, [[1, 2, 3], [2, 3, 4], [3, 4, 5]])
    assert first.sampled_ranks.tolist() == [1, 2, 1] and first.topk_logprobs.shape == (3, K)
    b.hold(out([], 0))  # no tokens: adds nothing to a chunk
    assert not b.changes_version(out([4, 5], 1))  # nothing held: nothing to split
    b.hold(out([4, 5], 1))
    assert b.changes_version(out([6], 2)) and not b.changes_version(out([6], 1))
    assert not b.changes_version(out([], 2))  # a version without tokens changes nothing
    last = b.finish("stop", 1, now=5.0)
    assert (last.start_index, last.policy_version, len(last.token_ids)) == (3, 1, 2)
    rec = last.record
    np.testing.assert_array_equal(rec.completion_ids, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(rec.sampled_logprobs, np.float32([-0.1, -0.2, -0.3, -0.4, -0.5]))
    assert (rec.policy_version_first, rec.policy_version_last, rec.version_changes) == (0, 1, [(3, 1)])
    with pytest.raises(RuntimeError, match="finished twice"):
        b.finish("stop", 1, now=6.0)


def test_outputs_given_as_lists_are_checked_and_joined_as_arrays():
    o = EngineOutput(
        token_ids=[5, 6],
        sampled_logprobs=[-0.5, -0.25],
        sampled_ranks=[1, 2],
        topk_ids=[[5, 1, 2], [6, 1, 2]],
        topk_logprobs=[[-0.5, -1, -2], [-0.25, -1, -2]],
        policy_version=0,
        finish_reason="length",
    )
    check_output(o, K)
    rec = SampleBuilder(header(), 0).add(o, now=0.0).record
    assert rec.topk_ids.dtype == np.int32 and rec.topk_ids.shape == (2, K)
    np.testing.assert_array_equal(rec.sampled_logprobs, np.float32([-0.5, -0.25]))
    o.topk_ids = [[5, 1], [6, 1]]
    with pytest.raises(RuntimeError, match=r"topk_ids has shape \(2, 2\), expected \(2, 3\)"):
        check_output(o, K)


def test_strided_views_other_dtypes_and_lists_are_copied_into_writable_int32_float32_arrays():
    # Engine arrays of the right dtype (here strided views of one table), int64 ids and lists all land as
    # the same int32 / float32 [t] and [t, K] arrays as np.concatenate would give, copies of the engine's.
    table = np.arange(40, dtype=np.int32).reshape(10, 4)  # column 0: the token, 1..3: its top-K ids
    views = [
        EngineOutput(
            token_ids=table[i : i + 1, 0],
            sampled_logprobs=-table[i : i + 1, 0].astype(np.float32),
            sampled_ranks=np.ones(1, np.int32),
            topk_ids=table[i : i + 1, 1:],
            topk_logprobs=np.full((1, K), -0.5 * i, np.float32),
            policy_version=0,
        )
        for i in range(3)
    ]
    wide = EngineOutput(**{**views[2].__dict__, "token_ids": np.array([8], np.int64)})
    listed = EngineOutput(
        token_ids=[7, 9], sampled_logprobs=[-1.0, -2.0], sampled_ranks=[1, 1],
        topk_ids=[[1, 2, 3], [4, 5, 6]], topk_logprobs=[[0.0] * K, [-1.0] * K], policy_version=0,
    )  # fmt: skip
    flat_empty = EngineOutput(**{**out([], 0).__dict__, "topk_ids": np.zeros(0, np.int32)})  # [0], not [0, K]
    b = SampleBuilder(header(), 0)
    for o in (*views, out([], 0), flat_empty, wide, listed):
        b.hold(o)
    chunk = b.take_chunk()
    rec = b.record("stop", 0, now=0.0)
    for got in (chunk, rec):
        ids = got.token_ids if got is chunk else got.completion_ids
        np.testing.assert_array_equal(ids, [0, 4, 8, 8, 7, 9])
        np.testing.assert_array_equal(
            got.topk_ids, [[1, 2, 3], [5, 6, 7], [9, 10, 11], [9, 10, 11], [1, 2, 3], [4, 5, 6]]
        )
        np.testing.assert_array_equal(got.sampled_logprobs, np.float32([0, -4, -8, -8, -1, -2]))
        np.testing.assert_array_equal(got.topk_logprobs[:, 0], np.float32([0.0, -0.5, -1.0, -1.0, 0.0, -1.0]))
        assert (ids.dtype, got.topk_ids.dtype, got.topk_logprobs.dtype) == (np.int32, np.int32, np.float32)
    rec.topk_ids[0, 0] = 99  # writable, and a copy: the engine's table and the chunk are untouched
    assert table[0, 1] == 1 and chunk.topk_ids[0, 0] == 1
    assert SampleBuilder(header(k=0), 0).record("stop", 0, now=0.0).topk_ids.shape == (0, 0)


def test_held_outputs_are_kept_uncopied_and_each_chunk_and_record_gets_arrays_of_its_own():
    # hold keeps the engine's arrays as they are (the Engine contract gives them away); the chunk, even
    # of one output, and the record are new arrays: writing to either touches nothing else.
    o = out([5, 6], 0)
    b = SampleBuilder(header(), 0)
    b.hold(o)
    assert b._parts[3][0] is o.topk_ids
    chunk = b.take_chunk()
    b.hold(out([7], 0))
    rec = b.record("stop", 0, now=0.0)
    arrays = ("token_ids", "sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs")
    for name in arrays:
        assert not np.shares_memory(getattr(chunk, name), getattr(o, name)), name
    for a in (rec.completion_ids, rec.sampled_logprobs, rec.sampled_ranks, rec.topk_ids, rec.topk_logprobs):
        assert not any(np.shares_memory(a, getattr(x, n)) for x in (o, chunk) for n in arrays)
    chunk.topk_logprobs[0, 0] = 1.0
    assert o.topk_logprobs[0, 0] == np.float32(-0.5) and rec.topk_logprobs[0, 0] == np.float32(-0.5)
    np.testing.assert_array_equal(rec.completion_ids, [5, 6, 7])


def test_a_misshaped_output_is_refused_when_held_before_any_chunk_or_record():
    b = SampleBuilder(header(), 0)
    b.hold(out([1, 2], 0))
    bad = out([3], 0)
    bad.topk_ids = np.zeros((1, K + 1), np.int32)  # the sampled token leaked into the top-K
    with pytest.raises(RuntimeError, match=r"topk_ids has shape \(1, 4\), expected \(1, 3\)"):
        b.hold(bad)
    assert b.held_tokens == 2  # nothing of it was kept


def test_many_chunks_join_into_the_record():
    # 200 tokens in outputs of 1 to 7 tokens, a chunk now and then: every chunk holds its own tokens,
    # and the record is their concatenation
    b = SampleBuilder(header(), 0)
    chunks, made, size = [], 0, 1
    while made < 200:
        n = min(size, 200 - made)
        b.hold(out(list(range(made, made + n)), 0))
        made, size = made + n, size % 7 + 1
        if made % 3 == 0 or made == 200:
            chunks.append(b.finish("length", 0, now=0.0) if made == 200 else b.take_chunk())
    for c in chunks:
        np.testing.assert_array_equal(c.token_ids, np.arange(c.start_index, c.start_index + len(c.token_ids)))
        np.testing.assert_array_equal(c.topk_ids[:, 2], c.token_ids + 2)
    rec = chunks[-1].record
    np.testing.assert_array_equal(rec.completion_ids, np.arange(200))
    np.testing.assert_array_equal(rec.sampled_logprobs, np.concatenate([c.sampled_logprobs for c in chunks]))
    assert sum(len(c.token_ids) for c in chunks) == 200 and len(chunks) > 10
