"""weight_sync/versions.py: the rules every publisher takes — the version a publish makes current, a
version's per-replica results, a new run's version 0 with no replica live yet."""

from __future__ import annotations

import pytest

from maskroll.weight_sync.versions import WeightSyncError, checked, next_version, publish_first


def test_a_publish_moves_the_run_forward_and_only_version_0_repeats() -> None:
    assert next_version(4, None) == 5 and next_version(4, 9) == 9
    assert next_version(0, 0) == 0  # a run's starting weights may be published again while it is at 0
    for last, version in ((4, 4), (4, 3)):
        with pytest.raises(ValueError, match=f"version {version} does not move the run forward"):
            next_version(last, version)


def test_results_raise_when_no_replica_serves_the_version_or_any_failed_with_require_all() -> None:
    mixed = {"a": "ok", "b": "adopted", "c": "unchanged", "d": "timeout"}
    assert checked(3, mixed, require_all=False) == mixed
    with pytest.raises(
        WeightSyncError, match=r"policy version 3 was not loaded by every replica \(d: timeout\)"
    ):
        checked(3, mixed, require_all=True)
    with pytest.raises(WeightSyncError) as e:
        checked(3, {"d": "timeout"}, require_all=False)  # nobody serves it
    assert (e.value.failed, e.value.results) == ({"d": "timeout"}, {"d": "timeout"})
    with pytest.raises(WeightSyncError, match="no live replica in the namespace"):
        checked(3, {}, require_all=False)


def test_a_new_runs_version_0_is_no_error_before_any_replica_is_live() -> None:
    def nobody(model, version):
        raise WeightSyncError(version, {}, {})

    def refused(model, version):
        raise WeightSyncError(version, {"a": "INVALID_ARGUMENT"}, {"a": "INVALID_ARGUMENT"})

    assert publish_first(nobody, object()) == {}
    assert publish_first(lambda model, version: {"a": f"ok v{version}"}, object()) == {"a": "ok v0"}
    with pytest.raises(WeightSyncError, match="a: INVALID_ARGUMENT"):
        publish_first(refused, object())
