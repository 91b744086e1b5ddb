"""The teacher stage against a real Redis and real torch-engine replicas: two teacher replicas (another
model of the student's tokenizer) and a student replica registered in the namespace. Records scored by
the stage carry exactly what `Score` returns for them; a `maskroll teacher` process SIGKILLed mid-batch
leaves, after a restart, every record published exactly once; a teacher whose vocabulary is not the
student's is refused by name at start-up; collate builds the teacher tensors and distill_loss runs on
them (its sampled-token KL checked against a hand computation)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from test_stage import HERE, feed, freeze_mid_batch, record, wait_for

from maskroll.client.rollout_client import RolloutClient
from maskroll.local.replica import LocalReplica
from maskroll.proto import wire
from maskroll.proto.redis_conn import open_redis
from maskroll.proto.scoring import ScoreOptions
from maskroll.proto.streams import F_RECORD, TEACHER_GROUP, StreamKeys
from maskroll.proto.tokenizer_fingerprint import fingerprint_tokenizer_json, vocab_fingerprint
from maskroll.stages.config import TeacherStageConfig
from maskroll.stages.run import make_teacher_worker
from maskroll.stages.teacher import tokenizer_fingerprint, vocabulary_problems
from maskroll.trainer_adapter import collate
from maskroll.trainer_adapter.distill import distill_loss, student_logprobs

pytestmark = pytest.mark.slow

NS = "teacher-tests"  # the student replica registers here; each test clears the streams it uses
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
K_T = 4


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("teacher") / "tiny-teacher", seed=1)


@pytest.fixture(scope="module")
def fleet(redis_server, model_dir, teacher_dir):
    """(student, [teacher a, teacher b]): started together, stopped by the objects that started them."""
    base = ["--engine", "torch", "--port", "0", "--threads", "1", "--drain-timeout-s", "2"]
    env = {**ENV, "MASKROLL_REDIS_URL": redis_server.url}
    student = LocalReplica(
        ["--model", model_dir, *base, "--namespace", NS, "--pull", "--replica-id", "student"],
        env=env,
        name="student",
    )
    teachers = [
        LocalReplica(["--model", teacher_dir, *base, "--metrics-port", "0"], env=ENV, name=f"teacher {c}")
        for c in "ab"
    ]
    reps = [student, *teachers]
    try:
        for rep in reps:
            rep.start()
        for rep in reps:
            rep.wait_ready()
        yield student, teachers
    finally:
        for rep in reps:
            rep.stop()


async def _clear(r, keys: StreamKeys) -> None:
    part = keys.part(0)
    await r.delete(part.finished, part.rollouts, part.scored, part.dead_letters)


def _records(model_dir, tag: str, jobs: int, n: int = 4):
    return [
        record(model_dir, f"{tag}{j}", i, n, text=b"ab" * (i + 1) + b"c")
        for j in range(jobs)
        for i in range(n)
    ]


def test_vocabulary_problems_name_the_teacher(model_dir, teacher_dir, tmp_path):
    """What is compared: GetInfo's vocab_size, then the id → token maps of local tokenizers."""
    from maskroll.proto.records import ServerInfo

    info = dict(engine="torch", engine_version="", maskroll_version="", policy_version=0, max_logprobs_k=20)
    info |= dict(max_model_len=1024, max_tokens=64, max_n=8, logprobs_mode="processed", replica_id="")
    info |= dict(max_message_bytes=1)
    student = ServerInfo(model=str(model_dir), vocab_size=260, **info)
    same = ServerInfo(model=str(teacher_dir), vocab_size=260, **info)
    assert tokenizer_fingerprint(model_dir) == tokenizer_fingerprint(teacher_dir)  # one tokenizer, 2 models
    assert vocabulary_problems(student, {"t:1": same}) == ([], [])
    bigger = dataclasses.replace(same, vocab_size=261)
    problems, _ = vocabulary_problems(student, {"t:1": same, "t:2": bigger})
    assert problems == [f"teacher t:2 ({teacher_dir}) has vocab_size 261, the student ({model_dir}) 260"]
    other = _other_tokenizer(teacher_dir, tmp_path / "other")
    problems, _ = vocabulary_problems(student, {"t:3": dataclasses.replace(same, model=str(other))})
    assert len(problems) == 1 and problems[0].startswith(f"teacher t:3 ({other}) has another tokenizer")
    remote = dataclasses.replace(same, model="org/remote-model")  # neither local nor reported: said so
    assert vocabulary_problems(student, {"t:4": remote}) == (
        [],
        ["teacher t:4's tokenizer (org/remote-model) has no fingerprint: not in GetInfo, not local"],
    )
    # a teacher whose tokenizer is not local is compared by the fingerprint its replica reports
    mine, theirs = tokenizer_fingerprint(model_dir), tokenizer_fingerprint(other)
    assert mine.startswith("tok1:") and theirs.startswith("tok1:") and mine != theirs
    reported = dataclasses.replace(remote, tokenizer_fingerprint=mine)
    assert vocabulary_problems(student, {"t:5": reported}) == ([], [])
    reported = dataclasses.replace(remote, tokenizer_fingerprint=theirs)
    problems, _ = vocabulary_problems(student, {"t:6": reported})
    assert problems == [
        "teacher t:6 (org/remote-model) has another tokenizer than the student "
        f"({model_dir}): same vocab_size 260, but its id → token map differs ({theirs} != {mine})"
    ]
    # and so is a remote student's, when the stage has no --tokenizer
    remote_student = dataclasses.replace(student, model="org/student", tokenizer_fingerprint=theirs)
    problems, _ = vocabulary_problems(remote_student, {"t:7": same})
    assert len(problems) == 1 and problems[0].startswith("teacher t:7 (") and "(org/student)" in problems[0]
    # the fingerprint is of the id → token map: transformers' get_vocab() of the same tokenizer agrees
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert vocab_fingerprint(tok.get_vocab()) == mine


def _other_tokenizer(src, dst):
    """A copy of `src` whose tokenizer gives two ids each other's token (same size, another map)."""
    shutil.copytree(src, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return dst


def test_records_carry_exactly_what_score_returns_and_train(redis_server, fleet, model_dir, teacher_dir):
    _, (ta, tb) = fleet
    cfg = TeacherStageConfig(
        redis_url=redis_server.url,
        namespace=NS,
        teacher=f"{ta.address},{tb.address}",
        teacher_k=K_T,
        teacher_temperature=0.8,
        timeout_s=20,
        claim_idle_s=30,
        student_wait_s=30,
    )
    recs = _records(model_dir, "exact", 3)
    mt = recs[0]  # and a multi-turn record: the teacher's rows are kept where the model sampled
    mt.loss_mask = np.array([1, 1, 0, 1, 1, 1, 1][: mt.num_tokens], bool)
    mt.schema_version, mt.num_turns = 2, 2

    async def main():
        r, cluster = await open_redis(redis_server.url)
        keys = StreamKeys(NS, 1, cluster)
        await _clear(r, keys)
        w = await make_teacher_worker(r, keys, cfg, "exact-worker")
        await w.start()
        run = asyncio.create_task(w.run())
        try:
            await feed(r, keys, recs)
            await feed(r, keys, recs[:2])  # duplicates: published once
            out = await wait_for(lambda: _at_least(r, keys, len(recs)), timeout=120)
            await wait_for(lambda: _when_zero(r.xlen(keys.part(0).finished)), timeout=60)
            beat = w.heartbeat()
        finally:
            w.stop()
            await asyncio.wait_for(run, 10)
            w.scorer.close()
            await w.scorer.pool.close()
        got = [wire.decode_record(f[F_RECORD]) for _, f in await r.xrange(keys.rollouts)]
        assert sorted(x.rollout_id for x in got) == sorted(x.rollout_id for x in recs) and len(out) >= len(
            recs
        )
        assert beat["stage"] == "teacher" and beat["scored"] == len(recs) and beat["duplicates"] == 2
        # calls go round robin (a group's records in one call); every record scored, duplicates too
        assert set(w.scorer.scored_by) == {ta.address, tb.address}
        assert sum(w.scorer.scored_by.values()) == len(recs) + 2
        async with RolloutClient(ta.address) as c:
            for rec in got:
                ref = await c.score(
                    rec.prompt_ids, [rec.completion_ids], ScoreOptions(logprobs_k=K_T, temperature=0.8)
                )
                s = ref.completions[0]
                keep = rec.generated
                assert rec.teacher_semantics == ref.semantics and rec.teacher_semantics.model == str(
                    teacher_dir
                )
                assert rec.teacher_semantics.logprobs_k == K_T and rec.teacher_semantics.temperature == 0.8
                np.testing.assert_array_equal(rec.teacher_topk_ids[keep], s.topk_ids[keep])
                np.testing.assert_allclose(
                    rec.teacher_topk_logprobs[keep], s.topk_logprobs[keep], rtol=0, atol=1e-6
                )
                np.testing.assert_allclose(
                    rec.teacher_sampled_logprobs[keep], s.logprobs[keep], rtol=0, atol=1e-6
                )
                assert not rec.teacher_topk_ids[~keep].any() and rec.problems() == []
        await r.aclose()
        return got

    got = asyncio.run(main())
    _distill_on(got, model_dir)


def _distill_on(records, model_dir) -> None:
    """collate's teacher tensors feed distill_loss; its sampled-token KL is the hand-computed one."""
    import transformers

    recs = sorted(records, key=lambda x: x.rollout_id)
    b = collate(recs, rewards=np.zeros(len(recs)))
    assert b.teacher_topk_ids.shape == (len(recs), b.completion_ids.shape[1], K_T)
    for i, rec in enumerate(recs):  # row i is record i (no edited history here)
        t = rec.num_tokens
        np.testing.assert_array_equal(b.teacher_topk_ids[i, :t].numpy(), rec.teacher_topk_ids)
        np.testing.assert_array_equal(b.teacher_sampled_logprobs[i, :t].numpy(), rec.teacher_sampled_logprobs)
        assert not b.teacher_topk_logprobs[i, t:].any()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(
        input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids
    ).logits[:, b.completion_logits_slice]
    s = student_logprobs(logits, b.completion_ids, b.teacher_topk_ids, temperature=b.temperature)
    loss, m = distill_loss(
        s,
        b.completion_ids,
        b.teacher_topk_ids,
        b.teacher_topk_logprobs,
        b.teacher_sampled_logprobs,
        response_mask=b.response_mask,
    )
    loss.backward()
    assert torch.isfinite(loss) and loss.item() > 0
    assert next(model.parameters()).grad is not None
    # k1 estimate of KL(π‖π_teacher) on the sampled tokens, by hand in float64
    lp = torch.log_softmax(logits.detach().double() / b.temperature[:, None, None], -1)
    lp_a = lp.gather(-1, b.completion_ids[..., None])[..., 0]
    mask = b.response_mask
    want = (lp_a - b.teacher_sampled_logprobs.double())[mask].mean()
    assert abs(m["distill_kl_sampled"].item() - want.item()) < 1e-4
    # a batch mixing taught and untaught records is refused by name
    plain = dataclasses.replace(recs[1], teacher_semantics=None, teacher_topk_ids=None)
    plain.teacher_topk_logprobs = plain.teacher_sampled_logprobs = None
    with pytest.raises(
        ValueError, match=f"{recs[0].rollout_id!r} has a teacher, {plain.rollout_id!r} has not"
    ):
        collate([recs[0], plain], rewards=[0.0, 0.0])


async def _at_least(r, keys, n: int):
    out = await r.xrange(keys.rollouts)
    return out if len(out) >= n else None


async def _when_zero(aw):
    return True if await aw == 0 else None


def _stage_proc(url: str, teachers: str, *extra: str, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "maskroll.app.cli", "teacher", "--redis-url", url, "--namespace", NS]
    cmd += ["--teacher", teachers, "--teacher-k", str(K_T), "--student-wait-s", "30", *extra]
    return subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT, text=True)


def _wait_ready(proc, log_path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while "maskroll teacher: ready" not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.05)


def test_a_teacher_worker_killed_mid_batch_loses_and_repeats_nothing(
    redis_server, fleet, model_dir, tmp_path
):
    """SIGKILL a real `maskroll teacher` process while it scores; its restart takes over what it held."""
    _, (ta, tb) = fleet
    recs = _records(model_dir, "kill", 30)  # scoring is fast: enough records that the kill lands mid-way
    total = len(recs)
    flags = ["--concurrency", "4", "--timeout-s", "3", "--claim-idle-s", "4", "--log-every-s", "0"]

    async def main():
        r, _ = await open_redis(redis_server.url)
        keys = StreamKeys(NS)
        await _clear(r, keys)
        await feed(r, keys, recs)
        await feed(r, keys, recs[:4])  # a job whose records were published twice
        log1 = tmp_path / "w1.log"
        with open(log1, "w") as f:
            p1 = _stage_proc(
                redis_server.url, f"{ta.address},{tb.address}", *flags, "--worker-id", "w1", log=f
            )
        try:
            _wait_ready(p1, log1)
            await freeze_mid_batch(r, p1, keys.part(0).finished, TEACHER_GROUP, keys.rollouts, total)
            p1.send_signal(signal.SIGKILL)
            p1.wait(10)
        finally:
            if p1.poll() is None:
                p1.kill()
        pending = await r.xpending(keys.part(0).finished, TEACHER_GROUP)
        before = await r.xlen(keys.rollouts)
        assert pending["pending"] > 0, "the kill landed between records: nothing was mid-scoring"
        assert before < total
        log2 = tmp_path / "w2.log"
        with open(log2, "w") as f:
            p2 = _stage_proc(
                redis_server.url, f"{tb.address},{ta.address}", *flags, "--worker-id", "w2", log=f
            )
        try:
            _wait_ready(p2, log2)
            await wait_for(lambda: _when_zero(r.xlen(keys.part(0).finished)), timeout=90)
        finally:
            p2.send_signal(signal.SIGTERM)
            assert p2.wait(20) == 0, log2.read_text()
        out = [wire.decode_record(f[F_RECORD]) for _, f in await r.xrange(keys.rollouts)]
        ids = [x.rollout_id for x in out]
        assert len(ids) == len(set(ids)) == total  # every record exactly once
        assert set(ids) == {x.rollout_id for x in recs}
        assert all(x.has_teacher and x.teacher_topk_ids.shape == (x.num_tokens, K_T) for x in out)
        assert (await r.xpending(keys.part(0).finished, TEACHER_GROUP))["pending"] == 0
        await r.aclose()

    asyncio.run(main())


def test_a_teacher_of_another_vocabulary_is_refused_at_start_up(redis_server, fleet, teacher_dir, tmp_path):
    """The student's tokenizer (--tokenizer) maps ids to other tokens than the teacher's: exit 2, named."""
    _, (ta, _) = fleet
    other = _other_tokenizer(teacher_dir, tmp_path / "student-tokenizer")
    log = tmp_path / "refused.log"
    with open(log, "w") as f:
        p = _stage_proc(redis_server.url, ta.address, "--tokenizer", str(other), log=f)
        assert p.wait(120) == 2, log.read_text()
    text = log.read_text()
    assert f"teacher {ta.address} ({teacher_dir}) has another tokenizer than the student ({other})" in text
    assert "maskroll teacher: ready" not in text


def test_a_live_reward_stage_keeps_the_teacher_stage_out(redis_server, fleet):
    """One stage per namespace: a teacher worker refuses to start beside a live reward worker."""
    _, (ta, _) = fleet
    cfg = TeacherStageConfig(redis_url=redis_server.url, namespace=NS, teacher=ta.address, student_wait_s=30)

    async def main():
        r, cluster = await open_redis(redis_server.url)
        keys = StreamKeys(NS, 1, cluster)
        await r.set(keys.rewarder("rw"), json.dumps({"worker_id": "rw", "stage": "reward"}), px=5000)
        w = await make_teacher_worker(r, keys, cfg, "t1")
        try:
            with pytest.raises(ValueError, match="has a live reward stage worker \\(rw\\)"):
                await w.start()
        finally:
            await r.delete(keys.rewarder("rw"))
            await w.scorer.pool.close()
            await r.aclose()

    asyncio.run(main())


def test_a_teacher_down_passes_records_to_the_next_and_a_refused_record_is_dead_lettered(
    redis_server, fleet, model_dir
):
    """Failover: a teacher that answers UNAVAILABLE (nothing listens there) passes each record to the next;
    with none up the record waits retry_s and stays pending (TeachersUnavailable, no dead letter). A
    record the teacher refuses (a token outside its vocabulary) is dead-lettered with the teacher's words,
    and the trainer is told (a reward_failed notice)."""
    from maskroll.proto.streams import F_REASON, F_REWARD_FAILED
    from maskroll.stages.teacher import TeacherPool, TeachersUnavailable

    _, (ta, _) = fleet
    dead = "127.0.0.1:1"

    async def main():
        pool = TeacherPool((dead, ta.address), token=None, timeout_s=10, retry_s=0.5)
        rec = record(model_dir, "fo", 0, 1)
        for _ in range(3):  # whichever turn it is, the live teacher answers
            result, address = await pool.score(rec.prompt_ids, rec.completion_ids, ScoreOptions(logprobs_k=2))
            assert address == ta.address and result.completions[0].num_tokens == rec.num_tokens
        await pool.close()
        down = TeacherPool((dead,), token=None, timeout_s=10, retry_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(TeachersUnavailable, match=r"no teacher of 127\.0\.0\.1:1 answered within 0\.5 s"):
            await down.score(rec.prompt_ids, rec.completion_ids, ScoreOptions(logprobs_k=2))
        assert time.monotonic() - t0 < 5
        await down.close()

        cfg = TeacherStageConfig(
            redis_url=redis_server.url,
            namespace=NS,
            teacher=f"{dead},{ta.address}",
            teacher_k=2,
            student_wait_s=30,
        )
        r, cluster = await open_redis(redis_server.url)
        keys = StreamKeys(NS, 1, cluster)
        await _clear(r, keys)
        # the vocabulary check at start-up asks every teacher: a teacher down then is an error, not a skip
        with pytest.raises(Exception, match="UNAVAILABLE"):
            await make_teacher_worker(r, keys, cfg, "fo-worker")
        cfg = dataclasses.replace(cfg, teacher=ta.address)
        w = await make_teacher_worker(r, keys, cfg, "fo-worker")
        await w.start()
        run = asyncio.create_task(w.run())
        bad = record(model_dir, "bad", 0, 1)
        bad.completion_ids = bad.completion_ids.copy()
        bad.completion_ids[1] = 100_000
        good = record(model_dir, "good", 0, 1)
        try:
            await feed(r, keys, [bad, good])
            out = await wait_for(lambda: _at_least(r, keys, 2), timeout=60)
        finally:
            w.stop()
            await asyncio.wait_for(run, 10)
            w.scorer.close()
            await w.scorer.pool.close()
        notice = next(f for _, f in out if F_REWARD_FAILED in f)
        assert wire.decode_record(notice[F_REWARD_FAILED]).rollout_id == bad.rollout_id
        reason = notice[F_REASON].decode()
        assert reason.startswith(f"no teacher score for {bad.rollout_id}: teacher {ta.address} refused it: ")
        assert "INVALID_ARGUMENT" in reason and "100000" in reason
        letters = await r.xrange(keys.part(0).dead_letters)
        assert [f[b"reason"].decode() for _, f in letters] == [reason]
        scored = [wire.decode_record(f[F_RECORD]) for _, f in out if F_RECORD in f]
        assert [x.rollout_id for x in scored] == [good.rollout_id] and scored[0].has_teacher
        await r.aclose()

    asyncio.run(main())


def _score_calls(replica) -> float:
    """Score RPCs the replica answered OK (its own Prometheus counter)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{replica.metrics}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "maskroll_requests_total" and sample.labels == {
                "method": "Score",
                "code": "OK",
            }:
                return sample.value
    return 0.0


def test_a_groups_records_are_scored_in_one_call(redis_server, fleet, model_dir, teacher_dir):
    """Two whole groups of 4, one record of a group whose others are elsewhere, one record without a
    group: 4 Score calls on the teacher (counted by its own metrics) instead of 10, and every record
    carries exactly the scores it gets when scored alone (group_wait_s = 0: a call per record)."""
    _, (ta, _) = fleet
    whole = _records(model_dir, "grp", 2)  # 2 jobs x 4 samples, texts of 3..9 tokens
    lone = record(model_dir, "lone", 2, 4, text=b"abcab")  # sample 2 of a group of 4, alone here
    single = record(model_dir, "single", 0, 1, text=b"cab")
    recs = [*whole, lone, single]

    async def run_stage(group_wait_s: float):
        cfg = TeacherStageConfig(
            redis_url=redis_server.url,
            namespace=NS,
            teacher=ta.address,
            teacher_k=K_T,
            group_wait_s=group_wait_s,
            timeout_s=20,
            claim_idle_s=30,
            student_wait_s=30,
        )
        r, cluster = await open_redis(redis_server.url)
        keys = StreamKeys(NS, 1, cluster)
        await _clear(r, keys)
        await feed(r, keys, recs)  # all there before the worker reads: it takes 8 (its concurrency) at once
        before = _score_calls(ta)
        w = await make_teacher_worker(r, keys, cfg, f"batch-{group_wait_s}")
        await w.start()
        run = asyncio.create_task(w.run())
        try:
            await wait_for(lambda: _at_least(r, keys, len(recs)), timeout=120)
            await wait_for(lambda: _when_zero(r.xlen(keys.part(0).finished)), timeout=60)
        finally:
            w.stop()
            await asyncio.wait_for(run, 10)
            w.scorer.close()
            await w.scorer.pool.close()
        got = {
            x.rollout_id: x
            for x in (wire.decode_record(f[F_RECORD]) for _, f in await r.xrange(keys.rollouts))
        }
        await r.aclose()
        return got, _score_calls(ta) - before, w

    batched, calls, w = asyncio.run(run_stage(0.3))
    assert calls == 4 and w.scorer.batcher.counters.calls == 4 and w.scorer.batcher.counters.records == 10
    alone, calls_alone, w_alone = asyncio.run(run_stage(0.0))
    assert calls_alone == 10 and w_alone.scorer.batcher is None
    assert sorted(batched) == sorted(alone) == sorted(x.rollout_id for x in recs)
    for rid, a in alone.items():
        b = batched[rid]
        assert b.teacher_semantics == a.teacher_semantics and b.teacher_semantics.model == str(teacher_dir)
        np.testing.assert_array_equal(b.teacher_topk_ids, a.teacher_topk_ids)
        np.testing.assert_array_equal(b.teacher_topk_logprobs, a.teacher_topk_logprobs)
        np.testing.assert_array_equal(b.teacher_sampled_logprobs, a.teacher_sampled_logprobs)
        assert (
            b.teacher_topk_ids.shape == (b.num_tokens, K_T) and np.isfinite(b.teacher_sampled_logprobs).all()
        )


def test_a_batch_with_a_refused_record_dead_letters_that_record_only(redis_server, fleet, model_dir):
    """One record of a group of 4 holds a token outside the teacher's vocabulary: the group's call is
    refused, scored again record by record, and only that record is dead-lettered."""
    from maskroll.proto.streams import F_REASON, F_REWARD_FAILED

    _, (ta, _) = fleet
    recs = _records(model_dir, "split", 1)
    bad = recs[2]
    bad.completion_ids = bad.completion_ids.copy()
    bad.completion_ids[0] = 100_000
    cfg = TeacherStageConfig(
        redis_url=redis_server.url, namespace=NS, teacher=ta.address, teacher_k=K_T, student_wait_s=30
    )

    async def main():
        r, cluster = await open_redis(redis_server.url)
        keys = StreamKeys(NS, 1, cluster)
        await _clear(r, keys)
        await feed(r, keys, recs)
        w = await make_teacher_worker(r, keys, cfg, "split-worker")
        await w.start()
        run = asyncio.create_task(w.run())
        try:
            out = await wait_for(lambda: _at_least(r, keys, 4), timeout=60)
        finally:
            w.stop()
            await asyncio.wait_for(run, 10)
            w.scorer.close()
            await w.scorer.pool.close()
        c = w.scorer.batcher.counters
        assert (c.calls, c.records, c.split) == (5, 8, 1)  # the group's call, then one per record
        scored = sorted(wire.decode_record(f[F_RECORD]).rollout_id for _, f in out if F_RECORD in f)
        assert scored == sorted(x.rollout_id for x in recs if x is not bad)
        (notice,) = [f for _, f in out if F_REWARD_FAILED in f]
        assert wire.decode_record(notice[F_REWARD_FAILED]).rollout_id == bad.rollout_id
        assert "100000" in notice[F_REASON].decode() and (await r.xlen(keys.part(0).dead_letters)) == 1
        await r.aclose()

    asyncio.run(main())


def test_replicas_report_their_tokenizer_fingerprint(fleet, model_dir, teacher_dir):
    student, (ta, _) = fleet

    async def main():
        infos = []
        for rep in (student, ta):
            async with RolloutClient(rep.address) as c:
                infos.append(await c.info())
        return infos

    s, t = asyncio.run(main())
    assert (
        s.tokenizer_fingerprint == fingerprint_tokenizer_json(model_dir) == tokenizer_fingerprint(model_dir)
    )
    assert t.tokenizer_fingerprint == s.tokenizer_fingerprint  # two models of one tokenizer
    assert s.tokenizer_fingerprint.startswith("tok1:") and len(s.tokenizer_fingerprint) == 5 + 32


def test_a_remote_teacher_of_another_map_is_refused_by_its_reported_fingerprint(
    redis_server, fleet, teacher_dir, tmp_path
):
    """A teacher whose tokenizer has the student's size but another id → token map, and whose files the
    stage cannot read (its directory is gone once the replica has loaded it: as on another machine): the
    stage compares the fingerprint the teacher reports in GetInfo with the student replica's, exits 2 and
    names it."""
    other = _other_tokenizer(teacher_dir, tmp_path / "other-teacher")
    rep = LocalReplica(
        ["--model", other, "--engine", "torch", "--port", "0", "--threads", "1", "--drain-timeout-s", "2"],
        env=ENV,
        name="other teacher",
    )
    with rep:
        moved = tmp_path / "elsewhere"
        other.rename(moved)
        log = tmp_path / "remote.log"
        with open(log, "w") as f:
            p = _stage_proc(redis_server.url, rep.address, log=f)
            assert p.wait(120) == 2, log.read_text()
    text = log.read_text()
    assert f"teacher {rep.address} ({other}) has another tokenizer than the student (" in text
    assert "same vocab_size 259, but its id → token map differs (tok1:" in text  # the model's embedding rows
    assert "maskroll teacher: ready" not in text
