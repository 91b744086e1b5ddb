"""A private Redis per test module (LocalRedis: free loopback port, stopped by PID)."""

from __future__ import annotations

import pytest

from maskroll.client.local_redis import LocalRedis


@pytest.fixture(scope="module")
def redis_server():
    with LocalRedis(appendonly=True) as r:
        yield r


@pytest.fixture
def namespace(request) -> str:
    return request.node.name.replace("[", "-").replace("]", "")[:60]
