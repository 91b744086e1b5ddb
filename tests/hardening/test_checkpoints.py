"""Bad checkpoints sent to a real `maskroll serve` process through UpdateWeights: refused with a clear
error, the old weights and version kept, the next request served, and a good checkpoint still loads.

Regressions of issue 11: a checkpoint whose tensors held NaN was accepted, the next Generate hung and
the recovery update hung too; a FIFO named model.safetensors froze the whole process.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from hardening_fixtures import NORMAL, PROMPT, served

from maskroll.client import RolloutClient, RolloutError

pytestmark = pytest.mark.slow


def _update(address: str, version: int, path) -> tuple[RolloutError | None, int]:
    """(the UpdateWeights error or None, the policy version after it)."""

    async def main():
        async with RolloutClient(address, timeout=20) as c:
            err = None
            try:
                await c.update_weights(version, path)
            except RolloutError as e:
                err = e
            return err, (await c.info()).policy_version

    return asyncio.run(main())


def _version_of_a_record(address: str) -> int:
    async def main():
        async with RolloutClient(address) as c:
            return (await c.generate_record(PROMPT, NORMAL, timeout=30)).policy_version_first

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("name", "code", "needle"),
    [
        ("nan", grpc.StatusCode.INVALID_ARGUMENT, "'model.norm.weight'"),
        ("inf", grpc.StatusCode.INVALID_ARGUMENT, "'model.norm.weight'"),
        ("fifo", grpc.StatusCode.INVALID_ARGUMENT, "model.safetensors is a FIFO"),
    ],
)
def test_a_bad_checkpoint_is_refused_and_the_old_weights_serve_on(replica, weights_root, name, code, needle):
    before = _update(replica.address, 0, weights_root / "v1")[1]  # version 0 is refused: just read it
    t0 = time.monotonic()
    err, after = _update(replica.address, before + 1, weights_root / name)
    assert time.monotonic() - t0 < 15, "the update hung"
    assert err is not None and err.code == code, err
    assert needle in err.message, err.message
    if name != "fifo":
        assert "1 non-finite values (NaN or inf); refused, the current weights are kept" in err.message
    assert after == before, "a refused checkpoint changed the version"
    assert served(replica.address) == NORMAL.max_tokens
    assert _version_of_a_record(replica.address) == before
    assert replica.health() == "SERVING"


def test_a_checkpoint_outside_the_root_is_permission_denied(replica, weights_root):
    version = _update(replica.address, 0, weights_root / "v1")[1]
    err, after = _update(replica.address, version + 1, weights_root.parent / "outside")
    assert (
        err.code == grpc.StatusCode.PERMISSION_DENIED and "not under the server's weights_root" in err.message
    )
    assert after == version and served(replica.address) == NORMAL.max_tokens


def test_after_the_refusals_a_good_checkpoint_loads(replica, weights_root):
    version = _update(replica.address, 0, weights_root / "v1")[1]
    err, after = _update(replica.address, version + 1, weights_root / "v2")
    assert err is None and after == version + 1
    assert _version_of_a_record(replica.address) == version + 1
