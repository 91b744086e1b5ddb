"""Join the training run at its current version: what a replica does at start-up, before it takes jobs.

The trainer records the run's latest version and how to fetch it in Redis (`maskroll:<ns>:run`, next
to the replica registry; docs/records.md "Runs"). A replica that starts or restarts mid-run reads it and,
before its puller takes a job, serves that version, so its first records are not from version 0 (which
the trainer would refuse as stale anyway, wasting the samples):

- `checkpoint` is a directory (the directory transport): load it from the replica's --weights-root,
  with every check UpdateWeights makes.
- `checkpoint` is STREAM_CHECKPOINT (the stream transport: only the trainer holds the weights): the replica
  registers its heartbeat and waits for the trainer's publisher to push the current version
  (weight_sync/stream.py: its follower pushes to every live replica not serving it), up to
  `join_timeout_s` seconds (--join-timeout-s / MASKROLL_JOIN_TIMEOUT_S, default 300).
- `checkpoint` is NCCL_CHECKPOINT (NCCL through vLLM's weight-transfer engine): the trainer's group was
  formed before this replica existed and cannot take it in, so nothing can bring it the version now;
  it says so and starts on its own weights.

If neither works (no weights root, a refused checkpoint, no push in time) the replica starts on its
own weights and says so in its log; the trainer's next publish brings it up to date.

A replica serving several namespaces (`--lora-namespaces`) joins each one's run (server/app.py runs the
joins side by side): "current" is then what that namespace is served (`ServedNamespace.weights_served`: its
run's current adapter), and a streamed run's wait registers that namespace's heartbeat, which its trainer's
follower finds. An adapter run's version only ever comes by push (a directory checkpoint would be full
weights: the replica refuses them, said in the log, and starts that namespace on the base).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from maskroll.proto.records import WeightsUpdate
from maskroll.proto.run_record import NCCL_CHECKPOINT, STREAM_CHECKPOINT, RunInfo, read_run

from ..errors import ServiceError
from .directory import DirectorySource

log = logging.getLogger("maskroll.weights")

POLL_S = 0.2


def _current(served: tuple[str, int], run: RunInfo) -> bool:
    run_id, version = served
    return run_id == run.run_id and version >= run.version


async def join_current_version(replica, ns=None) -> None:
    """Bring `replica` (an app.Replica, its puller not started yet) to its run's current version: the run
    of `ns` (a namespaces.ServedNamespace: one namespace it serves; default --namespace's)."""
    if replica.redis is None:
        return
    ns = ns if ns is not None else replica.namespaces[0]
    keys = ns.keys  # the layout app.py detected
    run = await read_run(replica.redis, keys)
    if run is None or not run.checkpoint or _current(ns.weights_served(replica.core), run):
        return  # no run, or nothing published: the replica's --model is what the run starts from
    if run.checkpoint == STREAM_CHECKPOINT:
        await _wait_for_push(replica, ns, run)
    elif run.checkpoint == NCCL_CHECKPOINT:
        log.warning(
            "weights: run %s%s is at version %d, broadcast over NCCL to a group this replica is not in; "
            "it starts on version 0 until its trainer forms a new group with it or pushes the weights",
            run.run_id,
            ns.label,
            run.version,
        )
    else:
        await _load_directory(replica, ns, run)


async def _load_directory(replica, ns, run: RunInfo) -> None:
    where = f"version {run.version} of run {run.run_id}{ns.label} from {run.checkpoint}"
    try:
        source = DirectorySource.resolve(run.checkpoint, replica.config.weights_root)
        update = WeightsUpdate(version=run.version, checkpoint_dir=run.checkpoint, run_id=run.run_id)
        result = await replica.core.updates.load_source(update, source)
    except ServiceError as e:
        log.warning("weights: could not join at %s (%s: %s); starting on version 0", where, e.code, e)
        return
    log.info("weights: joined at %s in %.2f s", where, result.load_seconds)


async def _wait_for_push(replica, ns, run: RunInfo) -> None:
    if ns.puller is None:
        log.warning(
            "weights: run %s%s is at version %d, pushed by its trainer to registered replicas; this "
            "replica does not pull jobs, so it is not registered: it starts on version 0",
            run.run_id,
            ns.label,
            run.version,
        )
        return
    timeout = replica.config.join_timeout_s
    log.info(
        "weights: run %s%s is at version %d (streamed); registered, waiting up to %.0f s for its push",
        run.run_id,
        ns.label,
        run.version,
        timeout,
    )
    # The puller's heartbeat alone (no job is taken): the trainer's publisher finds replicas by it.
    beat = asyncio.create_task(ns.puller.heartbeat(), name=f"join-heartbeat-{ns.namespace}")
    t0 = time.monotonic()
    try:
        # A new run of the namespace meanwhile (its record names another run id) is simply the run to
        # wait for: its first push replaces the old run's adapters (the AdapterTable's rule), nothing
        # here holds on to the old run.
        while not _current(ns.weights_served(replica.core), run):
            if time.monotonic() - t0 > timeout:
                log.warning(
                    "weights: no push of version %d of run %s%s within %.0f s; starting on version %d",
                    run.version,
                    run.run_id,
                    ns.label,
                    timeout,
                    ns.weights_served(replica.core)[1],
                )
                return
            await asyncio.sleep(POLL_S)
            run = await read_run(replica.redis, ns.keys) or run  # a newer version, or a new run
        log.info(
            "weights: joined run %s%s at version %d after %.1f s",
            run.run_id,
            ns.label,
            run.version,
            time.monotonic() - t0,
        )
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
