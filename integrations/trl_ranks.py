"""MaskrollGRPOTrainer's ranks under `accelerate launch --num_processes W` (issue 21): rank 0 reads, scatters.

Only rank 0 holds the rollout source (`rollouts.QueueSource`: the RolloutQueue with its admission rule,
in-flight limit, staleness check, acks, the run and its version, and the job ledger with the dataset rows
TRL's reward functions need). At every generation batch:

- **submit**: accelerate gives each rank its own batches of the dataloader (rank r: batches r, r + W, …);
  `gather_rows` puts the W batches back together in rank order — the global generation batch, whole
  groups in a row — and rank 0 submits its jobs. Whether there is room to read ahead is rank 0's answer,
  broadcast (`main_answer`), so every rank reads ahead exactly as far.
- **take**: `take_shares` — rank 0 takes the *global* batch (whole groups, one staleness check against one
  policy version), splits it by groups balanced by completion tokens (`client.batching.split_groups`) and
  scatters each rank its groups with their jobs.
- **advantages**: `gather_rewards` gives every rank the whole batch's rewards, so TRL's batch-level
  scaling sees the global batch exactly as TRL itself does (it gathers too).
- **ack**: after every rank's optimiser step (`all_stepped`: a barrier), rank 0 acks the global batch.

The same rank-0 rule as `client.ranks.RankedQueue` (which trains on bare records: TRL needs the rows that
travel with each job, so the trainer keeps QueueSource and scatters (group, job) pairs itself). An error
on rank 0 is raised on every rank (`client.ranks.RankFailed` elsewhere): the others would otherwise wait
in the next collective. Objects go through the `Collective` (gloo); knows nothing of TRL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from maskroll.client.batching import group_key, split_groups
from maskroll.client.ranks import Collective, RankFailed

from .rollouts import Group, Job, _Source

T = TypeVar("T")


def main_answer(collective: Collective, fn: Callable[[], T]) -> T:
    """fn() run on rank 0 only, its value broadcast to every rank (a collective). Rank 0's exception is
    raised there and, as RankFailed naming it, on every other rank."""
    if collective.world_size == 1:
        return fn()
    outcome: tuple[str, Any] = ("ok", None)
    if collective.rank == 0:
        try:
            outcome = ("ok", fn())
        except Exception as e:  # re-raised below on every rank, never swallowed
            collective.broadcast(("error", f"{type(e).__name__}: {e}"))
            raise
    sent = collective.broadcast(outcome if collective.rank == 0 else None)
    kind, value = sent
    if kind == "error":
        raise RankFailed(f"rank 0 failed: {value}")
    return value


def _scatter_from_main(collective: Collective, fn: Callable[[], list]) -> Any:
    """fn() on rank 0 gives one object per rank; rank i gets the i-th (a collective; errors as above)."""
    if collective.world_size == 1:
        return fn()[0]
    if collective.rank != 0:
        kind, value = collective.scatter(None)
        if kind == "error":
            raise RankFailed(f"rank 0 failed: {value}")
        return value
    try:
        parts = fn()
    except Exception as e:  # re-raised on every rank
        collective.scatter([("error", f"{type(e).__name__}: {e}")] * collective.world_size)
        raise
    return collective.scatter([("ok", p) for p in parts])[1]


def gather_rows(collective: Collective, rows: list) -> list:
    """Every rank's dataloader batch, concatenated in rank order: the global generation batch (a
    collective; each rank's batch is whole groups, so the groups stay in a row)."""
    if collective.world_size == 1:
        return rows
    return [row for part in collective.all_gather(rows) for row in part]


def _by_group(share: Sequence) -> list[Group]:
    groups: dict[str, Group] = {}
    for rec in share:
        groups.setdefault(group_key(rec), []).append(rec)
    return list(groups.values())


def take_shares(
    collective: Collective,
    source: _Source | None,
    count: int,
    version: int,
    refill: Callable[[], object] | None = None,
) -> tuple[list[tuple[Group, Job]], list[Group]]:
    """This rank's (group, job) pairs of the next global batch of `count` × W records, and (rank 0 only,
    [] elsewhere) the global batch's groups, which rank 0 acks once every rank has stepped (a collective).
    Every share holds at least one group: a batch with fewer groups than ranks is refused on every rank.
    refill: rank 0's top-up while it waits (`_Source.take`); rank 0's alone, so no collective in it."""
    w = collective.world_size
    taken_all: list[Group] = []

    def split() -> list:
        taken = source.take(count * w, version, refill)
        taken_all.extend(g for g, _ in taken)
        jobs = {g[0].job_id: job for g, job in taken}
        shares = split_groups([r for g, _ in taken for r in g], w)
        if any(not s for s in shares):
            raise ValueError(
                f"a generation batch of {len(taken)} groups cannot give each of {w} ranks a share: "
                "per_device_train_batch_size × steps_per_generation must hold whole groups"
            )
        return [[(g, jobs[g[0].job_id]) for g in _by_group(share)] for share in shares]

    mine = _scatter_from_main(collective, split)
    return mine, taken_all


def generate_on_main(
    collective: Collective, source: _Source | None, asks: list[tuple[list[int], int]]
) -> list:
    """Evaluation: each rank's (prompt_ids, n) asks, sampled on rank 0's source (one replica, never
    queued), each rank's groups back in its order (a collective)."""
    if collective.world_size == 1:
        return [source.generate_now(p, n) for p, n in asks]
    every = collective.all_gather(asks)
    return _scatter_from_main(collective, lambda: [[source.generate_now(p, n) for p, n in a] for a in every])


def gather_rewards(collective: Collective, rewards_per_func: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """The global batch's rewards [B_all, F] (ranks in order) and this rank's rows in it (a collective)."""
    if collective.world_size == 1:
        return rewards_per_func, slice(0, rewards_per_func.shape[0])
    parts = collective.all_gather(rewards_per_func.detach().cpu())
    start = sum(p.shape[0] for p in parts[: collective.rank])
    everything = torch.cat(parts).to(rewards_per_func.device)
    return everything, slice(start, start + rewards_per_func.shape[0])


def all_stepped(collective: Collective, ack: Callable[[], None]) -> None:
    """After this rank's optimiser step: wait for every rank, then `ack` on rank 0 (a collective; an
    error there is raised on every rank)."""
    if collective.world_size > 1:
        collective.barrier()
    main_answer(collective, ack)
