"""A run's lifecycle for real (issue 16): two `maskroll serve --pull` replicas (torch engine), one Redis, the
trainer SDK and the checkpoint publisher. A second trainer on the namespace is refused unless it chooses,
and a new run never trains on the previous run's records; a resumed trainer continues at the right
version and its first broadcast is accepted; a broadcast every replica refuses raises, and replicas log
every update they accept or refuse; replicas serving another run's weights produce records that are
refused as "from the future" until they load this run's; the replicas' version rule is per run.

The two replicas are shared by every test (each test starts with a run of its own).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time

import pytest
import redis
import torch
from procs import Replicas

from maskroll.app.model_init import encode_text
from maskroll.client import (
    BroadcastError,
    QueueTimeout,
    ReplicaWeights,
    RolloutError,
    RolloutQueue,
    RunChoiceRequired,
    SamplingOptions,
    SyncRolloutClient,
)
from maskroll.local.redis_server import LocalRedis
from maskroll.proto.streams import StreamKeys
from maskroll.weight_sync import CHECKPOINT_FILE, CheckpointPublisher
from maskroll.weight_sync.broadcast import broadcast_weights, replica_weights, sync_replicas

pytestmark = pytest.mark.slow

NS = "lifecycle"
OPTS = SamplingOptions(max_tokens=8, logprobs_k=3)
REPS = ("rep-0", "rep-1")


class Cluster:
    def __init__(self, url: str, root, replicas: Replicas, prompt: list[int]) -> None:
        self.url, self.root, self.replicas, self.prompt = url, root, replicas, prompt
        self.raw = redis.Redis.from_url(url)
        self.keys = StreamKeys(NS)

    def queue(self, **kw) -> RolloutQueue:
        return RolloutQueue(self.url, NS, batch_size=4, claim_idle_s=2.0, **kw)

    def log(self, name: str) -> str:
        return self.replicas.log(name).read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("lifecycle")
    root = base / "weights"
    root.mkdir()
    with LocalRedis() as srv:
        reps = Replicas(model_dir, srv.url, NS, log_dir=base)
        for name in REPS:
            reps.start(name, "--weights-root", str(root))
        try:
            reps.wait_ready()
            c = Cluster(srv.url, root, reps, encode_text(model_dir, "count:"))
            with c.queue(run="new") as q:  # registered before any test asks for them
                deadline = time.monotonic() + 30
                while len(q.replicas()) < 2:
                    assert time.monotonic() < deadline, "replicas did not register"
                    time.sleep(0.1)
            yield c
        finally:
            codes = reps.stop_all()
            bad = {
                name: (code, reps.log(name).read_text(errors="replace")[-2000:])
                for name, code in codes.items()
                if code
            }
    assert not bad, bad  # every replica drained and exited 0 (its log tail otherwise)


def _model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _step(model: torch.nn.Module, seed: int) -> None:
    """Stands in for an optimiser step: new weights, same shapes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))


def _serving(q: RolloutQueue) -> dict:
    return replica_weights(q)


def test_a_second_trainer_must_choose_and_a_new_run_never_trains_on_the_old_records(cluster, model_dir):
    first = cluster.queue(run="new")
    model = _model(model_dir)
    pub = CheckpointPublisher(first, cluster.root)
    pub.start(model)
    for seed in (1, 2):
        _step(model, seed)
        assert pub.publish(model) == {r: "ok" for r in REPS}
    assert _serving(first) == {r: ReplicaWeights(first.run_id, 2) for r in REPS}
    for _ in range(4):  # jobs that run, and records nobody consumes: the first trainer stops
        first.submit(cluster.prompt, OPTS, n=2)
    deadline = time.monotonic() + 120
    while cluster.raw.xlen(cluster.keys.rollouts) < 8:
        assert time.monotonic() < deadline, "the first run's records did not arrive"
        time.sleep(0.1)
    old_run = first.run_id
    first.close()

    with pytest.raises(RunChoiceRequired, match=f"already has run {old_run} \\(policy version 2"):
        cluster.queue()
    second = cluster.queue(run="new")
    model2 = _model(model_dir)
    assert CheckpointPublisher(second, cluster.root).start(model2) == 0  # the replicas served run 1's v2
    assert _serving(second) == {r: ReplicaWeights(second.run_id, 0) for r in REPS}
    for _ in range(2):
        second.submit(cluster.prompt, OPTS, n=2)
    batch = second.next_batch(timeout=120)
    assert {r.run_id for r in batch} == {second.run_id}
    assert {r.policy_version_first for r in batch} == {0} and len(batch) == 4
    assert second.stats.foreign_run == 8 and second.stats.received == 4  # every leftover refused
    second.ack(batch)
    reasons = [e[1][b"reason"].decode() for e in cluster.raw.xrange(cluster.keys.dead_letters)]
    assert (
        sum(f"belongs to run {old_run}, not to this trainer's run {second.run_id}" in x for x in reasons) == 8
    )
    second.close()


def test_a_resumed_trainer_continues_at_the_right_version(cluster, model_dir):
    first = cluster.queue(run="new")
    model = _model(model_dir)
    pub = CheckpointPublisher(first, cluster.root)
    pub.start(model)
    for seed in (3, 4):
        _step(model, seed)
        pub.publish(model)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    run_id = first.run_id
    first.close()  # the trainer process ends (a crash leaves the same state in Redis)

    again = cluster.queue(run="resume")
    assert (again.run_id, again.policy_version, again.run.version) == (run_id, 2, 2)
    assert again.run.checkpoint == str(cluster.root / "v2")
    restarted = _model(model_dir)  # a new process starts from the base weights
    pub2 = CheckpointPublisher(again, cluster.root)
    assert pub2.start(restarted) == 2
    for name, t in restarted.state_dict().items():
        assert torch.equal(t, trained[name]), name
    assert sync_replicas(again) == {r: "unchanged" for r in REPS}  # they serve v2 of this run already
    _step(restarted, 5)
    assert pub2.publish(restarted) == {r: "ok" for r in REPS}  # the first broadcast after the restart
    assert pub2.version == 3 and again.policy_version == 3
    assert _serving(again) == {r: ReplicaWeights(run_id, 3) for r in REPS}
    for _ in range(2):
        again.submit(cluster.prompt, OPTS, n=2)
    batch = again.next_batch(timeout=120)
    assert {(r.run_id, r.policy_version_first) for r in batch} == {(run_id, 3)}
    again.ack(batch)
    assert sorted(p.name for p in cluster.root.iterdir() if p.name.startswith("v")) == ["v2", "v3"]
    again.close()


def test_a_broadcast_every_replica_refuses_raises_and_replicas_log_each_update(
    cluster, model_dir, tmp_path, caplog
):
    q = cluster.queue(run="new")
    outside = tmp_path / "v1"
    outside.mkdir()
    shutil.copy(model_dir / CHECKPOINT_FILE, outside / CHECKPOINT_FILE)
    with pytest.raises(
        BroadcastError, match="loaded by none of the 2 live replicas in namespace 'lifecycle'"
    ) as e:
        broadcast_weights(q, 1, str(outside))
    assert set(e.value.results) == set(REPS)
    assert all("PERMISSION_DENIED" in r and "weights_root" in r for r in e.value.results.values())
    inside = cluster.root / "copied"
    shutil.copytree(outside, inside, dirs_exist_ok=True)
    assert broadcast_weights(q, 2, str(inside)) == {r: "ok" for r in REPS}
    # A partial broadcast: a registered replica that does not answer is reported and logged as behind.
    ghost = {"replica_id": "ghost", "address": "127.0.0.1:9", "policy_version": 0}
    cluster.raw.set(cluster.keys.replica("ghost"), json.dumps(ghost), px=60_000)
    try:
        with caplog.at_level(logging.WARNING, logger="maskroll.queue"):
            results = broadcast_weights(q, 3, str(inside), timeout=10)
    finally:
        cluster.raw.delete(cluster.keys.replica("ghost"))
    assert results["rep-0"] == results["rep-1"] == "ok" and results["ghost"] != "ok", results
    assert f"policy version 3 of run {q.run_id}: replicas behind: {{'ghost': " in caplog.text
    for name in REPS:
        log = cluster.log(name)
        refused = (
            rf"weights: refused version 1 of run {q.run_id} from {re.escape(str(outside))}: PERMISSION_DENIED"
        )
        assert re.search(refused, log), log[-2000:]
        loaded = rf"weights: loaded version 2 of run {q.run_id} \(was \d+ of run [-\w]+\) "
        loaded += rf"from {re.escape(str(inside))} in [\d.]+ s"
        assert re.search(loaded, log), log[-2000:]
    q.close()


def test_replicas_on_another_runs_weights_are_refused_until_they_load_this_runs(cluster, model_dir):
    first = cluster.queue(run="new")
    model = _model(model_dir)
    pub = CheckpointPublisher(first, cluster.root)
    pub.start(model)
    for seed in (6, 7, 8):
        _step(model, seed)
        pub.publish(model)  # the replicas serve version 3 of the first run
    first.close(cancel_jobs=True)

    # The mistake: a new trainer that does not bring the replicas to its weights first.
    second = cluster.queue(run="new")
    for _ in range(2):
        second.submit(cluster.prompt, OPTS, n=2)
    with pytest.raises(QueueTimeout) as e:
        second.next_batch(timeout=15)
    assert "4 from policy versions ahead of this trainer's 0" in str(e.value), e.value
    assert "CheckpointPublisher.start(model)" in str(e.value)
    assert second.stats.future_version == 4 and second.stats.received == 0
    assert CheckpointPublisher(second, cluster.root).start(_model(model_dir)) == 0
    for _ in range(2):
        second.submit(cluster.prompt, OPTS, n=2)
    batch = second.next_batch(timeout=120)
    assert {(r.run_id, r.policy_version_first) for r in batch} == {(second.run_id, 0)}
    second.ack(batch)
    second.close()


def test_the_replicas_version_rule_is_per_run(cluster, model_dir):
    base = cluster.root / "base"
    base.mkdir(exist_ok=True)
    shutil.copy(model_dir / CHECKPOINT_FILE, base / CHECKPOINT_FILE)
    with cluster.queue(run="resume") as q:
        address = next(r.address for r in q.replicas() if r.replica_id == "rep-0")
    with SyncRolloutClient(address) as c:
        assert c.update_weights(5, base, run_id="run-x").version == 5
        assert (c.info().run_id, c.info().policy_version) == ("run-x", 5)
        # another run reloads, at a lower version too
        assert c.update_weights(2, base, run_id="run-y").version == 2
        with pytest.raises(RolloutError, match="greater than the current policy version 2 of run run-y"):
            c.update_weights(2, base, run_id="run-y")
        with pytest.raises(RolloutError, match="greater than the current policy version 2"):
            c.update_weights(1, base)  # a client without runs: versions must increase
        assert c.update_weights(3, base).version == 3
        assert (c.info().run_id, c.info().policy_version) == ("", 3)
