"""Delta pushes for real: `maskroll serve --pull` replica processes (torch engine, bfloat16), one Redis and a
float32 trainer model published by StreamPublisher (dtype "auto": the replicas' bfloat16). A delta reaches
the replicas that serve its base and leaves them bit for bit where a full push would (equal digests'
fingerprints, equal tokens and logprobs for a fixed seed); a replica that missed a version, or joined
late, is sent the full version; a patch corrupted past its CRC is refused by its digest, the replica
serving on, and the trainer sends that replica the full version instead."""

from __future__ import annotations

import signal

import pytest
import torch
from procs import Replicas
from push_helpers import flip_last_byte, past_crc, wait_replicas

from maskroll.client import RolloutQueue, SamplingOptions, SyncRolloutClient
from maskroll.local.redis_server import LocalRedis
from maskroll.weight_sync import delta
from maskroll.weight_sync.broadcast import replica_weights
from maskroll.weight_sync.stream import StreamPublisher

pytestmark = pytest.mark.slow

NS = "delta"


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("delta")
    with LocalRedis() as srv:
        reps = Replicas(model_dir, srv.url, NS, log_dir=base)
        for name in ("rep-0", "rep-1"):
            reps.start(name, "--dtype", "bfloat16")
        try:
            reps.wait_ready()
            yield srv.url, reps
        finally:
            reps.stop_all()


def _step(model, seed: int, lr: float = 1e-5) -> None:
    """An Adam-like step: every float32 weight moves by about lr, so only the bf16 elements near a rounding
    boundary change (a few percent of them)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g).sign() * lr)


def _fingerprints(q) -> dict[str, str]:
    return {r: w.fingerprint for r, w in replica_weights(q).items()}


def _sample(address: str):
    with SyncRolloutClient(address) as c:
        rec = c.generate_record([256, 84, 104], SamplingOptions(max_tokens=12, logprobs_k=3, seed=11))
    return rec.policy_version_first, list(rec.completion_ids), rec.sampled_logprobs.tolist()


def test_a_delta_leaves_replicas_bit_for_bit_where_a_full_push_would_and_a_late_replica_gets_it_whole(
    cluster, model
):
    url, reps = cluster
    with RolloutQueue(url, NS, run="new", batch_size=2) as q:
        wait_replicas(q, 2)
        # dtype "auto" (the default): the replicas say they hold bfloat16 weights, so the trainer casts
        with StreamPublisher(q, follow_s=0.3, timeout=60) as pub:
            assert pub.start(model) == 0
            assert pub.dtype == torch.bfloat16
            _step(model, 1)
            assert pub.publish(model) == {"rep-0": "ok", "rep-1": "ok"}
            assert pub.last_pushed == {"rep-0": "delta", "rep-1": "delta"}
            full = pub._manifest.total_bytes
            assert full == sum(t.numel() * 2 for t in delta.replica_copy(model.state_dict(), None).values())
            # a few percent of the bf16 elements changed: patches, far below the full bytes
            assert 0 < pub.update_bytes[-1] < 0.35 * full, (pub.update_bytes, full)
            assert pub.fingerprint.startswith("wxh1:")
            assert _fingerprints(q) == {"rep-0": pub.fingerprint, "rep-1": pub.fingerprint}

            reps.start("rep-2", "--dtype", "bfloat16")  # joins at version 1: pushed it whole
            reps.wait_ready()
            assert _fingerprints(q)["rep-2"] == pub.fingerprint
            addresses = {r.replica_id: r.address for r in q.replicas()}
            delta_side, full_side = _sample(addresses["rep-0"]), _sample(addresses["rep-2"])
            assert delta_side[0] == 1 and delta_side == full_side
            assert pub.updates == {"delta": 2, "full": 1}


def test_a_replica_that_missed_a_version_is_sent_the_full_one_never_a_patch(cluster, model):
    url, reps = cluster
    with RolloutQueue(url, NS, run="resume", batch_size=2) as q:
        wait_replicas(q, 3)
        with StreamPublisher(
            q,
            dtype=torch.bfloat16,
            follow_s=None,
            timeout=8,
            require_all=False,
            held=(q.run_id, q.run.version),
        ) as pub:
            pub.start(model)
            v = q.run.version
            reps.procs["rep-1"].send_signal(signal.SIGSTOP)  # misses the next version
            try:
                _step(model, 2)
                results = pub.publish(model)
                assert results["rep-0"] == results["rep-2"] == "ok" and results["rep-1"] != "ok"
            finally:
                reps.procs["rep-1"].send_signal(signal.SIGCONT)
            _step(model, 3)
            assert pub.publish(model) == {"rep-0": "ok", "rep-1": "ok", "rep-2": "ok"}
            # rep-1 still served version v: a patch on v + 1 would be on the wrong base
            assert pub.last_pushed == {"rep-0": "delta", "rep-1": "full", "rep-2": "delta"}
            assert q.run.version == v + 2
            assert set(_fingerprints(q).values()) == {pub.fingerprint}


def test_a_patch_corrupted_past_its_crc_is_refused_by_its_digest_and_the_replica_gets_the_full_version(
    cluster, model, monkeypatch
):
    url, reps = cluster
    advance = delta.advance

    def corrupted(*args, **kwargs):  # one value of the first patch flipped, its CRC made to agree
        return past_crc(advance(*args, **kwargs), flip_last_byte)

    with RolloutQueue(url, NS, run="resume", batch_size=2) as q:
        wait_replicas(q, 3)
        held = (q.run_id, q.run.version)
        with StreamPublisher(q, dtype=torch.bfloat16, follow_s=None, timeout=30, held=held) as pub:
            pub.start(model)
            before = _sample({r.replica_id: r.address for r in q.replicas()}["rep-0"])
            monkeypatch.setattr(delta, "advance", corrupted)
            _step(model, 4)
            assert pub.publish(model) == {"rep-0": "ok", "rep-1": "ok", "rep-2": "ok"}
            assert pub.last_pushed == {"rep-0": "full", "rep-1": "full", "rep-2": "full"}
            assert set(_fingerprints(q).values()) == {pub.fingerprint}
            log = reps.log("rep-0").read_text()
            assert "would be" in log and "the trainer's is" in log and "refused" in log
            after = _sample({r.replica_id: r.address for r in q.replicas()}["rep-0"])
            assert after[0] == before[0] + 1  # the refused delta changed nothing; the full version serves
