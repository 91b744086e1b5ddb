"""The wire contract: generated code is fresh, records round-trip bit-exactly, bad bytes are refused —
and no payload whatever makes the decoder raise anything but WireError, or makes a decoded record's
semantic check raise (fuzzed with hypothesis: random bytes, mutated bytes, mutated fields)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maskroll.proto import varint, wire
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto.records import (
    RecordAssembler,
    RolloutChunk,
    RolloutRecord,
    SamplingOptions,
    Semantics,
    ServerInfo,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generated_code_is_not_stale(tmp_path: pathlib.Path) -> None:
    from maskroll.proto import generate

    fresh = {p.name: p.read_bytes() for p in generate.generate(tmp_path / "out")}
    committed = {p.name: p.read_bytes() for p in generate.OUT.iterdir() if p.is_file()}
    assert set(fresh) == set(committed), "run `make proto`: the generated file set differs"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not stale, f"run `make proto`: {stale} differ from proto/maskroll/v1/*.proto"


def _record(t: int = 5, k: int = 3, seed: int = 0) -> RolloutRecord:
    rng = np.random.default_rng(seed)
    return RolloutRecord(
        rollout_id="rid",
        request_id="req",
        prompt_ids=rng.integers(0, 250, 7).astype(np.int32),
        completion_ids=rng.integers(0, 250, t).astype(np.int32),
        sampled_logprobs=-rng.random(t).astype(np.float32),
        sampled_ranks=rng.integers(1, 9, t).astype(np.int32),
        topk_ids=rng.integers(0, 250, (t, k)).astype(np.int32),
        topk_logprobs=-np.sort(rng.random((t, k)).astype(np.float32), axis=1),
        finish_reason="length",
        semantics=Semantics(temperature=0.7, top_p=0.9, top_k=40, logprobs_k=k, engine="torch", model="m"),
        policy_version_first=3,
        policy_version_last=4,
        version_changes=[(2, 4)],
        job_id="job",
        group_id="g",
        sample_index=1,
        metadata={"task": "digits"},
        replica_id="r1",
        created_at=12.5,
        group_size=2,
        run_id="run-a",
    )


def _assert_same(a: RolloutRecord, b: RolloutRecord) -> None:
    for name, value in a.__dict__.items():
        other = getattr(b, name)
        if isinstance(value, np.ndarray):
            nan = value.dtype.kind == "f"  # a fuzzed payload may carry NaN bytes: the same bytes decode alike
            assert value.dtype == other.dtype and np.array_equal(value, other, equal_nan=nan), name
        else:
            assert value == other, name


def test_record_round_trip_is_exact() -> None:
    rec = _record()
    data = wire.encode_record(rec)
    _assert_same(rec, wire.decode_record(data))
    # packed little-endian arrays: [T, K] float32 costs T*K*4 bytes, not text
    assert len(data) < 7 * 4 + 5 * (4 + 4 + 4) + 5 * 3 * 8 + 200
    assert np.array_equal(_record().token_versions(), [3, 3, 4, 4, 4])


def test_the_reward_round_trips_with_presence() -> None:
    """An unscored record has no reward (not 0.0); a reward of 0.0 is a reward; verifier and reason travel."""
    unscored = _record()
    assert wire.decode_record(wire.encode_record(unscored)).reward is None
    assert not wire.record_to_pb(unscored).HasField("reward")
    for value in (0.0, -1.5, 0.625, 1e300):
        rec = _record()
        rec.reward, rec.reward_verifier, rec.reward_reason = value, "math", "expected 3/4, got 0.75: equal"
        back = wire.decode_record(wire.encode_record(rec))
        _assert_same(rec, back)
        assert back.reward == value and wire.record_to_pb(rec).HasField("reward")
        # the hand-written codec and protobuf's own parse agree on the scored record too
        assert pb.RolloutRecord.FromString(wire.encode_record(rec)) == wire.record_to_pb(rec)
        _assert_same(rec, wire.record_from_pb(pb.RolloutRecord.FromString(wire.encode_record(rec))))
    rec = _record()
    rec.reward = float("nan")
    assert any("reward nan is not a finite number" in p for p in rec.problems())
    rec.reward = 0.5
    assert rec.problems() == []


@pytest.mark.parametrize("cut", [1, 9, 40])
def test_truncated_bytes_are_refused(cut: int) -> None:
    data = wire.encode_record(_record())
    with pytest.raises(wire.WireError):
        wire.decode_record(data[:-cut])


def test_foreign_and_inconsistent_payloads_are_refused() -> None:
    with pytest.raises(wire.WireError):
        wire.decode_record(b"not a protobuf \xff\xfe")
    msg = wire.record_to_pb(_record())
    msg.num_tokens = 6  # arrays hold 5 tokens
    with pytest.raises(wire.WireError, match="completion_token_ids"):
        wire.decode_record(msg.SerializeToString())
    msg = wire.record_to_pb(_record())
    msg.semantics.logprobs_mode = "raw"
    with pytest.raises(wire.WireError, match="processed"):
        wire.decode_record(msg.SerializeToString())
    msg = wire.record_to_pb(_record())
    msg.schema_version = 99
    with pytest.raises(wire.WireError, match="schema_version"):
        wire.decode_record(msg.SerializeToString())


@pytest.mark.parametrize(
    ("multi_turn", "field", "message"),
    [
        (False, "completion_token_ids", "completion_token_ids: 16 bytes, expected 20 for shape (5,)"),
        (False, "sampled_logprobs", "sampled_logprobs: 16 bytes, expected 20 for shape (5,)"),
        (False, "sampled_ranks", "sampled_ranks: 16 bytes, expected 20 for shape (5,)"),
        (False, "topk_ids", "topk_ids: 56 bytes, expected 60 for shape (5, 3)"),
        (False, "topk_logprobs", "topk_logprobs: 56 bytes, expected 60 for shape (5, 3)"),
        (False, "prompt_token_ids", "prompt_token_ids is not a whole number of int32"),
        (True, "completion_token_ids", "completion_token_ids: 16 bytes, expected 20 for shape (5,)"),
        (True, "sampled_ranks", "sampled_ranks: 8 bytes, expected 12 for shape (3,)"),  # 3 sampled rows
        (True, "topk_logprobs", "topk_logprobs: 32 bytes, expected 36 for shape (3, 3)"),
    ],
)
def test_an_array_one_value_short_is_refused_by_name_and_byte_count(multi_turn, field, message) -> None:
    # 4 bytes short (prompt_token_ids: 1 byte short); the decoder reads single-turn records' arrays
    # without the multi-turn scatter, and both say the same for the same bytes
    msg = wire.record_to_pb(_multi_turn_record() if multi_turn else _record())
    value = getattr(msg, field)
    setattr(msg, field, value[:-1] if field == "prompt_token_ids" else value[:-4])
    with pytest.raises(wire.WireError) as e:
        wire.decode_record(msg.SerializeToString())
    assert str(e.value) == message


def test_the_first_broken_rule_is_the_one_reported() -> None:
    msg = wire.record_to_pb(_record())
    msg.finish_reason = 0  # unspecified
    msg.semantics.logprobs_mode = "raw"
    msg.topk_ids = msg.topk_ids[:-4]
    with pytest.raises(wire.WireError, match=r"^finish_reason 0 is not a finished state$"):
        wire.decode_record(msg.SerializeToString())
    msg = wire.record_to_pb(_record())
    msg.prompt_token_ids += b"\x01"
    msg.sampled_ranks = b""
    with pytest.raises(wire.WireError, match=r"^prompt_token_ids is not a whole number of int32$"):
        wire.decode_record(msg.SerializeToString())


def test_decoded_arrays_are_native_copies_and_records_share_one_semantics() -> None:
    a, b = _record(), _record(seed=1)
    da, db = wire.decode_record(wire.encode_record(a)), wire.decode_record(wire.encode_record(b))
    for name in ("prompt_ids", "completion_ids", "sampled_logprobs", "sampled_ranks"):
        x = getattr(da, name)
        assert x.flags.owndata and x.flags.writeable and x.dtype.isnative, name
        np.testing.assert_array_equal(x, getattr(a, name))
    da.completion_ids[0] = 7  # a copy: its payload and the other record are untouched
    assert da.completion_ids[0] == 7 and db.completion_ids[0] == b.completion_ids[0]
    # Semantics is frozen: records of equal semantics share one object, of other semantics not
    assert da.semantics == a.semantics and da.semantics is db.semantics
    c = _record()
    c.semantics = Semantics(temperature=0.7, top_p=0.9, top_k=40, logprobs_k=3, engine="torch", model="n")
    assert wire.decode_record(wire.encode_record(c)).semantics.model == "n"
    # -0.0 == 0.0, but a record of temperature -0.0 does not come back as 0.0 (nor the reverse)
    for t in (-0.0, 0.0, -0.0):
        c.semantics = Semantics(temperature=t, logprobs_k=3)
        back = wire.decode_record(wire.encode_record(c))
        assert str(back.semantics.temperature) == str(t)
        assert back.problems() == [
            f"semantics.temperature must be finite and > 0, got {t} (there is no greedy mode: the "
            "record's logprobs must describe a distribution)"
        ]


def test_chunks_reassemble_to_the_record() -> None:
    rec = _record(t=6)
    asm = RecordAssembler()
    bounds = [(0, 2), (2, 3), (3, 6)]
    out = None
    for i, (lo, hi) in enumerate(bounds):
        chunk = RolloutChunk(
            request_id=rec.request_id,
            sample_index=rec.sample_index,
            start_index=lo,
            token_ids=rec.completion_ids[lo:hi],
            sampled_logprobs=rec.sampled_logprobs[lo:hi],
            sampled_ranks=rec.sampled_ranks[lo:hi],
            topk_ids=rec.topk_ids[lo:hi],
            topk_logprobs=rec.topk_logprobs[lo:hi],
            policy_version=3,
            record=rec if i == len(bounds) - 1 else None,
        )
        out = asm.add(wire.chunk_from_pb(wire.chunk_to_pb(chunk)))
    assert out is not None
    _assert_same(rec, out)


def test_chunk_gap_is_detected() -> None:
    rec = _record(t=4)
    asm = RecordAssembler()
    chunk = RolloutChunk(
        "req",
        0,
        1,
        rec.completion_ids[:1],
        rec.sampled_logprobs[:1],
        rec.sampled_ranks[:1],
        rec.topk_ids[:1],
        rec.topk_logprobs[:1],
        0,
    )
    with pytest.raises(ValueError, match="expected 0"):
        asm.add(chunk)


def test_a_chunk_whose_k_is_not_its_records_is_refused() -> None:
    rec = _record(t=4, k=3)
    assert rec.logprobs_k == rec.semantics.logprobs_k == 3

    def chunk(lo: int, hi: int, k: int, record=None) -> RolloutChunk:
        return RolloutChunk(
            "req", rec.sample_index, lo, rec.completion_ids[lo:hi], rec.sampled_logprobs[lo:hi],
            rec.sampled_ranks[lo:hi], rec.topk_ids[lo:hi, :k], rec.topk_logprobs[lo:hi, :k], 3, record,
        )  # fmt: skip

    assert chunk(0, 2, 2).logprobs_k == 2
    # on the wire: the last chunk carries the record, whose semantics declare K = 3
    msg = wire.chunk_to_pb(chunk(2, 4, 2, record=rec))
    with pytest.raises(wire.WireError, match="chunk logprobs_k 2 differs from its record's"):
        wire.chunk_from_pb(msg)
    assert wire.chunk_from_pb(wire.chunk_to_pb(chunk(4, 4, 2, record=rec))).record is not None  # no tokens
    # reassembled: an earlier chunk of another K (which no decoder can check alone)
    asm = RecordAssembler()
    assert asm.add(chunk(0, 2, 2)) is None
    with pytest.raises(ValueError, match="a chunk carries K = 2, its record K = 3"):
        asm.add(chunk(2, 4, 3, record=rec))


def test_sampling_options_round_trip_and_defaults() -> None:
    o = SamplingOptions(
        max_tokens=9, temperature=0.5, top_p=0.8, top_k=7, logprobs_k=4, n=3, seed=11, stop_token_ids=(1, 2)
    )
    assert wire.options_from_pb(wire.options_to_pb(o)) == o
    empty = wire.options_from_pb(wire.pb.SamplingOptions(max_tokens=4))
    assert (empty.temperature, empty.top_p, empty.top_k, empty.n, empty.seed) == (1.0, 1.0, 0, 1, None)
    assert SamplingOptions(temperature=0.0).problems() and not o.problems()


def test_server_info_round_trip_carries_the_engine_settings() -> None:
    info = ServerInfo(
        model="/models/m", engine="vllm", engine_version="0.32.0", maskroll_version="0.1.0", policy_version=7,
        max_logprobs_k=20, max_model_len=8192, vocab_size=151936, max_tokens=4096, max_n=64,
        logprobs_mode="processed", replica_id="r-1", max_message_bytes=1 << 24, dtype="bfloat16", seed=5,
        max_batch=256, tensor_parallel_size=4, quantization="fp8", prefix_caching=True, kv_cache_bytes=0,
        gpu_memory_utilization=0.9, kv_cache_tokens=1_234_567,
    )  # fmt: skip
    m = wire.info_to_pb(info)
    assert (m.dtype, m.tensor_parallel_size, m.gpu_memory_utilization, m.kv_cache_tokens) == (
        "bfloat16",
        4,
        0.9,
        1_234_567,
    )
    assert wire.info_from_pb(pb.ServerInfo.FromString(m.SerializeToString())) == info
    # Every ServerInfo field is on the wire under the same name (a new one cannot be forgotten).
    assert set(ServerInfo.__dataclass_fields__) == {f.name for f in pb.ServerInfo.DESCRIPTOR.fields}


def test_run_ids_travel_on_jobs_records_updates_and_info() -> None:
    from maskroll.proto.records import PromptJob

    job = PromptJob("j", np.array([1, 2], np.int32), SamplingOptions(), run_id="run-a")
    assert wire.decode_job(wire.job_to_pb(job).SerializeToString()).run_id == "run-a"
    assert wire.decode_record(wire.encode_record(_record())).run_id == "run-a"
    update = wire.update_from_pb(
        pb.UpdateWeightsRequest.FromString(wire.update_request(3, "/w/v3", "run-a").SerializeToString())
    )
    assert (update.version, update.checkpoint_dir, update.run_id) == (3, "/w/v3", "run-a")
    # a record from a producer older than run ids still decodes, with run id "" (unknown)
    old = wire.record_to_pb(_record())
    old.ClearField("run_id")
    assert wire.decode_record(old.SerializeToString()).run_id == ""


def test_the_lora_adapter_travels_on_records_and_info() -> None:
    """Field 35 (the adapter that sampled the record) through both codecs; GetInfo's LoRA fields."""
    from maskroll.proto.records import AdapterInfo

    rec = _record()
    rec.adapter = "team-b/run-7/v12"
    back = wire.decode_record(wire.encode_record(rec))
    _assert_same(rec, back)
    assert back.adapter == "team-b/run-7/v12"
    assert pb.RolloutRecord.FromString(wire.encode_record(rec)) == wire.record_to_pb(rec)
    assert wire.decode_record(wire.encode_record(_record())).adapter == ""  # full weights: no adapter
    adapters = (
        AdapterInfo("default", "run-a", 3, "default/run-a/v3", 8),
        AdapterInfo("b", "r", 0, "b/r/v0", 64),
    )
    info = ServerInfo(
        model="m", engine="torch", engine_version="1", maskroll_version="0", policy_version=0,
        max_logprobs_k=20, max_model_len=64, vocab_size=259, max_tokens=63, max_n=8,
        logprobs_mode="processed", replica_id="r", max_message_bytes=1 << 24, base_fingerprint="wfp1:ab",
        max_lora_rank=64, max_loras=4, adapters=adapters,
    )  # fmt: skip
    m = pb.ServerInfo.FromString(wire.info_to_pb(info).SerializeToString())
    assert [(a.namespace, a.version, a.rank) for a in m.adapters] == [("default", 3, 8), ("b", 0, 64)]
    assert wire.info_from_pb(m) == info


def test_a_record_with_negative_k_and_no_tokens_is_refused_by_the_decoder() -> None:
    # issue 11: logprobs_k = -1 with num_tokens = 0 passed the byte-count checks and raised ValueError
    msg = wire.record_to_pb(_record(t=0))
    msg.semantics.logprobs_k = -1
    with pytest.raises(wire.WireError, match="logprobs_k -1"):
        wire.decode_record(msg.SerializeToString())


def test_semantic_checks_name_what_is_wrong() -> None:
    assert _record().problems() == []
    cases = {
        "sample_index 2 is not in [0, group_size 2)": {"sample_index": 2},
        "semantics.temperature must be finite and > 0": {
            "semantics": Semantics(temperature=0.0, logprobs_k=3)
        },
        "sampled_ranks holds a rank < 1": {"sampled_ranks": np.zeros(5, np.int32)},
        "sampled_logprobs holds a NaN": {"sampled_logprobs": np.full(5, np.nan, np.float32)},
        "topk_logprobs holds a NaN or a positive value": {"topk_logprobs": np.ones((5, 3), np.float32)},
        "version_changes token indices [7]": {"version_changes": [(7, 4)]},
        "policy_version_last 4 is not the version after the last change (3)": {"version_changes": []},
        "completion_ids holds a negative token id": {"completion_ids": np.full(5, -3, np.int32)},
    }
    for needle, change in cases.items():
        rec = _record()
        for name, value in change.items():
            setattr(rec, name, value)
        problems = rec.problems()
        assert any(needle in p for p in problems), (needle, problems)


def test_policy_versions_are_checked_with_and_without_changes() -> None:
    rec = _record()
    rec.version_changes, rec.policy_version_first, rec.policy_version_last = [], -1, -1
    assert rec.problems() == ["negative policy version in [-1, -1]"]
    rec.policy_version_first = 2
    assert rec.problems() == [
        "negative policy version in [2, -1]",
        "policy_version_last -1 is not the version after the last change (2)",
    ]
    rec.version_changes, rec.policy_version_last = [(3, -2), (2, 5)], 5
    assert rec.problems() == [
        "negative policy version in [2, 5, -2, 5]",
        "version_changes token indices [3, 2] are not increasing within (0, 5)",
    ]
    rec.version_changes, rec.policy_version_last = [], 2
    assert rec.problems() == []


def test_one_bad_value_anywhere_in_an_array_is_caught() -> None:
    # problems() checks with one min / max per array; NaN must not slip through the comparisons
    for name, at, value, needle in [
        ("sampled_logprobs", 3, np.nan, "sampled_logprobs holds a NaN"),
        ("sampled_logprobs", 0, -np.inf, "sampled_logprobs holds a NaN, an infinity"),
        ("sampled_logprobs", 4, 0.5, "or a positive value"),
        ("topk_logprobs", (4, 2), np.nan, "topk_logprobs holds a NaN"),
        ("topk_logprobs", (0, 0), 0.01, "topk_logprobs holds a NaN or a positive value"),
        ("sampled_ranks", 2, 0, "sampled_ranks holds a rank < 1"),
        ("topk_ids", (1, 1), -1, "topk_ids holds a negative token id"),
    ]:
        rec = _record()
        getattr(rec, name)[at] = value
        assert [p for p in rec.problems() if needle in p], (name, value, rec.problems())
    rec = _record()
    rec.topk_logprobs[:, -1] = -np.inf  # a top-K entry of probability 0 is allowed
    assert rec.problems() == []


def _multi_turn_record() -> RolloutRecord:
    rec = _record()
    rec.loss_mask = np.array([1, 1, 0, 0, 1], bool)
    rec.segment_starts, rec.num_turns, rec.schema_version = [2], 2, 2
    for name in ("sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs"):
        getattr(rec, name)[2:4] = 0
    return rec


def _with_teacher(rec: RolloutRecord, kt: int = 4, seed: int = 1) -> RolloutRecord:
    """`rec` scored by a teacher at K_teacher = kt (zero rows where a multi-turn record did not sample)."""
    rng = np.random.default_rng(seed)
    t = rec.num_tokens
    rec.teacher_topk_ids = rng.integers(0, 250, (t, kt)).astype(np.int32)
    rec.teacher_topk_logprobs = -np.sort(rng.random((t, kt)).astype(np.float32), axis=1)
    rec.teacher_sampled_logprobs = -rng.random(t).astype(np.float32)
    for a in (rec.teacher_topk_ids, rec.teacher_topk_logprobs, rec.teacher_sampled_logprobs):
        a[~rec.generated] = 0
    rec.teacher_semantics = Semantics(temperature=1.0, logprobs_k=kt, engine="torch", model="/teachers/t1")
    rec.teacher_policy_version = 7
    return rec


def test_the_teacher_round_trips_with_presence() -> None:
    """A record no teacher scored decodes with no teacher fields (None, not empty arrays); a scored one
    carries the teacher's arrays and semantics bit-exactly, at its own K_teacher (here != K), also with
    zero tokens; inconsistent teacher fields are named."""
    plain = wire.decode_record(wire.encode_record(_record()))
    assert plain.teacher_semantics is None and plain.teacher_topk_ids is None and not plain.has_teacher
    assert not wire.record_to_pb(_record()).HasField("teacher_semantics")
    for t, kt in ((5, 4), (5, 1), (0, 3), (6, 0)):
        rec = _with_teacher(_record(t=t), kt)
        rec.version_changes, rec.policy_version_last = [], 3  # (valid at any T)
        back = wire.decode_record(wire.encode_record(rec))
        _assert_same(rec, back)
        assert back.has_teacher and back.teacher_topk_ids.shape == (t, kt) and back.problems() == []
        assert back.teacher_semantics.model == "/teachers/t1" and back.teacher_policy_version == 7
        assert pb.RolloutRecord.FromString(wire.encode_record(rec)) == wire.record_to_pb(rec)
    # the teacher's arrays without its semantics, or with another K, are refused by the decoder
    msg = wire.record_to_pb(_with_teacher(_record()))
    msg.ClearField("teacher_semantics")
    with pytest.raises(wire.WireError, match="teacher arrays without teacher_semantics"):
        wire.decode_record(msg.SerializeToString())
    msg = wire.record_to_pb(_with_teacher(_record()))
    msg.teacher_semantics.logprobs_k = 3
    with pytest.raises(wire.WireError, match="teacher_topk_ids"):
        wire.decode_record(msg.SerializeToString())
    rec = _with_teacher(_record())
    rec.teacher_sampled_logprobs[1] = np.nan
    assert rec.problems() == ["teacher_sampled_logprobs holds a NaN or a positive value"]
    rec.teacher_sampled_logprobs[1] = -np.inf  # a token the teacher's truncation removed: allowed
    assert rec.problems() == []
    rec.teacher_topk_logprobs = rec.teacher_topk_logprobs[:, :2]
    assert rec.problems() == ["teacher top-K arrays have shapes (5, 4) / (5, 2), expected (5, 4)"]


def _reference_decode(data: bytes) -> RolloutRecord:
    """What decode_record did before it split the arrays out: protobuf parses the whole payload."""
    msg = pb.RolloutRecord()
    try:
        msg.ParseFromString(data)
    except Exception as e:
        raise wire.WireError(str(e)) from e
    return wire.record_from_pb(msg)


def _field(number: int, payload: bytes) -> bytes:
    return varint.encode((number << 3) | 2) + varint.encode(len(payload)) + payload


@pytest.mark.parametrize("teacher", [False, True])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_records_are_the_same_protobuf_message_in_every_layout(multi_turn: bool, teacher: bool) -> None:
    rec = _multi_turn_record() if multi_turn else _record()
    if teacher:
        rec = _with_teacher(rec)
    data = wire.encode_record(rec)
    # encode_record appends the arrays after the header: the same message as a whole-message serialise,
    # so a reader that parses it with protobuf (an older maskroll) reads the same record
    assert pb.RolloutRecord.FromString(data) == wire.record_to_pb(rec)
    arrays = wire.record_to_pb(rec)
    header = wire.record_to_pb(rec, arrays=False).SerializeToString()
    fields = [(n, getattr(arrays, name)) for name, n, _ in wire._RECORD_ARRAYS if getattr(arrays, name)]
    layouts = {
        "encode_record": data,
        "protobuf's field order (records written before)": arrays.SerializeToString(),
        "arrays first, reversed": b"".join(_field(n, v) for n, v in reversed(fields)) + header,
        "unknown fields of every wire type between them": b"".join(
            _field(n, v) + b"\xf8\x07\x01" + b"\x85\x08" + b"abcd" + b"\x81\x08" + bytes(8) for n, v in fields
        )
        + _field(127, b"future")
        + header,
        "an array field twice (the last one counts)": _field(12, b"\x00" * 4) + data,
    }
    for layout, payload in layouts.items():
        back = wire.decode_record(payload)
        _assert_same(rec, back)
        _assert_same(_reference_decode(payload), back)
        for name in (
            "prompt_ids",
            "completion_ids",
            "sampled_logprobs",
            "sampled_ranks",
            "loss_mask",
            "teacher_sampled_logprobs",
        ):
            value = getattr(back, name)  # copied out of the payload: keeping one does not keep it
            assert value is None or (value.flags.writeable and value.flags.owndata), (layout, name)
        if not multi_turn:  # (a multi-turn record's top-K rows are scattered into fresh arrays)
            assert not back.topk_ids.flags.writeable and not back.topk_logprobs.flags.owndata, layout
            if teacher:
                assert not back.teacher_topk_ids.flags.writeable, layout


def test_top_k_arrays_are_aligned_views_of_the_payload_whatever_the_header_length() -> None:
    for extra in range(8):  # every header length modulo 4, twice
        rec = _record(t=9, k=5)
        rec.rollout_id = "r" * (1 + extra)
        data = wire.encode_record(rec)
        back = wire.decode_record(data)
        _assert_same(rec, back)
        for a in (back.topk_ids, back.topk_logprobs):
            assert a.base is not None and not a.flags.writeable and a.flags.aligned, extra
            assert (a.__array_interface__["data"][0] - np.frombuffer(data, np.uint8).ctypes.data) % 4 == 0
        with pytest.raises(ValueError, match="read-only"):
            back.topk_logprobs[0, 0] = 0.0  # a trainer that edits one copies it first
    # a mutable buffer is copied first: changing it afterwards does not change the record
    buf = bytearray(wire.encode_record(_record()))
    back = wire.decode_record(buf)
    buf[:] = bytes(len(buf))
    _assert_same(_record(), back)
    # padded varints are still the smallest field heads that align: 1 to 3 bytes more, each varint <= 5
    for at in range(4):
        head = wire._field_head(13, 80_000, at)
        assert (at + len(head)) % 4 == 0 and len(head) <= 4 + 3
        assert pb.RolloutRecord.FromString(head + bytes(80_000)).topk_logprobs == bytes(80_000)


def test_payloads_the_array_scan_cannot_read_go_to_protobuf() -> None:
    data = wire.encode_record(_record())
    group = b"\xfb\x07\xfc\x07"  # field 127 as an (empty, deprecated) group: protobuf keeps it as unknown
    assert wire._split_arrays(group + data) is None
    _assert_same(_record(), wire.decode_record(group + data))
    for bad in (data[:-1], data + b"\x4a", data + b"\x4a\x05ab", data + b"\x07"):
        with pytest.raises(wire.WireError):
            wire.decode_record(bad)


def _decode_or_refuse(data: bytes) -> None:
    """The contract under fuzzing: a WireError, or a record whose semantic check runs to the end."""
    try:
        rec = wire.decode_record(data)
    except wire.WireError:
        return
    assert isinstance(rec.problems(), list)


FUZZ = settings(max_examples=300, deadline=1000, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_decode_or_are_refused(data: bytes) -> None:
    _decode_or_refuse(data)


_VALID = wire.encode_record(_record(t=4, k=2))


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(0, len(_VALID)),
)
def test_fuzz_mutated_record_bytes_decode_or_are_refused(flips, cut) -> None:
    data = bytearray(_VALID)
    for at, byte in flips:
        data[at] = byte
    data = bytes(data[:cut]) if cut % 3 == 0 else bytes(data)
    _decode_or_refuse(data)
    # and whatever the mutation, the array scan reads the payload as protobuf does
    try:
        expected = _reference_decode(data)
    except wire.WireError:
        with pytest.raises(wire.WireError):
            wire.decode_record(data)
    else:
        _assert_same(expected, wire.decode_record(data))


_INT_FIELDS = ["num_tokens", "sample_index", "group_size", "policy_version_first", "policy_version_last"]


@FUZZ
@given(
    st.sampled_from([*_INT_FIELDS, "semantics.logprobs_k", "semantics.top_k"]),
    st.integers(-(2**31), 2**31 - 1),
    st.sampled_from(["", "x", "\x00"]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(-(2**40), 2**40)), max_size=3),
)
def test_fuzz_mutated_record_fields_decode_or_are_refused(field, value, text, temperature, changes) -> None:
    msg = wire.record_to_pb(_record(t=4, k=2))
    target, name = (msg.semantics, field.split(".")[1]) if "." in field else (msg, field)
    bounds = {"int32": (-(2**31), 2**31 - 1), "uint32": (0, 2**32 - 1)}
    kind = "uint32" if target.DESCRIPTOR.fields_by_name[name].type == 13 else "int32"
    lo, hi = bounds[kind]
    setattr(target, name, min(max(value, lo), hi))
    msg.rollout_id, msg.semantics.temperature = text, temperature
    del msg.version_changes[:]
    msg.version_changes.extend(pb.VersionChange(token_index=i, version=v) for i, v in changes)
    _decode_or_refuse(msg.SerializeToString())


def test_pieces_pack_to_the_bytes_redis_py_sends_for_the_joined_payload() -> None:
    """The publisher's Pieces argument (redis_conn) is framed exactly as redis-py frames encode_record's
    joined bytes, for every array layout, so Redis stores the same value; its arrays go out as views of
    the record's own arrays, not copies; a command without Pieces is packed by redis-py itself."""
    import redis.asyncio as aioredis

    from maskroll.proto.redis_conn import Pieces, connect, sends_pieces

    ours, plain = connect("redis://127.0.0.1:1"), aioredis.Redis.from_url("redis://127.0.0.1:1")
    assert sends_pieces(ours) and not sends_pieces(plain)
    conn, ref = ours.connection_pool.make_connection(), plain.connection_pool.make_connection()
    recs = [_record(t=40, k=5), _multi_turn_record(), _with_teacher(_record(t=9)), _record(t=0)]
    pieces = [Pieces(wire.record_pieces(r)) for r in recs]
    assert [p.nbytes for p in pieces] == [len(wire.encode_record(r)) for r in recs]
    cmds = [("XADD", "rollouts", "*", "r", p) for p in pieces] + [("XLEN", "rollouts")]
    want = [("XADD", "rollouts", "*", "r", wire.encode_record(r)) for r in recs] + [("XLEN", "rollouts")]
    assert b"".join(conn.pack_commands(cmds)) == b"".join(ref.pack_commands(want))
    assert conn.pack_command("CONFIG GET", "maxmemory") == ref.pack_command("CONFIG GET", "maxmemory")
    views = [p for p in pieces[0].pieces if isinstance(p, memoryview)]
    assert len(views) == 5 and np.shares_memory(np.frombuffer(views[3], np.int32), recs[0].topk_ids)
    assert len([p for p in pieces[3].pieces if isinstance(p, memoryview)]) == 0  # zero tokens: no arrays
