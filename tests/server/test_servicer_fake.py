"""The servicer's own logic against the scripted FakeEngine, over a real grpc.aio server on port 0.

Fan-out of n samples, chunk → record reassembly, record fields, stop tokens, version changes, engine
failures, cancellation, duplicate ids, drain and metrics: every byte is predictable here. The same
paths run against the real TorchEngine in test_grpc_server.py.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import numpy as np
import pytest
from fake_engine import scripted_token
from grpc_fixtures import replica, server_config, server_loop, wait_until  # noqa: F401

from maskroll.client import RecordAssembler, RolloutClient, RolloutError, SamplingOptions
from maskroll.proto.records import rollout_id_for


def test_n_samples_fan_out_and_reassemble_to_the_record(fake):
    r, engine = fake(config={"chunk_interval_ms": 60_000})  # chunks go for reasons other than time only
    opts = SamplingOptions(max_tokens=6, logprobs_k=4, n=3, seed=10, temperature=0.7, top_p=0.9, top_k=5)

    async def main():
        async with RolloutClient(r.address) as c:
            chunks = [
                ch
                async for ch in c.generate(
                    [1, 2, 3],
                    opts,
                    request_id="req",
                    job_id="job",
                    group_id="g",
                    metadata={"a": "b"},
                    include_record_arrays=True,
                )
            ]
        return chunks

    t0 = time.time()
    chunks = asyncio.run(main())
    # One token per engine output: each sample's first token goes at once, the other five wait for the
    # last one and go with the record, in one message.
    layout = sorted(
        (ch.sample_index, ch.start_index, len(ch.token_ids), ch.record is not None) for ch in chunks
    )
    assert layout == [
        (i, start, t, last) for i in range(3) for start, t, last in ((0, 1, False), (1, 5, True))
    ]
    assert sorted(req.request_id for req in engine.requests) == ["req-0", "req-1", "req-2"]
    assert sorted(req.params.seed for req in engine.requests) == [10, 11, 12]
    assembler = RecordAssembler()
    records = {}
    for ch in chunks:
        rec = assembler.add(ch)
        if rec is not None:
            records[rec.sample_index] = (rec, ch.record)
    assert sorted(records) == [0, 1, 2]
    for i, (assembled, sent) in records.items():
        expected = [scripted_token(10 + i, j, 50) for j in range(6)]
        np.testing.assert_array_equal(assembled.completion_ids, expected)
        for name in ("completion_ids", "sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs"):
            np.testing.assert_array_equal(getattr(assembled, name), getattr(sent, name), err_msg=name)
        np.testing.assert_array_equal(
            assembled.sampled_logprobs, (-(np.arange(6) + 1) / 7.0).astype(np.float32)
        )
        assert assembled.topk_ids.shape == (6, 4)
        assert sent.rollout_id == rollout_id_for("job", i)
        assert (sent.request_id, sent.job_id, sent.group_id, sent.metadata) == ("req", "job", "g", {"a": "b"})
        assert sent.finish_reason == "length" and sent.replica_id == "test-replica"
        assert t0 <= sent.created_at <= time.time()
        s = sent.semantics
        assert (s.logprobs_mode, s.logprobs_k, s.top_k, s.engine, s.engine_version, s.model) == (
            "processed",
            4,
            5,
            "fake",
            "0.0",
            "fake-model",
        )
        assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
        assert (sent.policy_version_first, sent.policy_version_last, sent.version_changes) == (0, 0, [])
        np.testing.assert_array_equal(sent.prompt_ids, [1, 2, 3])


def test_without_job_id_rollout_ids_derive_from_the_request_id(fake):
    r, _ = fake()

    async def main():
        async with RolloutClient(r.address) as c:
            return await c.generate_records([1], SamplingOptions(max_tokens=2, n=2), request_id="abc")

    recs = asyncio.run(main())
    assert [x.rollout_id for x in recs] == [rollout_id_for("abc", 0), rollout_id_for("abc", 1)]


def test_stop_token_finishes_with_stop_and_is_part_of_the_completion(fake):
    r, _ = fake()
    stop = scripted_token(0, 3, 50)

    async def main():
        async with RolloutClient(r.address) as c:
            return await c.generate_record(
                [1], SamplingOptions(max_tokens=20, seed=0, stop_token_ids=(stop,))
            )

    rec = asyncio.run(main())
    assert rec.finish_reason == "stop" and rec.num_tokens == 4 and rec.completion_ids[-1] == stop


def test_version_change_mid_stream_is_recorded_at_its_token_index(fake, tmp_path):
    (tmp_path / "w" / "v5").mkdir(parents=True)
    (tmp_path / "w" / "v5" / "model.safetensors").write_bytes(b"")
    r, _ = fake(token_delay_s=0.01, config={"weights_root": tmp_path / "w"})

    async def main():
        async with RolloutClient(r.address) as c:
            assembler, versions = RecordAssembler(), []
            async for ch in c.generate([1], SamplingOptions(max_tokens=40, logprobs_k=2)):
                before = len(versions)
                versions += [ch.policy_version] * len(ch.token_ids)
                if before < 5 <= len(versions):  # chunks gather tokens: the one that passes 5
                    await c.update_weights(5, tmp_path / "w" / "v5")
                rec = assembler.add(ch)
            return rec, versions

    rec, versions = asyncio.run(main())
    change = versions.index(5)
    assert 5 <= change < 40
    assert rec.version_changes == [(change, 5)]
    assert (rec.policy_version_first, rec.policy_version_last) == (0, 5)
    np.testing.assert_array_equal(rec.token_versions(), versions)


def test_engine_failure_mid_stream_is_internal_and_the_next_request_is_served(fake):
    r, engine = fake()
    engine.fail_at = 2

    async def main():
        async with RolloutClient(r.address) as c:
            with pytest.raises(RolloutError) as err:
                await c.generate_record([1], SamplingOptions(max_tokens=5))
            engine.fail_at = None
            return err.value, await c.generate_record([1], SamplingOptions(max_tokens=5))

    err, rec = asyncio.run(main())
    assert err.code == grpc.StatusCode.INTERNAL and "scripted engine failure" in err.message
    assert rec.num_tokens == 5


def test_engine_refusal_before_the_first_token_is_invalid_argument(fake):
    r, engine = fake()
    engine.refuse = "temperature must be in [1e-05, 2.0] for vLLM, got 3.0"

    async def main():
        async with RolloutClient(r.address) as c:
            with pytest.raises(RolloutError) as err:
                await c.generate_record([1], SamplingOptions(max_tokens=5, temperature=3.0))
            return err.value

    err = asyncio.run(main())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.message


def test_stream_ending_without_finish_reason_ends_the_sample_with_abort(fake):
    r, engine = fake()
    engine.end_without_finish = True

    async def main():
        async with RolloutClient(r.address) as c:
            return await c.generate_record([1], SamplingOptions(max_tokens=3))

    rec = asyncio.run(main())
    assert rec.finish_reason == "abort" and rec.num_tokens == 3


def test_client_breaking_out_cancels_every_sample_in_the_engine(fake):
    r, engine = fake(token_delay_s=0.01)

    async def main():
        async with RolloutClient(r.address) as c:
            async for _ in c.generate([1], SamplingOptions(max_tokens=200, n=3), request_id="gone"):
                break
            await asyncio.sleep(0)

    asyncio.run(main())
    wait_until(lambda: sorted(engine.aborted) == ["gone-0", "gone-1", "gone-2"], what="engine aborts")
    wait_until(lambda: len(r.core.running) == 0, what="servicer to forget the request")
    assert not engine.active


def test_duplicate_request_id_in_flight_is_already_exists(fake):
    r, _ = fake(token_delay_s=0.01)

    async def main():
        async with RolloutClient(r.address) as c:
            stream = c.generate([1], SamplingOptions(max_tokens=100), request_id="dup")
            await stream.__anext__()
            with pytest.raises(RolloutError) as err:
                await c.generate_record([1], SamplingOptions(max_tokens=1), request_id="dup")
            stream.cancel()
            return err.value

    assert asyncio.run(main()).code == grpc.StatusCode.ALREADY_EXISTS


def test_drain_aborts_unfinished_samples_with_records_and_refuses_new_work(fake, server_loop):  # noqa: F811
    r, engine = fake(token_delay_s=0.01)

    async def main():
        async with RolloutClient(r.address) as c:
            assembler, records = RecordAssembler(), []
            stream = c.generate([1], SamplingOptions(max_tokens=200, n=2))
            first = await stream.__anext__()
            assembler.add(first)
            drain = asyncio.get_running_loop().run_in_executor(None, server_loop.run, r.drain(0.2))
            async for ch in stream:
                rec = assembler.add(ch)
                if rec is not None:
                    records.append(rec)
            await drain
            return records

    records = asyncio.run(main())
    assert sorted(rec.sample_index for rec in records) == [0, 1]
    assert all(rec.finish_reason == "abort" and 0 < rec.num_tokens < 200 for rec in records)
    assert sorted(engine.aborted) == sorted(req.request_id for req in engine.requests)
    assert len(r.core.running) == 0


def test_drain_lets_short_requests_finish_while_health_reads_not_serving(fake, server_loop):  # noqa: F811
    r, _ = fake(token_delay_s=0.01)

    async def main():
        async with RolloutClient(r.address) as c:
            stream = c.generate([1], SamplingOptions(max_tokens=30))
            assembler = RecordAssembler()
            assembler.add(await stream.__anext__())
            drain = asyncio.get_running_loop().run_in_executor(None, server_loop.run, r.drain(10.0))
            await asyncio.sleep(0.05)
            health = await c.health(), await c.health("maskroll.v1.RolloutService")
            rec = None
            async for ch in stream:
                rec = assembler.add(ch) or rec
            await drain
            return rec, health

    rec, health = asyncio.run(main())
    assert rec.finish_reason == "length" and rec.num_tokens == 30
    assert health == ("NOT_SERVING", "NOT_SERVING")


def test_generate_during_drain_is_unavailable(fake):
    r, _ = fake()
    r.core.running.begin_drain()

    async def main():
        async with RolloutClient(r.address) as c:
            with pytest.raises(RolloutError) as err:
                await c.generate_record([1], SamplingOptions(max_tokens=2))
            return err.value

    assert asyncio.run(main()).code == grpc.StatusCode.UNAVAILABLE


def test_metrics_count_tokens_requests_k_and_serve_http(fake):
    r, _ = fake(config={"metrics_port": 0})

    async def main():
        async with RolloutClient(r.address) as c:
            await c.generate_records([1], SamplingOptions(max_tokens=7, n=2, logprobs_k=3))
            with pytest.raises(RolloutError):
                await c.generate_record([], SamplingOptions(max_tokens=7))

    asyncio.run(main())
    reg = r.metrics.registry
    # the server finishes its bookkeeping of a call just after the client has its answer
    wait_until(
        lambda: reg.get_sample_value("maskroll_request_seconds_count", {"method": "Generate"}) == 2,
        what="both Generate calls to be recorded",
    )
    assert reg.get_sample_value("maskroll_generated_tokens_total") == 14
    assert reg.get_sample_value("maskroll_requests_total", {"method": "Generate", "code": "OK"}) == 1
    assert (
        reg.get_sample_value("maskroll_requests_total", {"method": "Generate", "code": "INVALID_ARGUMENT"})
        == 1
    )
    assert reg.get_sample_value("maskroll_logprobs_k_sum") == 3
    assert reg.get_sample_value("maskroll_time_to_first_token_seconds_count") == 1
    assert reg.get_sample_value("maskroll_generate_in_flight") == 0
    assert reg.get_sample_value("maskroll_request_seconds_count", {"method": "Generate"}) == 2
    body = urllib.request.urlopen(f"http://127.0.0.1:{r.metrics_port}/metrics", timeout=5).read().decode()
    assert "maskroll_generated_tokens_total 14.0" in body
    assert "maskroll_policy_version 0.0" in body


def test_get_info_reports_the_narrower_of_engine_and_config_limits(fake):
    r, _ = fake(max_logprobs=10, config={"max_logprobs": 5, "max_n": 3, "max_tokens": 100})

    async def main():
        async with RolloutClient(r.address) as c:
            return await c.info()

    info = asyncio.run(main())
    assert (info.engine, info.engine_version, info.model, info.replica_id) == (
        "fake",
        "0.0",
        "fake-model",
        "test-replica",
    )
    assert (info.max_logprobs_k, info.max_n, info.max_tokens, info.vocab_size, info.max_model_len) == (
        5,
        3,
        100,
        50,
        256,
    )
    assert info.logprobs_mode == "processed" and info.policy_version == 0
    assert info.max_message_bytes == 16 * 1024 * 1024


def test_an_update_whose_caller_gives_up_still_completes(fake, tmp_path):
    (tmp_path / "w" / "v3").mkdir(parents=True)
    (tmp_path / "w" / "v3" / "model.safetensors").write_bytes(b"")
    r, engine = fake(config={"weights_root": tmp_path / "w"})
    engine.update_delay_s = 0.5

    async def main():
        async with RolloutClient(r.address) as c:
            with pytest.raises(RolloutError) as err:
                await c.update_weights(3, tmp_path / "w" / "v3", timeout=0.1)
            return err.value

    assert asyncio.run(main()).code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: engine.policy_version == 3, timeout=5, what="the orphaned update to finish")
