"""Hostile Generate requests against a real `maskroll serve` process: each is refused with a clear
error, writes nothing where it must not, and the same process serves the next request normally with
its health still SERVING.

Regressions of issue 11: a temperature of 1e-40 passed validation and killed the torch engine's decode
thread (every later request hung, health said SERVING); metadata was unbounded (1.3 MB in, 82.5 MB out
with n = 64); `rollout_stream` could name any Redis key.
"""

from __future__ import annotations

import grpc
import pytest
import redis
from hardening_fixtures import NAMESPACE, assert_refused_then_served, raw_generate, request, served

from maskroll.client import SamplingOptions
from maskroll.proto.streams import StreamKeys

pytestmark = pytest.mark.slow
KEYS = StreamKeys(NAMESPACE)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def raw(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    yield r
    r.close()


@pytest.mark.parametrize("temperature", [1e-40, 1e-36, 5e-324])
def test_a_temperature_float32_cannot_divide_by_is_refused(replica, temperature):
    msg = assert_refused_then_served(
        replica.address,
        request(temperature=temperature),
        INVALID,
        "temperature must be >= 2.94e-35 for the torch engine",
    )
    assert f"got {temperature:g}" in msg
    assert replica.health() == "SERVING"


def test_a_tiny_temperature_float32_can_represent_is_served(replica):
    # 1e-30: ℓ / T stays finite, so the engine samples (all but greedily) instead of refusing.
    assert served(replica.address, SamplingOptions(max_tokens=3, temperature=1e-30, ignore_eos=True)) == 3


def test_many_samples_at_a_refused_temperature_leave_the_engine_serving(replica):
    assert_refused_then_served(
        replica.address, request(temperature=1e-40, n=64), INVALID, "temperature must be >="
    )


METADATA = {
    "100k entries": ({f"k{i}": "v" for i in range(100_000)}, "metadata has 100000 entries; at most 64"),
    "a 10 MB value": ({"blob": "x" * 10_000_000}, "metadata['blob'] has 10000000 characters; at most 4096"),
    "a 1000-character key": ({"k" * 1000: "v"}, "has 1000 characters; at most 128"),
    "too much in all": ({f"k{i}": "v" * 300 for i in range(60)}, "characters in all; at most 16384"),
}


@pytest.mark.parametrize("case", sorted(METADATA))
def test_unbounded_metadata_is_refused(replica, case):
    metadata, needle = METADATA[case]
    req = request(n=64)
    req.metadata.update(metadata)
    msg = assert_refused_then_served(replica.address, req, INVALID, needle)
    assert len(msg) < 500, "the error message echoes the payload"


STREAMS = {
    "another run's rollout stream": "maskroll:other:rollouts",
    "the prompt stream": KEYS.prompts,
    "the dead-letter stream": KEYS.dead_letters,
    "the done set": KEYS.done,
    "a replica's heartbeat key": KEYS.replica("hard-1"),
    "a key outside maskroll": "victim",
    "an empty suffix": KEYS.rollouts + ":",
    "a nested suffix": KEYS.rollouts + ":a:b",
    "a 1 MB name": KEYS.rollouts + ":" + "x" * 1_000_000,
}


@pytest.mark.parametrize("case", sorted(STREAMS))
def test_rollout_stream_outside_the_namespace_is_refused_and_untouched(replica, raw, case):
    name = STREAMS[case]
    before = {k: raw.type(k) for k in (name, KEYS.prompts, KEYS.dead_letters, KEYS.done)}
    lengths = {k: raw.xlen(k) for k in (KEYS.prompts, KEYS.dead_letters) if raw.type(k) == b"stream"}
    req = request(n=2, ignore_eos=True)
    req.rollout_stream = name
    msg = assert_refused_then_served(
        replica.address, req, INVALID, "is not one of this replica's rollout streams"
    )
    assert len(msg) < 600, "the error message echoes a 1 MB name"
    assert {k: raw.type(k) for k in before} == before, f"{case}: a key changed type or appeared"
    assert {k: raw.xlen(k) for k in lengths} == lengths, f"{case}: the replica wrote to a stream"


def test_a_rollout_stream_below_the_namespace_receives_the_records(replica, raw):
    stream = KEYS.rollouts + ":eval-1"
    req = request(n=2, ignore_eos=True)
    req.rollout_stream = stream
    try:
        assert raw_generate(replica.address, req) == 2 * 4
        assert raw.xlen(stream) == 2
    finally:
        raw.delete(stream)
