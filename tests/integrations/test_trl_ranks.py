"""MaskrollGRPOTrainer data-parallel for real: `accelerate launch --multi_gpu --num_processes 2` (on a machine
without GPUs: DDP over gloo, accelerate's MULTI_CPU) against the module's two `maskroll serve --pull`
replicas and private Redis (`cluster`). Rank 0 alone holds the queue; the test reads what each rank
trained on (trl_ranks_worker.py writes it) and checks the run as a whole: one version on both ranks
at every step, replicas at the last one, no group split, every record trained once and acked once.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

from maskroll.client import SyncRolloutClient
from maskroll.integrations.trl import maskroll_loss
from maskroll.proto.streams import F_RECORD, TRAINER_GROUP, StreamKeys
from maskroll.proto.wire import decode_record
from maskroll.trainer_adapter import MaskConfig
from maskroll.trainer_adapter.forward import completion_logits

HERE = Path(__file__).resolve().parent
G = 4  # the worker's num_generations
STEPS = 3
GLOBAL_BATCH = 16  # 4 rows × 2 micro-steps per rank × 2 ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_versions(cluster) -> dict[str, int]:
    out = {}
    for name, address in cluster.addresses.items():
        with SyncRolloutClient(address) as c:
            out[name] = c.info().policy_version
    return out


def _launch(cluster, out: Path, ranks: int = 2) -> None:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    command += ["--num_processes", str(ranks), "--num_machines", "1", "--mixed_precision", "no"]
    command += ["--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    command += [str(HERE / "trl_ranks_worker.py"), "--redis-url", cluster.redis_url]
    command += ["--namespace", cluster.namespace, "--model-dir", str(cluster.model_dir)]
    command += ["--weights-root", str(cluster.weights_root), "--out", str(out), "--steps", str(STEPS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(out / "launch.log", "w") as log:
        proc = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    assert proc.returncode == 0, (out / "launch.log").read_text()[-6000:]


@pytest.mark.slow
def test_trl_under_accelerate_launch_two_processes(cluster, tmp_path):
    before = _replica_versions(cluster)
    _launch(cluster, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    for r, info in enumerate(ranks):
        assert (info["rank"], info["world"]) == (r, 2)
        assert (info["distributed_type"], info["backend"]) == ("MULTI_CPU", "gloo")  # DDP over gloo
        assert info["generation_batch_size"] == GLOBAL_BATCH
    for info in ranks:  # refused by name before anything starts, on every process
        assert "2 processes with direct gRPC replicas: several processes need redis_url" in info["refused"]
        assert (
            "= 2 with 2 processes: each process's share of a generation batch must be whole groups"
            in (info["refused"])
        )
    # one policy version on both ranks at every step: the run's start + the steps published so far
    start = ranks[0]["versions"][0][1] - 1
    want = [[step, start + step] for step in range(1, STEPS + 1)]
    assert ranks[0]["versions"] == ranks[1]["versions"] == want
    # every replica loaded every published version
    assert _replica_versions(cluster) == {k: start + STEPS for k in before}

    # each generation batch: the two shares are disjoint, whole groups, and together the global batch
    trained: list[str] = []
    for step in range(STEPS):
        shares = [info["batches"][step] for info in ranks]
        assert all(shares), "every rank trains on a non-empty share"
        assert sum(len(s) for s in shares) == GLOBAL_BATCH
        jobs = [{job for _, job, *_ in share} for share in shares]
        assert not jobs[0] & jobs[1], "a group was split between the ranks"
        for share in shares:
            per_job = collections.Counter(job for _, job, *_ in share)
            assert set(per_job.values()) == {G}, per_job  # whole groups of G
            for job in per_job:
                assert sorted(i for _, j, i, *_ in share if j == job) == list(range(G))
        trained += [rid for share in shares for rid, *_ in share]
        # TRL's advantages (scale_rewards="group"), each rank's own rows: (r - group mean) / (std + 1e-4)
        for share in shares:
            for job in {j for _, j, *_ in share}:
                rewards = torch.tensor([w for _, j, _, w, _ in share if j == job], dtype=torch.float64)
                want = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
                got = torch.tensor([a for _, j, _, _, a in share if j == job], dtype=torch.float64)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(trained) == len(set(trained)) == STEPS * GLOBAL_BATCH  # nothing trained twice

    # acked exactly once: rank 0 confirmed the global batches, the others confirm nothing themselves
    assert ranks[0]["counts"]["acked"] == STEPS * GLOBAL_BATCH
    assert ranks[1]["counts"]["acked"] == 0
    assert sum(info["counts"]["received"] for info in ranks) == STEPS * GLOBAL_BATCH
    # ... and no trained record is left pending in the rollout stream's consumer group (what is pending
    # was read ahead and never handed out: redelivered to the next reader, at least once)
    raw = redis.Redis.from_url(cluster.redis_url)
    for part in StreamKeys(cluster.namespace).parts:
        pending = raw.xpending_range(part.rollouts, TRAINER_GROUP, "-", "+", 1000)
        for entry in pending:
            [(_, fields)] = raw.xrange(part.rollouts, entry["message_id"], entry["message_id"])
            if F_RECORD in fields:  # (a job's failure has no record)
                assert decode_record(fields[F_RECORD]).rollout_id not in trained
    assert all(len(info["losses"]) == STEPS for info in ranks)
    # evaluation after training: each process its own prompt's group, sampled via rank 0; the reward is
    # the whole evaluation batch's on both; no version published by it
    assert sorted(r for info in ranks for r in info["evaluated_rows"]) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(len(set(info["evaluated_rows"])) == 1 for info in ranks)
    assert ranks[0]["eval"]["eval_reward"] == ranks[1]["eval"]["eval_reward"]
    assert 0.0 <= ranks[0]["eval"]["eval_reward"] <= 1.0
    assert [info["version_after_eval"] for info in ranks] == [start + STEPS] * 2
    # DDP: both ranks end on the same weights (the ones rank 0 published last)
    assert ranks[0]["weights"] == ranks[1]["weights"]
    _first_step_is_one_process_step(cluster, tmp_path)


def _first_step_is_one_process_step(cluster, out: Path) -> None:
    """The first optimiser step's gradient (DDP-averaged, as rank 0 held it before stepping) equals the
    gradient one process computes on the union of both ranks' records: for each micro-step, the token
    mean over both ranks' tokens (bnpo), each rank's sum recovered from its own plain token mean."""
    saved = [torch.load(out / f"rank{r}-step1.pt") for r in (0, 1)]
    micro = [s["inputs"] for s in saved]
    assert [len(m) for m in micro] == [2, 2]  # steps_per_generation micro-steps on each rank
    model = AutoModelForCausalLM.from_pretrained(cluster.model_dir, dtype=torch.float32)
    model.train()
    total = 0.0
    for i in range(2):
        sums, counts = [], []
        for r in (0, 1):
            batch = micro[r][i]
            loss, _, _ = maskroll_loss(
                completion_logits(model, batch),
                batch,
                mask=MaskConfig(method="predictive", divergence="topk_kl"),
                is_cap=10.0,
                aggregation="token_mean",
                max_len=10,
            )
            count = batch["response_mask"].sum()
            sums.append(loss * count)
            counts.append(count)
        total = total + sum(sums) / sum(counts) / 2  # / gradient accumulation (2 micro-steps)
    total.backward()
    ddp = saved[0]["grads"]
    assert ddp.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ddp[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # both ranks held the same averaged gradient
    for name in ddp:
        torch.testing.assert_close(saved[1]["grads"][name], ddp[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_rank0_reads_and_scatters_between_two_gloo_ranks(tmp_path):
    """trl_ranks on 2 real gloo ranks: rank 0 takes the global batch (count × W, its version) and each
    rank gets whole groups balanced by tokens with their jobs; a rank-0 error reaches every rank; rows and
    rewards are gathered in rank order; rank 0 alone acks, after both ranks arrived."""
    from trl_ranks_collective import rank_main

    torch.multiprocessing.spawn(rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [g["answer"] for g in got] == [42, 42]
    assert got[0]["answer_error"][0] == "ValueError"  # rank 0 raises its own error ...
    assert got[1]["answer_error"][0] == "RankFailed" and "ValueError" in got[1]["answer_error"][1]
    assert got[0]["rows"] == got[1]["rows"] == ["r0-0", "r0-1", "r1-0", "r1-1"]
    assert got[0]["asked"] == [[8, 7]]  # the global batch: 4 records per rank × 2 ranks, at version 7
    # groups a: 40 tokens, b: 15, d: 10, c: 5 -> greedy by tokens: {a} and {b, d, c} (40 vs 30 tokens)
    shares = [{job: ids for ids, job, _ in g["share"]} for g in got]
    assert shares[0] == {"a": ["a:0", "a:1"]}
    assert shares[1] == {"b": ["b:0", "b:1"], "c": ["c:0", "c:1"], "d": ["d:0", "d:1"]}
    for g in got:  # each group's job travelled with it, its rows intact
        assert all(rows == [{"job": job}] * 2 for _, job, rows in g["share"])
    scattered = sorted(i for share in shares for ids in share.values() for i in ids)
    assert sorted(i for ids in got[0]["whole"] for i in ids) == scattered  # what rank 0 will ack
    assert got[1]["whole"] == []  # only rank 0 keeps the global batch to ack
    assert got[0]["take_error"] == ["GenerationError", "no rollouts within 600 s"]
    assert got[1]["take_error"][0] == "RankFailed" and "no rollouts within 600 s" in got[1]["take_error"][1]
    assert got[0]["rewards"] == got[1]["rewards"] == [0.0, 10.0, 11.0]
    assert got[0]["mine"] == [0.0] and got[1]["mine"] == [10.0, 11.0]
    assert got[0]["acked"] == ["ack"] and got[1]["acked"] == []


def test_split_rows_keeps_every_row():
    """A share of 7 rows in 2 micro-steps: 3 + 4 rows, in order, 0-d entries in both (TRL's own split
    would give 3 + 3 and drop the last row); fewer rows than micro-steps is an error."""
    from maskroll.integrations.trl import split_rows

    batch = {"x": torch.arange(14).reshape(7, 2), "n": torch.tensor(21)}
    parts = split_rows(batch, 2)
    assert [p["x"].shape[0] for p in parts] == [3, 4]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert [int(p["n"]) for p in parts] == [21, 21]
    assert [p["x"].shape[0] for p in split_rows(batch, 3)] == [2, 2, 3]
    with pytest.raises(ValueError, match="7 rows cannot fill 8 micro-steps"):
        split_rows(batch, 8)


def test_demo_checks_trl_ranks_divide_the_prompts(capsys):
    """`maskroll demo --trainer trl --trainer-ranks N`: TRL gives every rank the same prompts per step."""
    from maskroll.app.demo import parse

    with pytest.raises(SystemExit) as exc:
        parse(["--trainer", "trl", "--trainer-ranks", "2", "--prompts-per-step", "3"])
    assert exc.value.code == 2
    assert "--prompts-per-step divisible by 2 (got 3)" in capsys.readouterr().err
    cfg = parse(["--trainer", "trl", "--trainer-ranks", "2", "--prompts-per-step", "4"])[0]
    assert (cfg.trainer, cfg.trainer_ranks) == ("trl", 2)
