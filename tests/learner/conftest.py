"""One private Redis, a tiny model and two pull-mode replicas (torch engine, `maskroll serve --pull`
subprocesses) shared by the data-parallel learner tests of a module; every process started here is
stopped here, by PID."""

from __future__ import annotations

import pytest
from learner_cluster import LearnerCluster


@pytest.fixture(scope="module")
def learner_cluster(tmp_path_factory):
    with LearnerCluster(tmp_path_factory.mktemp("learner")) as cluster:
        yield cluster
