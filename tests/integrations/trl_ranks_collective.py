"""The rank bodies of test_trl_ranks.py's collective test: `integrations/trl_ranks.py` on 2 real gloo ranks
(torch.multiprocessing.spawn imports `rank_main` from here by name). Rank 0's source is a list of
prepared groups (the queue path itself runs in the accelerate test); each rank writes what it got.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from maskroll.client.ranks import RankFailed
from maskroll.integrations import trl_ranks
from maskroll.integrations.rollouts import GenerationError, Job
from maskroll.proto.records import RolloutRecord, Semantics
from maskroll.trainer_adapter.distributed import TorchCollective

# job -> completion tokens of each of its samples: 4 groups of 2, 70 tokens in all
GROUPS = {"a": [20, 20], "b": [10, 5], "c": [3, 2], "d": [5, 5]}


def record(job: str, index: int, tokens: int) -> RolloutRecord:
    return RolloutRecord(
        rollout_id=f"{job}:{index}",
        request_id=f"{job}-{index}",
        prompt_ids=np.array([1, 2], np.int32),
        completion_ids=np.arange(tokens, dtype=np.int32),
        sampled_logprobs=np.zeros(tokens, np.float32),
        sampled_ranks=np.ones(tokens, np.int32),
        topk_ids=np.zeros((tokens, 0), np.int32),
        topk_logprobs=np.zeros((tokens, 0), np.float32),
        finish_reason="length",
        semantics=Semantics(temperature=1.0, logprobs_k=0, engine="test"),
        job_id=job,
        sample_index=index,
        group_size=len(GROUPS[job]),
    )


class ListSource:
    """Rank 0's source: take() hands out the prepared groups (with a job whose rows name them), or
    raises what it was told to."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail, self.asked = fail, []

    def take(self, count: int, version: int, refill=None):  # refill: rank 0's top-up (unused here)
        self.asked.append([count, version])
        if self.fail is not None:
            raise self.fail
        return [
            ([record(job, i, t) for i, t in enumerate(ts)], Job([1, 2], [{"job": job}] * len(ts), job_id=job))
            for job, ts in GROUPS.items()
        ]


def _error(fn) -> list:
    try:
        fn()
    except RankFailed as e:
        return ["RankFailed", str(e)]
    except Exception as e:
        return [type(e).__name__, str(e)]
    return ["none", ""]


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        c = TorchCollective()
        got: dict = {"rank": rank}
        got["answer"] = trl_ranks.main_answer(c, lambda: 41 + 1)
        got["answer_error"] = _error(lambda: trl_ranks.main_answer(c, lambda: int("x")))
        got["rows"] = trl_ranks.gather_rows(c, [f"r{rank}-0", f"r{rank}-1"])
        source = ListSource() if rank == 0 else None
        mine, whole = trl_ranks.take_shares(c, source, 4, 7)  # 4 records per rank of a global 8
        got["share"] = [[[r.rollout_id for r in g], job.job_id, job.rows] for g, job in mine]
        got["whole"] = [[r.rollout_id for r in g] for g in whole]
        got["asked"] = source.asked if source else []
        failing = ListSource(GenerationError("no rollouts within 600 s")) if rank == 0 else None
        got["take_error"] = _error(lambda: trl_ranks.take_shares(c, failing, 4, 7))
        rewards = torch.tensor([[float(rank * 10 + i)] for i in range(rank + 1)])  # 1 row on 0, 2 on 1
        everyone, mine_rows = trl_ranks.gather_rewards(c, rewards)
        got["rewards"] = everyone.flatten().tolist()
        got["mine"] = everyone[mine_rows].flatten().tolist()
        acked = []
        trl_ranks.all_stepped(c, lambda: acked.append("ack"))
        got["acked"] = acked
        Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()
