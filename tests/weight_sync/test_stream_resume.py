"""A resumed run on the stream transport without the trainer's own copy of its version, against a real
Redis (no replica needed): the publisher refuses to call the weights it holds version N — the base
weights a restarted trainer usually holds — unless told to take them explicitly, and then publishes them
as a new version N + 1 (recorded in the run), never as N."""

from __future__ import annotations

import pytest
import redis
import torch

from maskroll.client import RolloutQueue
from maskroll.local.redis_server import LocalRedis
from maskroll.proto.run_record import STREAM_CHECKPOINT
from maskroll.proto.streams import StreamKeys
from maskroll.weight_sync import make_publisher
from maskroll.weight_sync.checkpoint import checkpoint_dir
from maskroll.weight_sync.stream import StreamPublisher


@pytest.fixture(scope="module")
def redis_server():
    with LocalRedis() as r:
        yield r


def _run_at(url: str, ns: str, version: int) -> None:
    """A run whose trainer published `version` over the stream and then went away."""
    with RolloutQueue(url, ns, run="new", batch_size=2) as q:
        for v in range(1, version + 1):
            q.record_version(v, STREAM_CHECKPOINT)


def _version_of(url: str, ns: str) -> tuple[int, bytes]:
    h = redis.Redis.from_url(url).hgetall(StreamKeys(ns).run)
    return int(h[b"version"]), h[b"checkpoint"]


def test_resume_without_a_local_copy_refuses_to_call_the_base_weights_version_n(redis_server):
    ns = "resume-refused"
    _run_at(redis_server.url, ns, 3)
    with RolloutQueue(redis_server.url, ns, run="resume", batch_size=2) as q:
        pub = StreamPublisher(q, follow_s=None)
        with pytest.raises(RuntimeError) as e:
            pub.start(torch.nn.Linear(2, 2))
        message = str(e.value)
        assert "version 3" in message and "save_root" in message and "weights_root" in message
        assert "resume_from_base=True" in message
        assert q.policy_version == 3  # nothing recorded, nothing taken as version 3
    assert _version_of(redis_server.url, ns) == (3, STREAM_CHECKPOINT.encode())


def test_resume_from_base_publishes_the_weights_as_a_new_version(redis_server, tmp_path):
    ns = "resume-from-base"
    _run_at(redis_server.url, ns, 3)
    with RolloutQueue(redis_server.url, ns, run="resume", batch_size=2) as q:
        # the factory passes the option through; an empty save_root is no copy of version 3 either
        pub = make_publisher("stream", q, root=tmp_path, follow_s=None, resume_from_base=True)
        model = torch.nn.Linear(2, 2)
        assert pub.start(model) == 4
        assert pub.version == q.policy_version == 4
        assert checkpoint_dir(tmp_path, 4).exists()  # the trainer's own copy of the new version
        assert pub._manifest.version == 4  # what a joining replica is pushed
    assert _version_of(redis_server.url, ns) == (4, STREAM_CHECKPOINT.encode())


def test_resume_with_a_local_copy_still_loads_it_as_version_n(redis_server, tmp_path):
    ns = "resume-own-copy"
    _run_at(redis_server.url, ns, 2)
    saved = torch.nn.Linear(2, 2)
    from maskroll.weight_sync.checkpoint import save_checkpoint

    save_checkpoint(saved.state_dict(), tmp_path, 2)
    with RolloutQueue(redis_server.url, ns, run="resume", batch_size=2) as q:
        model = torch.nn.Linear(2, 2)
        assert StreamPublisher(q, save_root=tmp_path, follow_s=None).start(model) == 2
        assert torch.equal(model.weight, saved.weight)
    assert _version_of(redis_server.url, ns) == (2, STREAM_CHECKPOINT.encode())


def test_a_trainer_reopening_its_queue_in_the_same_process_keeps_the_version_it_published(redis_server):
    """TRL's evaluate after train: a new queue and publisher on the run an earlier publisher published
    version 1 of; told so (`held`), start() takes the model as version 1 with no copy on disk."""
    from maskroll.weight_sync import WeightSyncError

    ns = "resume-same-process"
    model = torch.nn.Linear(2, 2)
    with RolloutQueue(redis_server.url, ns, run="new", batch_size=2) as q:
        pub = StreamPublisher(q, follow_s=None)
        assert pub.start(model) == 0
        with pytest.raises(WeightSyncError, match="no live replica"):  # recorded, no replica to load it
            pub.publish(model)
        assert pub.held == (q.run_id, 1)
    with RolloutQueue(redis_server.url, ns, run="resume", batch_size=2) as q:
        assert StreamPublisher(q, follow_s=None, held=pub.held).start(model) == 1
    assert _version_of(redis_server.url, ns) == (1, STREAM_CHECKPOINT.encode())
