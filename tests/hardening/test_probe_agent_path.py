"""Items 13 and 14 of the hardening issue, end to end on the README's own code: a replica started as the
agents section shows it (`maskroll serve --http-port`, Redis and a namespace, no `--pull`) and a trainer
with `RolloutQueue(run="new")` and a publisher's `start(model)`.

13: every episode was lost — the replica was not in the registry (only pullers wrote a heartbeat), so the
trainer's start() saw no replica, the replica served no run, and each finished session was dead-lettered
as "of another run or none" while `next_batch` timed out saying "0 live replicas". Now the replica is
registered, start() makes it adopt the run's version 0 (its starting weights are the trainer's model:
equal fingerprints, no bytes sent), the episode reaches the trainer, and a finish before any run is an
error that says why, not a record no trainer takes.

14: a trainer whose model differs from the replicas' `--model` (same architecture, other weights) trained
on the other model's rollouts without a sign (mean |Δ logprob| 4.3 nats). Now start() sees the fingerprints
differ and pushes its model as version 0: the first records' logprobs are the trainer's model's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from probe_helpers import HttpServe

from maskroll.client import RolloutClient, RolloutQueue
from maskroll.weight_sync import CheckpointPublisher, make_publisher

pytestmark = pytest.mark.slow
NAMESPACE = "agents-13"


@pytest.fixture(scope="module")
def agent_replica(model_dir, redis_server, tmp_path_factory):
    """The README's agent replica: HTTP, Redis, a namespace; no --pull, no --weights-root."""
    log = tmp_path_factory.mktemp("agent") / "serve.log"
    s = HttpServe(model_dir, log, "--namespace", NAMESPACE, env={"MASKROLL_REDIS_URL": redis_server.url})
    yield s
    assert s.stop() == 0


def _episode(s: HttpServe, session: str) -> httpx.Response:
    """One README episode: a chat turn in a session, then its finish (reward in the metadata)."""
    client = openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0)
    ep = {"X-Maskroll-Session": session, "X-Maskroll-Group": f"{session}-g"}
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    client.chat.completions.create(
        model=s.model,
        messages=messages,
        max_tokens=6,
        seed=7,
        extra_headers=ep,
        extra_body={"ignore_eos": True},
    )
    return httpx.post(
        f"{s.base}/v1/sessions/{session}/finish",
        json={"metadata": {"reward": "1"}, "group_size": 1, "sample_index": 0},
        timeout=30,
    )


def _served(s: HttpServe):
    import asyncio

    async def info():
        async with RolloutClient(s.address) as c:
            return await c.info()

    return asyncio.run(info())


def _model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _trainer_logprobs(model, rec) -> np.ndarray:
    """log π(sampled token) of the trainer's model at temperature 1, for the record's sampled tokens."""
    ids = torch.as_tensor(np.concatenate([rec.prompt_ids, rec.completion_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(rec.prompt_ids) - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(rec.prompt_ids) :, None])[:, 0]
    mask = rec.loss_mask if rec.loss_mask is not None else np.ones(len(lp), bool)
    return lp.numpy()[mask]


def test_readme_agent_path_delivers_the_episode_to_the_trainer(
    agent_replica, redis_server, model_dir, tmp_path
):
    s = agent_replica
    # before any trainer started a run: the record would be refused by every trainer, so it is not published
    early = _episode(s, "before-run")
    assert early.status_code == 400 and early.json()["error"]["code"] == "failed_precondition", early.text
    assert "no training run" in early.json()["error"]["message"]
    assert _served(s).weights_fingerprint.startswith("wfp1:")

    policy = _model(model_dir)  # the replica's own --model: adopted, nothing sent
    with RolloutQueue(redis_server.url, NAMESPACE, run="new", batch_size=1) as q:
        assert [r.replica_id for r in q.replicas()] == [_served(s).replica_id]  # registered without --pull
        pub = CheckpointPublisher(q, tmp_path / "ckpt")
        assert pub.start(policy) == 0
        info = _served(s)
        assert (info.run_id, info.policy_version, info.weights_fingerprint) == (q.run_id, 0, "")
        assert "adopted as version 0 of run " + q.run_id in s.log_text()
        assert "weights: loaded" not in s.log_text()  # no load: the replica already held the model

        done = _episode(s, "after-run")
        assert done.status_code == 200, done.text
        batch = q.next_batch(timeout=30)
        assert [r.metadata["session_id"] for r in batch] == ["after-run"]
        assert batch[0].run_id == q.run_id and batch[0].num_turns == 1
        # the record's logprobs are the trainer's model's (the same weights, float tolerance)
        rec = batch[0]
        mine = _trainer_logprobs(policy, rec)
        theirs = rec.sampled_logprobs[rec.loss_mask] if rec.loss_mask is not None else rec.sampled_logprobs
        assert np.abs(mine - theirs).max() < 1e-3
        q.ack(batch)
        assert q.stats.dead_lettered == 0
        # `maskroll status` shows it as a replica of this run that pulls no jobs (once its next heartbeat,
        # every 5 s by default, has said so)
        cli = [sys.executable, "-m", "maskroll.app.cli", "status", "--redis-url", redis_server.url]
        deadline = time.monotonic() + 20
        while True:
            out = subprocess.run(
                [*cli, "--namespace", NAMESPACE, "--json"], capture_output=True, text=True, timeout=60
            )
            (rep,) = json.loads(out.stdout)["replicas"]
            if rep["run_id"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert (rep["run_id"], rep["pulls"], rep["policy_version"]) == (q.run_id, False, 0)


def test_a_trainer_with_other_weights_pushes_them_before_the_first_record(
    agent_replica, redis_server, model_dir, tmp_path
):
    from maskroll.app.model_init import init_model

    s = agent_replica
    other = _model(init_model(tmp_path / "other", seed=5))  # same architecture, other weights
    with RolloutQueue(redis_server.url, NAMESPACE, run="new", batch_size=1) as q:
        pub = make_publisher("stream", q)
        try:
            assert pub.start(other) == 0
            info = _served(s)
            assert (info.run_id, info.policy_version) == (q.run_id, 0)
            assert "weights: loaded version 0 of run " + q.run_id in s.log_text()  # pushed, not adopted
            done = _episode(s, "other-weights")
            assert done.status_code == 200, done.text
            (rec,) = q.next_batch(timeout=30)
            mine = _trainer_logprobs(other, rec)
            theirs = (
                rec.sampled_logprobs[rec.loss_mask] if rec.loss_mask is not None else rec.sampled_logprobs
            )
            # before the fix: the replica's own model sampled these, 4.3 nats off on average
            assert np.abs(mine - theirs).max() < 1e-3
            q.ack([rec])
        finally:
            pub.close()
