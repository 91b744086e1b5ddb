"""The wire contract: generated code is fresh, records round-trip bit-exactly, bad bytes are refused —
and no payload whatever makes the decoder raise anything but WireError, or makes a decoded record's
semantic check raise (fuzzed with hypothesis: random bytes, mutated bytes, mutated fields)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maskroll.client import wire
from maskroll.client._proto import rollout_pb2 as pb
from maskroll.client.records import (
    RecordAssembler,
    RolloutChunk,
    RolloutRecord,
    SamplingOptions,
    Semantics,
    ServerInfo,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generated_code_is_not_stale(tmp_path: pathlib.Path) -> None:
    sys.path.insert(0, str(ROOT / "proto"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    fresh = {p.name: p.read_bytes() for p in generate.generate(tmp_path / "out")}
    committed = {p.name: p.read_bytes() for p in (ROOT / "client" / "_proto").iterdir() if p.is_file()}
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
            assert value.dtype == other.dtype and np.array_equal(value, other), name
        else:
            assert value == other, name


def test_record_round_trip_is_exact() -> None:
    rec = _record()
    data = wire.encode_record(rec)
    _assert_same(rec, wire.decode_record(data))
    # packed little-endian arrays: [T, K] float32 costs T*K*4 bytes, not text
    assert len(data) < 7 * 4 + 5 * (4 + 4 + 4) + 5 * 3 * 8 + 200
    assert np.array_equal(_record().token_versions(), [3, 3, 4, 4, 4])


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
    from maskroll.client.records import PromptJob

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
    _decode_or_refuse(bytes(data[:cut]) if cut % 3 == 0 else bytes(data))


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
