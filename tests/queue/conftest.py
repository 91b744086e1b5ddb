"""A private Redis per test module (LocalRedis: free loopback port, stopped by PID); one private Redis
Cluster (3 masters + 3 replicas, LocalRedisCluster) for the whole session; one tiny model for every test
that starts replica processes."""

from __future__ import annotations

import pytest

from maskroll.local.redis_server import LocalRedis


@pytest.fixture(scope="module")
def redis_server():
    with LocalRedis(appendonly=True) as r:
        yield r


@pytest.fixture(scope="session")
def redis_cluster():
    from maskroll.local.redis_cluster import LocalRedisCluster

    with LocalRedisCluster() as c:
        yield c


@pytest.fixture
def namespace(request) -> str:
    return request.node.name.replace("[", "-").replace("]", "")[:60]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)
