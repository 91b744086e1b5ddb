"""One Publisher protocol, one factory, and the weight calls that take the queue — without Redis: which
publisher each transport makes, what the factory refuses, that every publisher has the protocol's
members, and that the blocking weight calls have their async forms' signatures. The same publishers
against real replicas: tests/weight_sync/test_stream.py and test_nccl.py, tests/server/weights/test_join.py
and tests/queue/test_run_lifecycle.py."""

from __future__ import annotations

import inspect
import typing

import pytest
import torch

from maskroll.client import RunInfo
from maskroll.weight_sync import (
    CheckpointPublisher,
    CpuTransport,
    NcclPublisher,
    Publisher,
    StreamPublisher,
    broadcast,
    make_publisher,
)
from maskroll.weight_sync.factory import OPTIONS, TRANSPORTS


class _Queue:
    """What the publishers' constructors touch of a queue: nothing but the object itself."""

    run = RunInfo("run-a")
    policy_version = 0


def test_each_transport_makes_its_publisher_with_the_common_arguments(tmp_path):
    pub = make_publisher("directory", _Queue(), root=tmp_path, keep=3, timeout=7.0, require_all=False)
    assert isinstance(pub, CheckpointPublisher)
    assert (pub.root, pub.keep, pub.timeout, pub.require_all) == (tmp_path.absolute(), 3, 7.0, False)
    pub = make_publisher("stream", _Queue(), root=tmp_path, keep=3, follow_s=None, chunk_bytes=4096)
    assert isinstance(pub, StreamPublisher)
    assert (pub.save_root, pub.keep, pub.timeout, pub.chunk_bytes) == (str(tmp_path), 3, 120.0, 4096)
    assert make_publisher("stream", _Queue(), follow_s=None).save_root is None  # no copy kept
    model = torch.nn.Linear(2, 2)
    pub = make_publisher("nccl", _Queue(), model=model, master_address="10.0.0.1", master_port=29600)
    assert isinstance(pub, NcclPublisher) and pub.model is model and pub.timeout == 600.0


def test_the_factory_refuses_what_a_transport_cannot_use(tmp_path):
    expected = "transport='nfs'; expected one of 'directory', 'stream', 'nccl'$"
    with pytest.raises(ValueError, match=expected):
        make_publisher("nfs", _Queue(), root=tmp_path)
    with pytest.raises(ValueError, match="'directory' needs root"):
        make_publisher("directory", _Queue())
    with pytest.raises(ValueError, match="'nccl' keeps no copy"):
        make_publisher("nccl", _Queue(), root=tmp_path, model=None, master_address="h", master_port=1)
    # the NCCL transport's old name is refused with its new one (collective= is the ranks' control plane)
    with pytest.raises(ValueError, match=r"transport='collective'; .* \(the NCCL transport is 'nccl'\)"):
        make_publisher("collective", _Queue(), model=None, master_address="h", master_port=1)


def test_a_keyword_of_another_transport_is_refused_naming_it_and_the_transport(tmp_path):
    with pytest.raises(
        ValueError, match=r"^transport 'directory' takes no follow_s \(follow_s: stream only\)$"
    ):
        make_publisher("directory", _Queue(), root=tmp_path, follow_s=None)  # None is a value: no follower
    with pytest.raises(ValueError, match=r"^transport 'stream' takes no model, packed \(model: nccl only; "):
        make_publisher("stream", _Queue(), model=torch.nn.Linear(2, 2), packed=False)
    with pytest.raises(ValueError, match=r"transport 'nccl' takes no keep \(keep: directory / stream only\)"):
        make_publisher("nccl", _Queue(), keep=2, model=None, master_address="h", master_port=1)
    with pytest.raises(ValueError, match=r"^transport 'nccl' needs master_address, master_port$"):
        make_publisher("nccl", _Queue(), model=torch.nn.Linear(2, 2))
    # held=None and follow_s=None are values the stream takes, not "left out"
    pub = make_publisher(
        "stream", _Queue(), follow_s=None, held=None, resume_from_base=True, require_all=False
    )
    assert (pub.held, pub.resume_from_base, pub.require_all, pub._follower) == (None, True, False, None)


def test_every_keyword_of_the_factory_belongs_to_a_publisher_that_takes_it():
    params = inspect.signature(make_publisher).parameters
    own = {"transport", "queue", "collective", "root", "timeout"}
    inits = {
        "directory": CheckpointPublisher.__init__,
        "stream": StreamPublisher.__init__,
        "nccl": NcclPublisher.__init__,
    }
    assert set(OPTIONS) == set(TRANSPORTS) == set(inits)
    assert set(params) - own == set().union(*OPTIONS.values())
    for transport, names in OPTIONS.items():
        taken = set(inspect.signature(inits[transport]).parameters)
        assert names <= taken, (transport, names - taken)
    assert typing.get_args(CpuTransport) == ("stream", "directory")  # the recipes' choices, in --help order
    assert set(typing.get_args(CpuTransport)) < set(TRANSPORTS)


@pytest.mark.parametrize("cls", [CheckpointPublisher, StreamPublisher, NcclPublisher])
def test_every_publisher_has_the_protocols_members(cls):
    assert isinstance(inspect.getattr_static(cls, "version"), property)
    for name in ("start", "publish", "close"):
        assert callable(getattr(cls, name)), name
    assert list(inspect.signature(cls.start).parameters)[:2] == ["self", "model"]
    assert list(inspect.signature(cls.publish).parameters) == ["self", "model", "version"]
    assert inspect.signature(cls.publish).parameters["version"].default is None
    assert {"version", "start", "publish", "close"} <= set(dir(Publisher))


@pytest.mark.parametrize("name", ["broadcast_weights", "push_weights", "sync_replicas", "replica_weights"])
def test_the_blocking_weight_calls_have_the_async_signatures(name):
    sync, async_ = getattr(broadcast, name), getattr(broadcast, f"{name}_async")
    assert inspect.signature(sync).parameters == inspect.signature(async_).parameters
    assert sync.__doc__ == async_.__doc__ and sync.__name__ == name
    assert next(iter(inspect.signature(sync).parameters)) == "queue"
