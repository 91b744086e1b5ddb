"""GroupBatcher's rules on a scripted `score_many` (the real teacher path is test_teacher.py's): a whole
group goes in one call, each record gets its own row; a full worker sends what it holds; a record
cancelled before its batch is sent leaves it; a refused batch is split so only the bad record fails; a
failure of the call is every record's; a record without a group is sent at once. No timing assertions:
the only timer used either never fires (60 s) or is waited for."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from maskroll.proto.records import RolloutRecord, Semantics
from maskroll.proto.scoring import ScoredTokens, ScoreResult
from maskroll.stages.teacher import TeacherError, TeachersUnavailable
from maskroll.stages.teacher_batch import GroupBatcher

NEVER = 60.0  # a wait that no test reaches


def rec(group: str, i: int, size: int, prompt=(1, 2, 3)) -> RolloutRecord:
    t = i + 2
    return RolloutRecord(
        rollout_id=f"{group}-{i}",
        request_id=group,
        prompt_ids=np.array(prompt, np.int32),
        completion_ids=np.arange(10 * i, 10 * i + t, dtype=np.int32),
        sampled_logprobs=np.zeros(t, np.float32),
        sampled_ranks=np.ones(t, np.int32),
        topk_ids=np.zeros((t, 1), np.int32),
        topk_logprobs=np.zeros((t, 1), np.float32),
        finish_reason="length",
        semantics=Semantics(temperature=1.0, logprobs_k=1, engine="torch", model="m"),
        group_id=group,
        sample_index=i,
        group_size=size,
        run_id="run",
    )


class Teacher:
    """score_many that records each call and scores token x as logprob -x (refusing BAD)."""

    BAD = 999

    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls: list[tuple[tuple[int, ...], list[list[int]]]] = []
        self.fail = fail

    async def __call__(self, prompt, completions):
        self.calls.append((tuple(prompt.tolist()), [c.tolist() for c in completions]))
        await asyncio.sleep(0)
        if self.fail is not None:
            raise self.fail
        if any(self.BAD in c for c in completions):
            raise TeacherError(
                f"teacher t:1 refused it: INVALID_ARGUMENT: {self.BAD} is outside the vocabulary"
            )
        scored = [
            ScoredTokens(
                -c.astype(np.float32), np.ones(c.size, np.int32), c[:, None], -c[:, None].astype(np.float32)
            )
            for c in completions
        ]
        return ScoreResult("q", scored, Semantics(temperature=1.0, logprobs_k=1), 0), "t:1"


def run(coro):
    return asyncio.run(coro)


def test_a_whole_group_is_one_call_and_each_record_gets_its_row():
    teacher = Teacher()

    async def main():
        b = GroupBatcher(teacher, wait_s=NEVER, max_batch=64, capacity=8)
        recs = [rec("g", i, 4) for i in range(4)]
        out = await asyncio.gather(*(b.score(r) for r in recs))
        assert len(teacher.calls) == 1 and teacher.calls[0][0] == (1, 2, 3)
        assert teacher.calls[0][1] == [r.completion_ids.tolist() for r in recs]
        for r, (t, result, address) in zip(recs, out, strict=True):
            np.testing.assert_array_equal(t.logprobs, -r.completion_ids.astype(np.float32))
            assert address == "t:1" and result.policy_version == 0
        assert (b.counters.calls, b.counters.records) == (1, 4)

    run(main())


def test_a_group_larger_than_max_batch_is_sent_in_parts():
    teacher = Teacher()

    async def main():
        b = GroupBatcher(teacher, wait_s=NEVER, max_batch=3, capacity=16)
        await asyncio.gather(*(b.score(rec("g", i, 6)) for i in range(6)))
        assert [len(c) for _, c in teacher.calls] == [3, 3]

    run(main())


def test_a_full_worker_sends_what_it_holds():
    """Capacity 4: two half groups fill the worker, so both are sent without waiting for their siblings."""
    teacher = Teacher()

    async def main():
        b = GroupBatcher(teacher, wait_s=NEVER, max_batch=64, capacity=4)
        recs = [rec("a", 0, 4), rec("b", 0, 4, prompt=(7,)), rec("a", 1, 4), rec("b", 1, 4, prompt=(7,))]
        await asyncio.gather(*(b.score(r) for r in recs))
        assert sorted((p, len(c)) for p, c in teacher.calls) == [((1, 2, 3), 2), ((7,), 2)]

    run(main())


def test_records_of_other_prompts_or_runs_are_not_mixed():
    teacher = Teacher()

    async def main():
        b = GroupBatcher(teacher, wait_s=0.01, max_batch=64, capacity=64)
        other_run = rec("g", 1, 3)
        other_run.run_id = "another"
        await asyncio.gather(
            b.score(rec("g", 0, 3)), b.score(other_run), b.score(rec("g", 2, 3, prompt=(9,)))
        )
        assert sorted(len(c) for _, c in teacher.calls) == [1, 1, 1]  # three keys, each sent on its wait

    run(main())


def test_a_record_without_a_group_is_sent_at_once():
    teacher = Teacher()

    async def main():
        b = GroupBatcher(teacher, wait_s=NEVER, max_batch=64, capacity=8)
        single = rec("", 0, 1)
        single.group_id = ""
        (t, _, _), _ = await asyncio.gather(b.score(single), b.score(rec("solo", 0, 1)))
        assert len(teacher.calls) == 2 and t.num_tokens == 2

    run(main())


def test_a_cancelled_record_leaves_its_batch_before_it_is_sent():
    teacher = Teacher()

    async def main():
        b = GroupBatcher(teacher, wait_s=0.05, max_batch=64, capacity=8)
        gone = asyncio.create_task(b.score(rec("g", 0, 4)))
        kept = asyncio.create_task(b.score(rec("g", 1, 4)))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        t, _, _ = await kept  # sent alone once its wait is over
        assert teacher.calls == [((1, 2, 3), [rec("g", 1, 4).completion_ids.tolist()])]
        assert t.num_tokens == 3 and b._waiting == 0 and not b._open

    run(main())


def test_a_refused_batch_is_scored_record_by_record_and_only_the_bad_record_fails():
    teacher = Teacher()

    async def main():
        b = GroupBatcher(teacher, wait_s=NEVER, max_batch=64, capacity=8)
        recs = [rec("g", i, 3) for i in range(3)]
        recs[1].completion_ids = np.array([5, Teacher.BAD], np.int32)
        out = await asyncio.gather(*(b.score(r) for r in recs), return_exceptions=True)
        assert isinstance(out[1], TeacherError) and "999 is outside the vocabulary" in str(out[1])
        for i in (0, 2):
            np.testing.assert_array_equal(out[i][0].logprobs, -recs[i].completion_ids.astype(np.float32))
        assert [len(c) for _, c in teacher.calls] == [3, 1, 1, 1]
        assert (b.counters.calls, b.counters.records, b.counters.split) == (4, 6, 1)

    run(main())


def test_a_call_no_teacher_answered_fails_every_record_of_the_batch():
    teacher = Teacher(fail=TeachersUnavailable("no teacher of t:1 answered within 1 s"))

    async def main():
        b = GroupBatcher(teacher, wait_s=NEVER, max_batch=64, capacity=8)
        out = await asyncio.gather(*(b.score(rec("g", i, 2)) for i in range(2)), return_exceptions=True)
        assert all(isinstance(e, TeachersUnavailable) for e in out) and len(teacher.calls) == 1  # not split

    run(main())
