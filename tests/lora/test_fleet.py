"""Several LoRA runs on one replica fleet (docs/lora.md "Several runs, one fleet"), for real: two
`maskroll serve --namespace fleet-a --lora-namespaces fleet-b` processes (torch engine) on a real Redis,
two trainers (RolloutQueue + StreamPublisher on a PEFT model each, with different adapters) sharing them.

- Jobs of both runs interleaved on the same two replicas: every record of run A names A's adapter and
  run, and was produced with it — re-scored, its sampled logprobs are a float32 transformers forward pass
  on A's merged weights of that version (within 1e-4) and not B's; likewise for B.
- A replica started mid-run joins each namespace at its run's current adapter (its trainers' followers
  push them while it waits), and once the first two are gone it serves both runs' jobs with them.
- In process: the replica reads SERVING only once every namespace has joined; a namespace whose run
  record is invalid is named in the reason while the others already pull.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import lora_helpers as lh
import numpy as np
import pytest
import redis
import torch

from maskroll.app.model_init import encode_text, init_model
from maskroll.client import RolloutQueue, SyncRolloutClient
from maskroll.local.redis_server import LocalRedis
from maskroll.local.replica import LocalReplica, stop_all, wait_all
from maskroll.proto.records import SamplingOptions
from maskroll.proto.streams import StreamKeys

pytestmark = pytest.mark.slow

NS_A, NS_B = "fleet-a", "fleet-b"
# temperature 1, no top-k / top-p: the processed distribution the replica samples from is the model's own
OPTS = SamplingOptions(max_tokens=8, temperature=1.0, logprobs_k=0)
TOL = 1e-4  # records vs the merged model's forward pass (float32 rounding; measured max 1.4e-5)
APART = 0.1  # the other run's adapter of the same version: measured max |Δ| 0.52 to 3.1 per record
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("fleet") / "tiny", seed=0)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with LocalRedis(data_dir=tmp_path_factory.mktemp("fleet-redis")) as srv:
        yield srv.url


def _replica(model_dir, url: str, name: str) -> LocalReplica:
    args = ["--model", str(model_dir), "--engine", "torch", "--port", "0", "--threads", "1"]
    args += ["--namespace", NS_A, "--lora-namespaces", NS_B, "--max-lora-rank", "8", "--pull"]
    args += ["--replica-id", name, "--pull-concurrency", "4", "--heartbeat-ttl-s", "3"]
    args += ["--claim-idle-s", "5", "--drain-timeout-s", "5", "--join-timeout-s", "120"]
    env = {"OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": url}
    return LocalReplica(args, env=env, name=f"replica {name}")


class Trainer:
    """One run: its queue, a PEFT model with a random adapter (B != 0, so that it changes the outputs),
    a StreamPublisher pushing it (its follower catches up joining replicas), and every version's adapter
    as sent, for re-scoring."""

    def __init__(self, model_dir, url: str, namespace: str, seed: int) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from maskroll.weight_sync import StreamPublisher

        self.namespace, self.seed = namespace, seed
        # in flight: (max_staleness + 1) x batch_size = 16 records, above a round's 12 (submitted first)
        self.queue = RolloutQueue(url, namespace, run="new", batch_size=8, max_staleness=1)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=RANK, lora_alpha=ALPHA, target_modules=list(lh.DEFAULT_TARGETS), lora_dropout=0.0
        )
        self.model = get_peft_model(base, config)
        self.sent: dict[int, tuple] = {}  # version -> (spec, tensors) as pushed
        self.publisher = StreamPublisher(self.queue, follow_s=1.0, timeout=60.0)

    @property
    def run_id(self) -> str:
        return self.queue.run.run_id

    def _randomize(self, step: int) -> None:
        g = torch.Generator().manual_seed(1000 * self.seed + step)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    def _remember(self, version: int) -> None:
        from maskroll.weight_sync import lora

        self.sent[version] = lora.adapter_of(self.model)

    def start(self) -> None:
        self._randomize(0)
        self._remember(self.publisher.start(self.model))

    def publish(self) -> dict[str, str]:
        self._randomize(self.queue.policy_version + 1)
        results = self.publisher.publish(self.model)
        self._remember(self.queue.policy_version)
        return results

    def submit(self, prompt: list[int], jobs: int) -> list[str]:
        return [self.queue.submit(prompt, OPTS, n=2, timeout=60) for _ in range(jobs)]

    def collect(self, total: int, timeout: float = 240.0) -> list:
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < total:
            assert time.monotonic() < deadline, f"{self.namespace}: only {len(got)} of {total} records"
            batch = self.queue.next_batch(timeout=deadline - time.monotonic(), at_least=2)
            got += batch
            self.queue.ack(batch)
        return got

    def close(self) -> None:
        self.publisher.close()
        self.queue.close()


class Rescorer:
    """Sampled logprobs of a record recomputed by transformers (float32, one forward pass over prompt +
    completion) on the base with one run's adapter of one version merged (W + alpha/r · B A)."""

    def __init__(self, model_dir, tmp_path) -> None:
        self.model_dir, self.tmp_path = model_dir, tmp_path
        self.base = lh.base_state_dict(model_dir)
        self._models: dict[tuple[str, int], torch.nn.Module] = {}

    def model(self, trainer: Trainer, version: int) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        key = (trainer.namespace, version)
        if key not in self._models:
            spec, tensors = trainer.sent[version]
            merged = lh.merged_state_dict(self.base, spec, tensors)
            where = lh.write_model_dir(self.model_dir, merged, self.tmp_path / f"{key[0]}-v{version}")
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
            self._models[key] = model.eval()
        return self._models[key]

    def logprobs(self, trainer: Trainer, version: int, record) -> np.ndarray:  # [T]
        ids = np.concatenate([record.prompt_ids, record.completion_ids]).astype(np.int64)
        with torch.no_grad():
            logits = self.model(trainer, version)(torch.from_numpy(ids)[None]).logits[0].float()  # [P+T, V]
        logp = torch.log_softmax(logits, dim=-1)
        p, t = len(record.prompt_ids), len(record.completion_ids)
        rows = torch.arange(p - 1, p + t - 1)
        return logp[rows, torch.from_numpy(ids[p:])].numpy()


def _check_records(records, mine: Trainer, other: Trainer, rescorer: Rescorer) -> None:
    """Every record of `mine`'s run names its adapter and run, and re-scores on its merged weights, not
    on the other run's of the same version."""
    for r in records:
        version = r.policy_version_first
        assert r.policy_version_last == version
        assert r.adapter == f"{mine.namespace}/{mine.run_id}/v{version}", r.adapter
        assert r.run_id == mine.run_id
        assert len(r.completion_ids) > 0
        want = rescorer.logprobs(mine, version, r)
        got = np.asarray(r.sampled_logprobs, np.float64)
        assert np.max(np.abs(got - want)) < TOL, (r.rollout_id, got, want)
        theirs = rescorer.logprobs(other, min(version, max(other.sent)), r)
        assert np.max(np.abs(got - theirs)) > APART, f"{r.rollout_id} also fits {other.namespace}'s adapter"


def _info(address: str):
    with SyncRolloutClient(address) as c:
        return c.info()


def _heartbeat(url: str, namespace: str | StreamKeys, replica_id: str) -> dict:
    keys = namespace if isinstance(namespace, StreamKeys) else StreamKeys(namespace)
    raw = redis.Redis.from_url(url).get(keys.replica(replica_id))
    assert raw is not None, f"{replica_id} has no heartbeat in {keys.namespace}"
    return json.loads(raw)


def _served_by_heartbeat(url: str, namespace: str, replica_id: str) -> tuple[str, int]:
    beat = _heartbeat(url, namespace, replica_id)
    return beat["run_id"], beat["policy_version"]


@pytest.fixture(scope="module")
def fleet(model_dir, redis_url, tmp_path_factory):
    """Two replicas serving both namespaces, and a trainer per run at version 0 (pushed to both)."""
    reps = {name: _replica(model_dir, redis_url, name).start() for name in ("rep-1", "rep-2")}
    trainers: list[Trainer] = []
    try:
        wait_all(reps.values(), timeout=240)
        for name in reps:  # registered in both namespaces before the trainers start
            deadline = time.monotonic() + 30
            while True:
                try:
                    _heartbeat(redis_url, NS_A, name)
                    _heartbeat(redis_url, NS_B, name)
                    break
                except AssertionError:
                    assert time.monotonic() < deadline, f"{name} never registered in both namespaces"
                    time.sleep(0.1)
        trainers = [Trainer(model_dir, redis_url, NS_A, seed=1), Trainer(model_dir, redis_url, NS_B, seed=2)]
        for t in trainers:
            t.start()
        yield {
            "replicas": reps,
            "a": trainers[0],
            "b": trainers[1],
            "rescorer": Rescorer(model_dir, tmp_path_factory.mktemp("merged")),
            "prompt": encode_text(model_dir, "count:"),
            "redis_url": redis_url,
        }
    finally:
        for t in trainers:
            t.close()
        stop_all(reps.values(), timeout=30)


def test_two_runs_on_two_replicas_each_sample_with_their_own_adapter(fleet):
    a, b, rescorer, prompt = fleet["a"], fleet["b"], fleet["rescorer"], fleet["prompt"]
    for address in (r.address for r in fleet["replicas"].values()):
        served = {i.namespace: (i.run_id, i.version) for i in _info(address).adapters}
        assert served == {NS_A: (a.run_id, 0), NS_B: (b.run_id, 0)}
    records = {NS_A: [], NS_B: []}
    for round_ in range(2):  # version 0 of both adapters, then version 1 of both
        if round_:
            assert a.publish() == {"rep-1": "ok", "rep-2": "ok"}
            assert b.publish() == {"rep-1": "ok", "rep-2": "ok"}
        for _ in range(3):  # interleaved: A, B, A, B, ...
            a.submit(prompt, 2)
            b.submit(prompt, 2)
        records[NS_A] += a.collect(12)
        records[NS_B] += b.collect(12)
    for ns, trainer, other in ((NS_A, a, b), (NS_B, b, a)):
        got = records[ns]
        assert Counter(r.policy_version_first for r in got) == {0: 12, 1: 12}
        _check_records(got, trainer, other, rescorer)
    both = Counter(r.replica_id for rs in records.values() for r in rs)
    assert set(both) == {"rep-1", "rep-2"}, both  # the same two replicas served both runs
    # each namespace's registry heartbeat reports the run and version it is served (heartbeats are
    # periodic: read until the latest one says so, or show what the replica serves)
    for name, rep in fleet["replicas"].items():
        for ns, trainer in ((NS_A, a), (NS_B, b)):
            deadline = time.monotonic() + 15
            while (got := _served_by_heartbeat(fleet["redis_url"], ns, name)) != (trainer.run_id, 1):
                assert time.monotonic() < deadline, (name, ns, got, _info(rep.address).adapters)
                time.sleep(0.2)


def test_a_replica_started_mid_run_joins_each_namespace_at_its_current_adapter(fleet, model_dir, redis_url):
    a, b, rescorer, prompt = fleet["a"], fleet["b"], fleet["rescorer"], fleet["prompt"]
    for t in (a, b):  # a version of each run that the first two replicas serve, the newcomer not
        t.publish()
    va, vb = a.queue.policy_version, b.queue.policy_version
    late = _replica(model_dir, redis_url, "rep-3")
    try:
        late.start().wait_ready(240)  # ready only once both namespaces have joined
        served = {i.namespace: (i.run_id, i.version) for i in _info(late.address).adapters}
        assert served == {NS_A: (a.run_id, va), NS_B: (b.run_id, vb)}
        log = late.log_text()
        assert f"joined run {a.run_id} (namespace {NS_A!r}) at version {va}" in log
        assert f"joined run {b.run_id} (namespace {NS_B!r}) at version {vb}" in log
        for ns, trainer, v in ((NS_A, a, va), (NS_B, b, vb)):
            beat = _heartbeat(redis_url, ns, "rep-3")
            assert (beat["run_id"], beat["policy_version"]) == (trainer.run_id, v)
        # the first two leave: the newcomer alone serves both runs, each with its current adapter
        stop_all(fleet["replicas"].values(), timeout=30)
        a.submit(prompt, 2)
        b.submit(prompt, 2)
        got_a, got_b = a.collect(4), b.collect(4)
        assert {r.replica_id for r in got_a + got_b} == {"rep-3"}
        assert {r.policy_version_first for r in got_a} == {va} and {
            r.policy_version_first for r in got_b
        } == {vb}
        _check_records(got_a, a, b, rescorer)
        _check_records(got_b, b, a, rescorer)
    finally:
        late.stop(timeout=30)


def test_the_replica_serves_once_every_namespace_has_joined(model_dir, redis_url):
    """In process: namespace fleet-d (whose trainer recorded 2 partitions: its own layout, beside
    fleet-c's one) has an invalid run record. The replica stays NOT_SERVING, its reason naming that
    namespace, while fleet-c (joined) already pulls its jobs; once the record is fixed the namespace
    joins (retried every JOIN_RETRY_S) and the replica serves."""
    import asyncio

    from maskroll.server.app import problems, start
    from maskroll.server.config import ServerConfig

    ns_c, ns_d = "fleet-c", "fleet-d"
    raw = redis.Redis.from_url(redis_url)
    keys_c, keys_d = StreamKeys(ns_c), StreamKeys(ns_d, partitions=2)
    raw.set(keys_d.layout, 2)
    now = repr(time.time())
    record = {"run_id": "0123456789abcdef0123456789abcdef", "started_at": now, "updated_at": now}
    raw.hset(keys_d.run, mapping={**record, "version": "abc"})
    config = ServerConfig(
        model=model_dir,
        engine="torch",
        port=0,
        replica_id="rep-join",
        redis_url=redis_url,
        namespace=ns_c,
        lora_namespaces=(ns_d,),
        max_lora_rank=8,
        pull=True,
        drain_timeout_s=1,
    )

    async def main():
        replica = await start(config)
        try:
            c, d = replica.namespaces
            assert (c.keys, d.keys) == (keys_c, keys_d)
            assert c.puller_task is not None and d.puller_task is None  # c pulls; d waits for its run
            found = problems(replica)
            assert len(found) == 1 and found[0].startswith(
                f"namespace {ns_d!r}: cannot join the training run"
            )
            assert f"{keys_d.run}: version" in found[0]  # the tagged key of its 2-partition layout
            raw.hset(keys_d.run, "version", "0")  # valid, nothing published: the base serves
            deadline = time.monotonic() + 30
            while problems(replica):
                assert time.monotonic() < deadline, problems(replica)
                await asyncio.sleep(0.1)
            assert d.puller_task is not None and replica.core.not_ready is None
            for keys in (keys_c, keys_d):  # each namespace has its heartbeat: the base, no run yet
                beat = _heartbeat(redis_url, keys, "rep-join")
                assert (beat["run_id"], beat["policy_version"]) == ("", 0)
        finally:
            await replica.drain(timeout_s=0)

    asyncio.run(main())
