"""The GRPO recipe on 2 trainer ranks under torchrun (gloo), against real replicas and Redis.

A plain run: every step both ranks train on disjoint shares of whole groups at the same policy version,
the replicas advance, and every record trained is acked exactly once. A rank SIGKILLed mid-step, then
torchrun's elastic restart (`--max-restarts 1`, the recipe resumes the run): no record lost, none
trained twice in the published lineage, the versions continue to the run's length.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from learner_cluster import LOGPROBS_K, NAMESPACE, SCRIPT, read_trace

from maskroll.recipes.config import GRPOConfig
from maskroll.recipes.grpo_launch import train_ranks
from maskroll.trainer_adapter.config import MaskConfig

pytestmark = pytest.mark.slow

STEPS = 4
CFG = GRPOConfig(
    steps=STEPS,
    prompts_per_step=3,  # 3 groups over 2 ranks: balanced by tokens, never split
    n=4,
    max_tokens=6,
    logprobs_k=LOGPROBS_K,
    eval_prompts=1,
    eval_n=1,
    mask=MaskConfig(method="predictive"),
)

KILL_CFG = replace(CFG, max_staleness=STEPS)


def _run(
    cluster, tmp_path, kill: str = "", restarts: int = 0, cfg: GRPOConfig = CFG, sharding: str = "ddp"
) -> tuple[dict, list[dict], set[str]]:
    trace = tmp_path / "trace"
    trace.mkdir()
    acked_before = cluster.acked_ids()
    summary = train_ranks(
        cfg,
        ranks=2,
        log=tmp_path / "ranks.log",
        max_restarts=restarts,
        target=str(SCRIPT),
        env={"LEARNER_TRACE": str(trace), "LEARNER_KILL": kill},
        redis_url=cluster.url,
        namespace=NAMESPACE,
        model_dir=cluster.model_dir,
        weights_root=tmp_path / "weights",
        min_replicas=2,
        run="new",
        sharding=sharding,
    )
    return summary, read_trace(trace), cluster.acked_ids() - acked_before


def _lineage(events: list[dict]) -> dict[int, list[dict]]:
    """{version: the "published" events of the step that published it, one per rank}: the records each
    version of the final model was trained on (a step killed before its publish is not in it)."""
    out: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e["point"] == "published":
            out[e["version"]].append(e)
    return out


def _check_lineage(lineage: dict[int, list[dict]]) -> list[str]:
    """Both ranks at each version, disjoint shares, no group on two ranks; returns every trained id."""
    assert sorted(lineage) == list(range(1, STEPS + 1))
    trained: list[str] = []
    for version, events in lineage.items():
        assert sorted(e["rank"] for e in events) == [0, 1], (version, events)
        assert all(e["rollout_ids"] for e in events)  # each rank had a share
        groups = [set(e["groups"]) for e in events]
        assert not groups[0] & groups[1], f"version {version}: a group was split between ranks"
        trained += [rid for e in events for rid in e["rollout_ids"]]
    return trained


@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_two_ranks_train_whole_groups_at_one_version(learner_cluster, tmp_path, sharding):
    # fsdp2: each rank holds half of every layer; a version is gathered one parameter at a time
    summary, events, acked = _run(learner_cluster, tmp_path, sharding=sharding)
    assert summary["trainer_ranks"] == 2 and summary["restarts"] == 0
    # every rank saw the same version at every point of every step
    by_point = defaultdict(set)
    for e in events:
        by_point[(e["step"], e["point"])].add(e["version"])
    assert all(len(v) == 1 for v in by_point.values()), by_point
    assert [by_point[(s, "published")] for s in range(1, STEPS + 1)] == [{s} for s in range(1, STEPS + 1)]
    trained = _check_lineage(_lineage(events))
    # every record trained once, each global batch whole groups of 4, and acked exactly once
    assert len(trained) == len(set(trained)) == STEPS * CFG.batch_size
    assert acked == set(trained)
    assert summary["queue"]["acked"] == len(trained)
    # the replicas advanced with the run and both served it
    assert summary["replica_versions"] == {"rep-a": STEPS, "rep-b": STEPS}
    assert [s["policy_version"] for s in summary["steps"]] == list(range(1, STEPS + 1))


@pytest.mark.parametrize(
    "kill",
    [
        "1:2:read",  # rank 1 holds its share of step 2 and dies before training: the step never publishes
        "0:2:published",  # rank 0 dies after publishing version 2, before acking its batch
    ],
)
def test_killed_rank_elastic_restart_exactly_once(learner_cluster, tmp_path, kill):
    # a staleness bound no record reaches: the killed step's records come back trainable (with the
    # default bound, after a restart they can come back too stale and be dropped, which hides the path)
    summary, events, acked = _run(learner_cluster, tmp_path, kill=kill, restarts=1, cfg=KILL_CFG)
    assert summary["restarts"] == 1
    first = [e for e in events if e["life"] == 0]
    second = [e for e in events if e["life"] == 1]
    _, killed_step, point = kill.split(":")
    # the killed step's records, as the ranks held them in the first life
    reads = [e for e in first if e["step"] == int(killed_step) and e["point"] == "read"]
    held = {rid for e in reads for rid in e["rollout_ids"]}
    assert len(held) == CFG.batch_size
    lineage = _lineage(events)
    trained = _check_lineage(lineage)
    assert len(trained) == len(set(trained)), "a record was trained twice in the published lineage"
    assert held <= set(trained), "a record of the killed step was lost"
    if point == "read":  # nothing of step 2 was published: the second life trains it, from version 1
        assert {e["version"] for e in first if e["point"] == "published"} == {1}
        assert min(e["step"] for e in second) == 2
    else:  # version 2 was published with them: the second life acks them untrained, starts at step 3
        assert set().union(*(e["rollout_ids"] for e in lineage[2] if e["life"] == 0)) == held
        assert min(e["step"] for e in second) == 3
        assert not held & {rid for e in second for rid in e["rollout_ids"]}
        log = (tmp_path / "ranks.log").read_text()
        assert f"acked {CFG.batch_size} records a published version already trained on" in log
    # every trained record acked once, none acked that was not trained, none of the killed step's left
    assert acked == set(trained)
    assert not held & learner_cluster.stream_ids()
    assert summary["replica_versions"] == {"rep-a": STEPS, "rep-b": STEPS}
