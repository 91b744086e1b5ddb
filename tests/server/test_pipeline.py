"""The generation pipeline called directly, as a third front end would: validation before any engine
call, the chunk/record numbers, aborts, early close, engine ids; and on the real TorchEngine, the same
seed gives the pipeline, a Generate call and a pull-mode job the same records, an abort frees the
engine, and the engine's own guard applies the SDK's temperature rule."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
from fake_engine import FakeEngine, scripted_token
from grpc_fixtures import server_config, server_loop, torch_engine, torch_server, wait_until  # noqa: F401

from maskroll.client import RecordAssembler, RolloutClient, SamplingOptions
from maskroll.proto.records import PromptJob, rollout_id_for
from maskroll.proto.sampling import temperature_problem
from maskroll.server.engines.contract import EngineRequest, SamplingParams
from maskroll.server.errors import InvalidArgument
from maskroll.server.generation import validation
from maskroll.server.generation.pipeline import Pipeline
from maskroll.server.pull.jobs import JobRunner
from maskroll.server.pull.puller import JobRejected

ARRAYS = ("completion_ids", "sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs")


def make(fake_model_dir, config: dict | None = None, **engine_kwargs) -> tuple[Pipeline, FakeEngine]:
    engine = FakeEngine(**engine_kwargs)
    config = server_config(fake_model_dir, max_n=4, max_tokens=250, **(config or {}))
    return Pipeline(engine, config), engine


NO_TIMER = {"chunk_interval_ms": 60_000}  # chunks then go only for the reasons other than time


async def collect(gen) -> list:
    async with contextlib.aclosing(gen.stream()) as chunks:
        return [c async for c in chunks]


def test_chunks_and_records_carry_the_scripted_numbers(fake_model_dir):
    pipeline, engine = make(fake_model_dir, NO_TIMER)
    opts = SamplingOptions(max_tokens=5, logprobs_k=3, n=2, seed=4, temperature=0.5, top_k=7)
    gen = pipeline.prepare([3, 4], opts, request_id="r", job_id="j", group_id="g", metadata={"m": "1"})
    assert engine.requests == []  # prepared, not started
    chunks = asyncio.run(collect(gen))
    assert sorted(q.request_id for q in engine.requests) == ["r-0", "r-1"]
    assert sorted(q.params.seed for q in engine.requests) == [4, 5]
    # The fake streams one token per output: the first goes at once, the other four with the record.
    layout = sorted((c.sample_index, c.start_index, len(c.token_ids), c.record is not None) for c in chunks)
    assert layout == [(0, 0, 1, False), (0, 1, 4, True), (1, 0, 1, False), (1, 1, 4, True)]
    records = {c.sample_index: c.record for c in chunks if c.record is not None}
    assembler = RecordAssembler()
    for c in chunks:
        assembled = assembler.add(c) or None
        if assembled is not None:
            for name in ARRAYS:
                np.testing.assert_array_equal(getattr(assembled, name), getattr(c.record, name), err_msg=name)
    for i, rec in records.items():
        tokens = [scripted_token(4 + i, j, 50) for j in range(5)]
        np.testing.assert_array_equal(rec.completion_ids, tokens)
        np.testing.assert_array_equal(rec.sampled_logprobs, np.float32(-(np.arange(5) + 1) / 7.0))
        np.testing.assert_array_equal(rec.sampled_ranks, [1, 2, 3, 1, 2])
        np.testing.assert_array_equal(rec.topk_ids[:, 0], tokens)
        np.testing.assert_array_equal(rec.topk_ids[1], [(tokens[1] + d) % 50 for d in range(3)])
        np.testing.assert_array_equal(rec.topk_logprobs[2], np.float32(-3 / 7.0) - np.float32([0, 1, 2]) / 3)
        assert rec.rollout_id == rollout_id_for("j", i) and rec.sample_index == i
        assert (rec.request_id, rec.job_id, rec.group_id, rec.metadata) == ("r", "j", "g", {"m": "1"})
        assert (rec.finish_reason, rec.group_size, rec.replica_id) == ("length", 2, "test-replica")
        assert (rec.policy_version_first, rec.policy_version_last, rec.version_changes) == (0, 0, [])
        np.testing.assert_array_equal(rec.prompt_ids, [3, 4])
        assert rec.prompt_ids.dtype == np.int32
    s = gen.header.semantics
    assert (s.temperature, s.top_p, s.top_k, s.logprobs_k, s.engine, s.model) == (
        0.5,
        1.0,
        7,
        3,
        "fake",
        "fake-model",
    )


@pytest.mark.parametrize(
    ("prompt", "options", "ids", "message"),
    [
        ([1], dict(temperature=0.0), {}, "options.temperature must be finite and > 0, got 0.0"),
        ([1], dict(n=5), {}, "options.n must be in [1, 4] (0 means 1), got 5"),
        ([1], dict(max_tokens=251), {}, "options.max_tokens = 251 exceeds the server's limit 250"),
        ([1], dict(stop_token_ids=(50,)), {}, "options.stop_token_ids[0] = 50 is outside the vocabulary"),
        ([1, 50], {}, {}, "prompt_token_ids[1] = 50 is outside the vocabulary [0, 50)"),
        ([], {}, {}, "prompt_token_ids is empty"),
        (np.array([1.0, 2.0]), {}, {}, "prompt_token_ids must be a 1-D array of token ids, got float64 (2,)"),
        ([1], {}, dict(group_id="a\nb"), "group_id 'a\\nb' contains non-printable characters"),
        # a pull-mode job's id is also its request id: a bad one is named as job_id
        ([1], {}, dict(request_id="x" * 300, job_id="x" * 300), "job_id has 300 characters; at most 256"),
    ],
)
def test_invalid_requests_raise_before_any_engine_call(fake_model_dir, prompt, options, ids, message):
    pipeline, engine = make(fake_model_dir)
    with pytest.raises(InvalidArgument) as err:
        pipeline.prepare(prompt, SamplingOptions(**{"max_tokens": 3, **options}), **ids)
    assert str(err.value).startswith(message), str(err.value)
    assert engine.requests == [] and engine.aborted == []


def test_a_checked_request_is_not_validated_again_and_sample_i_alone_is_sample_i(fake_model_dir, monkeypatch):
    # The HTTP front end's path: one check for all n choices, then each choice as a request of its own.
    pipeline, engine = make(fake_model_dir, NO_TIMER)
    checked = pipeline.check(
        np.array([3, 4], np.int64), SamplingOptions(max_tokens=4, n=3, seed=7, logprobs_k=2)
    )
    assert checked.prompt_ids.dtype == np.int32 and checked.n == 3 and checked.params.seed == 7
    monkeypatch.setattr(validation, "sampling_params", None)  # prepare_checked must not ask again
    together = asyncio.run(pipeline.prepare_checked(checked, request_id="all").records())
    alone = [
        asyncio.run(pipeline.prepare_checked(checked.sample(i), request_id=f"one{i}").records())[0]
        for i in range(3)
    ]
    for i, rec in enumerate(alone):
        assert (rec.group_size, rec.sample_index) == (1, 0)
        np.testing.assert_array_equal(rec.completion_ids, together[i].completion_ids)
        np.testing.assert_array_equal(rec.completion_ids, [scripted_token(7 + i, j, 50) for j in range(4)])
    assert [q.params.seed for q in engine.requests[3:]] == [7, 8, 9]
    # another K for one sample (an HTTP session records the replica's): in the params and the semantics
    gen = pipeline.prepare_checked(checked.sample(1, logprobs_k=5))
    assert gen.params.logprobs_k == gen.logprobs_k == gen.header.semantics.logprobs_k == 5
    assert asyncio.run(gen.records())[0].logprobs_k == 5
    # ids and metadata are still checked
    with pytest.raises(InvalidArgument, match="group_id"):
        pipeline.prepare_checked(checked, group_id="a\nb")


def test_abort_mid_stream_ends_every_sample_with_an_abort_record(fake_model_dir):
    pipeline, engine = make(fake_model_dir, NO_TIMER, token_delay_s=0.01)
    gen = pipeline.prepare([1], SamplingOptions(max_tokens=200, n=2, seed=0, logprobs_k=2))

    async def main():
        chunks = []
        async with contextlib.aclosing(gen.stream()) as stream:
            async for c in stream:
                chunks.append(c)
                if len(chunks) == 2:  # both first tokens; let the samples hold a few more, then abort
                    await asyncio.sleep(0.05)
                    gen.abort()
        return chunks

    chunks = asyncio.run(main())
    records = {c.sample_index: c.record for c in chunks if c.record is not None}
    assert sorted(records) == [0, 1]
    assert sorted(engine.aborted) == [f"{gen.request_id}-0", f"{gen.request_id}-1"] and not engine.active
    for i, rec in records.items():
        streamed = [int(t) for c in chunks if c.sample_index == i for t in c.token_ids]
        assert rec.finish_reason == "abort" and 0 < rec.num_tokens == len(streamed) < 200
        np.testing.assert_array_equal(
            rec.completion_ids, [scripted_token(i, j, 50) for j in range(len(streamed))]
        )
        np.testing.assert_array_equal(rec.completion_ids, streamed)
        # The tokens held when the abort came go out in the last chunk, with the record.
        first, last = [c for c in chunks if c.sample_index == i]
        assert (len(first.token_ids), last.start_index) == (1, 1)
        assert len(last.token_ids) == rec.num_tokens - 1 > 0 and last.topk_ids.shape == (
            rec.num_tokens - 1,
            2,
        )
        assert last.policy_version == 0


class VersionBumpEngine(FakeEngine):
    """Loads version 1 right after the third token of a request."""

    async def generate(self, request):
        made = 0
        async for out in super().generate(request):
            yield out
            made += 1
            if made == 3:
                self._version = 1


def test_chunks_go_at_once_for_the_first_tokens_a_full_chunk_a_new_version_and_the_end(fake_model_dir):
    pipeline, _ = make(fake_model_dir, {**NO_TIMER, "chunk_max_tokens": 3})
    chunks = asyncio.run(collect(pipeline.prepare([1], SamplingOptions(max_tokens=10, seed=3))))
    assert [(c.start_index, len(c.token_ids), c.record is not None) for c in chunks] == [
        (0, 1, False),  # the first token, at once
        (1, 3, False),  # full
        (4, 3, False),
        (7, 3, True),  # full and the last
    ]
    np.testing.assert_array_equal(
        np.concatenate([c.token_ids for c in chunks]), [scripted_token(3, j, 50) for j in range(10)]
    )

    engine = VersionBumpEngine()
    pipeline = Pipeline(engine, server_config(fake_model_dir, **NO_TIMER))
    chunks = asyncio.run(collect(pipeline.prepare([1], SamplingOptions(max_tokens=6, seed=3))))
    # tokens 0-2 under version 0, 3-5 under version 1: a chunk never spans two versions
    assert [(c.start_index, len(c.token_ids), c.policy_version) for c in chunks] == [
        (0, 1, 0),
        (1, 2, 0),
        (3, 3, 1),
    ]
    rec = chunks[-1].record
    assert (rec.policy_version_first, rec.policy_version_last, rec.version_changes) == (0, 1, [(3, 1)])


def test_interval_zero_streams_every_engine_output_as_its_own_chunk(fake_model_dir):
    pipeline, _ = make(fake_model_dir, {"chunk_interval_ms": 0})
    chunks = asyncio.run(collect(pipeline.prepare([1], SamplingOptions(max_tokens=6, n=2))))
    assert sorted((c.sample_index, c.start_index, len(c.token_ids)) for c in chunks) == [
        (i, j, 1) for i in range(2) for j in range(6)
    ]


def test_held_tokens_wait_at_most_the_interval(fake_model_dir):
    # A token every 20 ms, a 50 ms bound: a chunk after the first holds tokens that came within 50 ms
    # of its first one, so at most 3, however late the loop runs (the timer is due before the next
    # token's own sleep ends).
    pipeline, _ = make(fake_model_dir, {"chunk_interval_ms": 50}, token_delay_s=0.02)
    chunks = asyncio.run(collect(pipeline.prepare([1], SamplingOptions(max_tokens=15, seed=1))))
    sizes = [len(c.token_ids) for c in chunks]
    assert sum(sizes) == 15 and sizes[0] == 1 and max(sizes[1:]) <= 3, sizes
    assert len(chunks) < 15  # gathered: 1 + about 15 / 2.5 chunks
    np.testing.assert_array_equal(
        chunks[-1].record.completion_ids, np.concatenate([c.token_ids for c in chunks])
    )


def test_records_build_no_chunk(fake_model_dir, monkeypatch):
    import maskroll.server.generation.records_builder as rb

    def refuse(*args, **kwargs):
        raise AssertionError("a chunk was built for a caller that streams none")

    monkeypatch.setattr(rb.SampleBuilder, "take_chunk", refuse)
    pipeline, _ = make(fake_model_dir)
    records = asyncio.run(pipeline.prepare([1], SamplingOptions(max_tokens=7, n=2, seed=5)).records())
    assert [r.num_tokens for r in records] == [7, 7]
    np.testing.assert_array_equal(records[1].completion_ids, [scripted_token(6, j, 50) for j in range(7)])


def test_chunks_stay_under_half_the_largest_message():
    from maskroll.server.generation.pipeline import Coalescing

    rule = Coalescing(0.05, max_tokens=64, message_bytes=1 << 20)
    # 12 + 8 K bytes a token: K = 20 -> 172 B, 64 tokens fit; K = 4096 -> 32780 B, 15 fit in 512 KiB
    assert [rule.tokens_per_chunk(k) for k in (0, 20, 4096)] == [64, 64, 15]
    assert Coalescing(0.05, 64, 64 * 1024).tokens_per_chunk(4096) == 1


def test_abort_before_the_stream_starts_gives_empty_abort_records(fake_model_dir):
    pipeline, engine = make(fake_model_dir)
    engine._version = 3
    gen = pipeline.prepare([1], SamplingOptions(max_tokens=5, n=3))
    gen.abort()
    records = asyncio.run(gen.records())
    assert [r.finish_reason for r in records] == ["abort"] * 3
    assert [r.num_tokens for r in records] == [0, 0, 0]
    assert [(r.policy_version_first, r.policy_version_last) for r in records] == [(3, 3)] * 3
    assert [r.sample_index for r in records] == [0, 1, 2]


def test_engine_ending_a_stream_without_finish_reason_is_an_abort_record(fake_model_dir):
    pipeline, engine = make(fake_model_dir)
    engine.end_without_finish = True
    (rec,) = asyncio.run(pipeline.prepare([1], SamplingOptions(max_tokens=3, seed=2)).records())
    assert rec.finish_reason == "abort"
    np.testing.assert_array_equal(rec.completion_ids, [scripted_token(2, j, 50) for j in range(3)])


def test_a_stream_ending_without_finish_reason_streams_every_token_before_its_record(fake_model_dir):
    # A slow reader: the engine stream ends (no finish reason) while tokens are held under a 10 ms timer
    # and the reader sleeps 30 ms. The timer must not emit them behind the end: the abort chunk takes
    # them, and the streamed tokens are exactly the record's.
    pipeline, engine = make(fake_model_dir, {"chunk_interval_ms": 10})
    engine.end_without_finish = True
    gen = pipeline.prepare([1], SamplingOptions(max_tokens=3, seed=2))

    async def read() -> list:
        out = []
        async with contextlib.aclosing(gen.stream()) as chunks:
            async for c in chunks:
                out.append(c)
                await asyncio.sleep(0.03)
        return out

    chunks = asyncio.run(read())
    assert chunks[-1].record is not None and chunks[-1].record.finish_reason == "abort"
    streamed = np.concatenate([c.token_ids for c in chunks])
    np.testing.assert_array_equal(streamed, chunks[-1].record.completion_ids)
    assert len(streamed) == 3


def test_closing_the_stream_early_cancels_every_engine_request(fake_model_dir):
    pipeline, engine = make(fake_model_dir, token_delay_s=0.01)
    gen = pipeline.prepare([1], SamplingOptions(max_tokens=200, n=3), request_id="gone")

    async def main():
        async with contextlib.aclosing(gen.stream()) as stream:
            async for _ in stream:
                break
        # aclosing returned only after the engine saw every cancellation
        return sorted(engine.aborted), set(engine.active)

    assert asyncio.run(main()) == (["gone-0", "gone-1", "gone-2"], set())
    with pytest.raises(RuntimeError, match="already been run"):
        asyncio.run(collect(gen))


def test_engine_ids_request_ids_and_refusals(fake_model_dir):
    pipeline, engine = make(fake_model_dir)
    gen = pipeline.prepare([1], SamplingOptions(max_tokens=1, n=2), job_id="job", engine_id="job.abc")
    assert len(gen.request_id) == 32 and gen.request_id != "job"  # "" → a fresh id
    records = asyncio.run(gen.records())
    assert sorted(q.request_id for q in engine.requests) == ["job.abc-0", "job.abc-1"]
    assert [r.rollout_id for r in records] == [rollout_id_for("job", 0), rollout_id_for("job", 1)]
    engine.refuse = "temperature must be in [1e-05, 2.0] for vLLM, got 3.0"
    with pytest.raises(InvalidArgument, match="the fake engine refused the request: temperature"):
        asyncio.run(pipeline.prepare([1], SamplingOptions(max_tokens=1, temperature=3.0)).records())


def test_job_runner_rejects_invalid_jobs_and_runs_each_attempt_under_its_own_engine_ids(fake_model_dir):
    engine = FakeEngine()
    runner = JobRunner(engine, server_config(fake_model_dir, max_n=4))
    job = PromptJob(
        job_id="j1", prompt_ids=np.array([1], np.int32), options=SamplingOptions(max_tokens=2, n=2)
    )
    first, second = asyncio.run(runner(job)), asyncio.run(runner(job))
    ids = [q.request_id for q in engine.requests]
    assert len(set(ids)) == 4 and all(i.startswith("j1.") for i in ids)
    for a, b in zip(first, second, strict=True):  # a re-run yields duplicates: same rollout ids, same tokens
        assert a.rollout_id == b.rollout_id and (a.request_id, a.group_id) == ("j1", "j1")
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    bad = PromptJob(job_id="j2", prompt_ids=np.array([1], np.int32), options=SamplingOptions(n=5))
    with pytest.raises(JobRejected, match=r"^options\.n must be in \[1, 4\]"):
        asyncio.run(runner(bad))


# ---- the real engine ------------------------------------------------------------------------------

PROMPT = np.array([256, 72, 101, 108, 108, 111], np.int32)  # <bos> "Hello"
OPTS = SamplingOptions(max_tokens=12, logprobs_k=4, n=2, seed=21, temperature=0.9, ignore_eos=True)


def test_same_seed_gives_the_same_records_from_pipeline_generate_and_job(
    torch_server,  # noqa: F811
    torch_engine,  # noqa: F811
    server_loop,  # noqa: F811
    tiny_model_dir,
):
    config = server_config(tiny_model_dir)
    direct = server_loop.run(
        Pipeline(torch_engine, config)
        .prepare(PROMPT, OPTS, request_id="p", job_id="job-7", group_id="g")
        .records()
    )
    job = PromptJob(job_id="job-7", prompt_ids=PROMPT, options=OPTS, group_id="g")
    pulled = server_loop.run(JobRunner(torch_engine, config)(job))

    async def generate():
        async with RolloutClient(torch_server.address) as c:
            return await c.generate_records(PROMPT, OPTS, job_id="job-7", group_id="g")

    served = asyncio.run(generate())
    assert [r.num_tokens for r in direct] == [12, 12]
    assert not np.array_equal(direct[0].completion_ids, direct[1].completion_ids)  # seeds 21 and 22
    for other in (pulled, served):
        for a, b in zip(direct, other, strict=True):
            assert (a.rollout_id, a.sample_index, a.group_id, a.finish_reason) == (
                b.rollout_id,
                b.sample_index,
                b.group_id,
                b.finish_reason,
            )
            assert a.semantics == b.semantics and a.semantics.temperature == 0.9
            v = torch_engine.policy_version
            assert (a.policy_version_first, a.policy_version_last, b.policy_version_first) == (v, v, v)
            # A seed fixes the tokens whatever else shares the batch; logprobs agree to float rounding.
            np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
            np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
            np.testing.assert_allclose(a.sampled_logprobs, b.sampled_logprobs, atol=1e-4)
            np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=1e-4)
            assert a.sampled_logprobs.max() < 0 and np.all(a.sampled_ranks >= 1)


def test_abort_on_the_real_engine_frees_its_requests(torch_engine, server_loop, tiny_model_dir):  # noqa: F811
    gen = Pipeline(torch_engine, server_config(tiny_model_dir)).prepare(
        PROMPT, SamplingOptions(max_tokens=400, logprobs_k=2, n=2, seed=1, ignore_eos=True)
    )

    async def main():
        chunks = []
        async with contextlib.aclosing(gen.stream()) as stream:
            async for c in stream:
                chunks.append(c)
                if sum(len(x.token_ids) for x in chunks) >= 4:
                    gen.abort()
        return chunks

    chunks = server_loop.run(main())
    records = sorted((c.record for c in chunks if c.record is not None), key=lambda r: r.sample_index)
    assert [(r.sample_index, r.finish_reason) for r in records] == [(0, "abort"), (1, "abort")]
    for r in records:
        streamed = np.concatenate([c.token_ids for c in chunks if c.sample_index == r.sample_index])
        np.testing.assert_array_equal(r.completion_ids, streamed)
        assert r.num_tokens < 400
    wait_until(lambda: torch_engine.num_active == 0, what="the engine to free the aborted requests")


def test_the_torch_engine_guard_refuses_a_temperature_by_the_same_rule(torch_engine, server_loop):  # noqa: F811
    # Reachable only past the pipeline (which refuses it first): the engine's own guard.
    bad = EngineRequest("guard-0", PROMPT, SamplingParams(max_tokens=2, temperature=0.0, logprobs_k=1))

    async def first_output():
        async with contextlib.aclosing(torch_engine.generate(bad)) as stream:
            return await stream.__anext__()

    with pytest.raises(ValueError) as err:
        server_loop.run(first_output())
    assert str(err.value) == temperature_problem(0.0)
    assert torch_engine.num_active == 0


def test_push_hands_over_the_chunks_stream_yields_in_the_same_order(fake_model_dir):
    # The same request (same seed) read from stream() and pushed: the same chunks, in the same order, the
    # last of each sample with its record; an abort's last chunks are pushed too.
    def run(how: str, abort_after: int | None = None) -> list:
        pipeline, _ = make(fake_model_dir, NO_TIMER, token_delay_s=0.002)
        opts = SamplingOptions(max_tokens=40, logprobs_k=3, n=2, seed=9)
        gen = pipeline.prepare([3, 4], opts, request_id="r")
        got: list = []

        def send(chunk) -> None:
            got.append(chunk)
            if abort_after is not None and len(got) == abort_after:
                gen.abort()

        if how == "push":
            asyncio.run(gen.push(send))
        else:

            async def read() -> None:
                async with contextlib.aclosing(gen.stream()) as chunks:
                    async for c in chunks:
                        send(c)

            asyncio.run(read())
        return [
            (c.sample_index, c.start_index, c.token_ids.tolist(), c.record and c.record.finish_reason)
            for c in got
        ]

    pushed = run("push")
    assert pushed == run("stream")
    assert sorted((s, r) for s, _, _, r in pushed if r) == [(0, "length"), (1, "length")]
    aborted = run("push", abort_after=2)
    assert sorted((s, r) for s, _, _, r in aborted if r) == [(0, "abort"), (1, "abort")]


def test_a_cancelled_push_sends_no_chunk_while_the_engine_frees_its_requests(fake_model_dir):
    # A GenerateStream request cancelled mid-way: its samples' coalescing timers must not push a chunk
    # into the call while the fan-out waits for the engine to free the requests (here 0.2 s, far past
    # the 20 ms interval); the client has forgotten the request by then.
    class SlowAbort(FakeEngine):
        async def generate(self, request):
            try:
                async for out in super().generate(request):
                    yield out
            finally:
                await asyncio.sleep(0.2)

    config = server_config(fake_model_dir, max_n=4, max_tokens=250, chunk_interval_ms=20)
    pipeline = Pipeline(SlowAbort(token_delay_s=0.002), config)
    gen = pipeline.prepare([3, 4], SamplingOptions(max_tokens=200, logprobs_k=3, n=2, seed=1))

    async def main() -> tuple[int, int, int]:
        sent: list = []
        task = asyncio.create_task(gen.push(sent.append))
        while len(sent) < 2:  # each sample's first chunk
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # tokens held since, under a pending timer
        task.cancel()
        at_cancel, t0 = len(sent), asyncio.get_running_loop().time()
        with pytest.raises(asyncio.CancelledError):
            await task
        return at_cancel, len(sent), asyncio.get_running_loop().time() - t0

    at_cancel, after, waited = asyncio.run(main())
    assert waited >= 0.2 and after == at_cancel
