"""The replica's weight manager: which weights it serves, and every change to them, whoever asks.

Both front ends (gRPC's UpdateWeights / PushWeights, HTTP's /v1/weights) and the replica itself (the join
at start-up, weights/join.py) go through one `WeightUpdates`, so one set of rules holds:

- **The version rule, per run** (`check_version`): within the run the replica serves, versions
  increase; a version of another run is a reload (any version >= 0); an update without a run id (a
  client older than runs) must be greater than the current version. Checked when an update is asked
  (a push: on its manifest, before any byte) and again under the weights lock, which lets one update
  load at a time.
- **Once begun, an update runs to its end** even if its caller goes away (a deadline, a disconnect): a
  load cancelled halfway would leave the weights and the version to chance. The caller's own
  cancellation still propagates (the task is shielded, kept in `_tasks`).
- **Full weights are refused** on a replica serving several LoRA runs (`--lora-namespaces`): they would
  replace the base every namespace's adapters apply to. A load of full weights drops every adapter.
- **Adoption** (`AdoptSource`): the starting weights become version 0 of a new run, without a load,
  only when their fingerprint is the trainer's model's.
- **Deltas** (a push on a `base_version`, weights/delta.py): only on exactly that version of the run,
  asked on the manifest and again under the lock; the engine verifies every tensor before it serves.
- **The weights fingerprint** (GetInfo's, the heartbeat's): the starting weights' while they serve; after
  a push whose every tensor carried its digest and arrived in the engine's dtype, the digests' (the
  trainer computes the same for the version: equal means equal bit for bit); "" otherwise.
- **Adapters** (a push with an adapter): their rules and residency are the `AdapterTable`'s; this only
  receives and hands them over.
- A refused or failed update is logged with the client's strings cut short, and leaves the old weights
  serving.

Where an update's tensors come from is a `WeightSource`, one module per transport: directory.py (a
checkpoint under --weights-root), stream.py (a push), delta.py (a delta push), nccl.py (a broadcast).
Knows nothing of gRPC or HTTP; the errors are server/errors.py's, translated at the front ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from maskroll.proto.heap import trim_heap
from maskroll.proto.records import WeightsUpdate, WeightsUpdateResult
from maskroll.proto.tensor_push import WeightsManifest

from ..config import ServerConfig
from ..engines.contract import Engine
from ..errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable, message_of, shown
from ..generation import validation
from ..metrics import Metrics
from . import checkpoints, delta, stream
from .adapters import AdapterTable
from .directory import DirectorySource
from .nccl import NcclSource, join

log = logging.getLogger("maskroll.weights")


class WeightSource(Protocol):
    """Where an update's tensors come from (a transport's replica end)."""

    def describe(self) -> str:
        """For the log line of the update."""
        ...

    async def load(self, engine: Engine, version: int) -> tuple[int, float]:
        """Load into `engine` and make `version` current: (requests paused, seconds). InvalidArgument for
        bad content, with the old weights still serving."""
        ...

    def release(self) -> None:
        """Free what the source holds on this replica, loaded or refused."""
        ...


@dataclass
class Received:
    """A push whose bytes have all arrived and passed their checksums, not loaded yet (`apply`)."""

    update: WeightsUpdate
    manifest: WeightsManifest
    source: stream.StreamedSource | delta.DeltaSource | None = None  # full weights, or a delta
    tensors: dict | None = None  # an adapter's tensors


class WeightUpdates:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        metrics: Metrics,
        adapters: AdapterTable,
        draining: Callable[[], bool],
    ) -> None:
        self._engine, self._config, self._metrics = engine, config, metrics
        self.adapters = adapters
        self._draining = draining
        self._lock = asyncio.Lock()  # one load at a time: versions must increase
        self._tasks: set[asyncio.Task] = set()  # running updates (a task needs a strong reference)
        # The training run of the weights served ("" = the starting weights, or a client without runs):
        # the version rule is per run (docs/records.md, "Runs"), and records sampled from them carry it.
        self.run_id = ""
        self._fingerprint = ""  # of the weights loaded last, when verified (the module docstring)
        metrics.policy_version.set(engine.policy_version)

    @property
    def weights_served(self) -> tuple[str, int]:
        """(run id, policy version) of the weights this replica serves ("" = its starting weights)."""
        return self.run_id, self._engine.policy_version

    @property
    def weights_fingerprint(self) -> str:
        """Which weights this replica serves (GetInfo, the heartbeat): the module docstring's rule."""
        return self._fingerprint if self.run_id else self.base_fingerprint

    @property
    def base_fingerprint(self) -> str:
        """The fingerprint of the starting weights (weights/dir_fingerprint.py; server/app.py sets it) while
        they are served; "" once any update loaded other weights, or when unknown. Adapters apply to it."""
        return self.adapters.base_fingerprint

    @base_fingerprint.setter
    def base_fingerprint(self, value: str) -> None:
        self.adapters.base_fingerprint = value

    # ---- asked by a client ----------------------------------------------------------------------

    async def update(self, update: WeightsUpdate) -> WeightsUpdateResult:
        """UpdateWeights: a checkpoint directory, an NCCL broadcast (or its rendezvous), or the starting
        weights adopted."""
        try:
            self._check_asked(update)
            if update.adopt_fingerprint is not None:
                return await self._adopt(update)
            self._check_full_weights()
            if update.collective is not None:
                source: WeightSource = NcclSource(update.collective)
                if update.collective.init:  # the rendezvous: join the trainer's group, no version change
                    await join(self._engine, source)
                    return WeightsUpdateResult(self._engine.policy_version, 0.0, paused_requests=0)
            elif update.checkpoint_dir is None:
                raise InvalidArgument("source is not set; give checkpoint.path")
            else:
                source = DirectorySource.resolve(update.checkpoint_dir, self._config.weights_root)
        except ServiceError as exc:
            _log_refused(update, exc)
            raise
        return await self._run_update(update, source)

    async def receive(self, manifest: WeightsManifest, chunks: stream.Chunks) -> Received:
        """A push (PushWeights): its rules asked on the manifest before any byte is received — the
        adapter's (`AdapterTable.check_manifest`), or for full weights the full-weights refusal and the
        version rule — then its chunks received where the engine loads them from. A refusal is logged."""
        adapter = manifest.adapter is not None
        where = "(adapter push)" if adapter else "(push)"
        update = WeightsUpdate(version=manifest.version, checkpoint_dir=where, run_id=manifest.run_id)
        try:
            self._check_asked(update)
            if adapter:
                self.adapters.check_manifest(manifest)
                # Adapters are small: into memory, whatever the engine.
                return Received(update, manifest, tensors=await stream.receive_tensors(manifest, chunks))
            self._check_full_weights()
            self.check_version(update)
            if manifest.is_delta:
                delta.check_base(manifest, self.weights_served, self._engine)
                patches = await delta.receive_patches(manifest, chunks)
                return Received(update, manifest, source=delta.DeltaSource(manifest, patches))
            source = await stream.receive(self._engine, manifest, chunks)
            return Received(update, manifest, source=source)
        except ServiceError as exc:
            _log_refused(update, exc)
            raise

    async def apply(self, received: Received) -> WeightsUpdateResult:
        """Load a received push (the version rule asked again, under the lock); once begun it runs to
        its end even if the caller goes away."""
        if received.source is not None:
            return await self._run_update(received.update, received.source)
        return await self._shielded(self._load_adapter(received))

    # ---- decided inside the replica -------------------------------------------------------------

    async def load_source(self, update: WeightsUpdate, source: WeightSource) -> WeightsUpdateResult:
        """An update the replica decides itself (joining its run at start-up, weights/join.py): the
        rules of a client's, without one."""
        self._check_full_weights()
        self.check_version(update)
        return await self._run_update(update, source)

    # ---- the rules ------------------------------------------------------------------------------

    def check_version(self, update: WeightsUpdate) -> None:
        """The version rule, per run (module docstring)."""
        version, current, run = update.version, self._engine.policy_version, self.run_id
        if version < 0:
            raise InvalidArgument(f"version {version} is negative")
        if (not update.run_id or update.run_id == run) and version <= current:
            of_run = f" of run {run}" if run else ""
            raise FailedPrecondition(
                f"version {version} must be greater than the current policy version {current}{of_run}"
            )

    def _check_asked(self, update: WeightsUpdate) -> None:
        validation.check_run_id(update.run_id)
        if self._draining():
            raise Unavailable("the server is draining")

    def _check_full_weights(self) -> None:
        """Full weights replace the base every namespace's adapters apply to: refused on a replica
        serving several LoRA runs (`--lora-namespaces`), whose runs each push only their adapter."""
        if self._config.lora_namespaces:
            served = [self._config.namespace, *self._config.lora_namespaces]
            raise FailedPrecondition(
                f"this replica serves several LoRA runs on its base (namespaces {served}): it takes their "
                "adapters only, not full weights; push an adapter, or use a replica without --lora-namespaces"
            )

    # ---- loading --------------------------------------------------------------------------------

    async def _adopt(self, update: WeightsUpdate) -> WeightsUpdateResult:
        """AdoptSource: the starting weights, unchanged, become version 0 of `update.run_id` — only when
        they are what the trainer's model holds (equal fingerprints). No bytes move, nothing is paused."""
        async with self._lock:
            mine, theirs = self.base_fingerprint, update.adopt_fingerprint
            if update.version != 0 or not update.run_id:
                raise InvalidArgument(
                    "adopt takes version 0 of a run (a run_id): a new run's starting weights"
                )
            if self.run_id == update.run_id and self._engine.policy_version == 0:
                return WeightsUpdateResult(0, 0.0, paused_requests=0)  # adopted already: a retry
            if self.run_id or not mine:
                held = f"version {self._engine.policy_version} of run {self.run_id}" if self.run_id else ""
                raise FailedPrecondition(
                    f"cannot adopt: this replica serves {held or 'weights of unknown fingerprint'}, not "
                    "its starting weights; push the model instead"
                )
            if mine != theirs:
                raise FailedPrecondition(
                    f"cannot adopt: this replica's starting weights have fingerprint {mine}, the trainer's "
                    f"model {_cut(theirs or '')!r}: they are other weights; push the model instead"
                )
            self.run_id = update.run_id
        log.info("weights: starting weights (%s) adopted as version 0 of run %s", mine, update.run_id)
        return WeightsUpdateResult(0, 0.0, paused_requests=0)

    async def _load_adapter(self, received: Received) -> WeightsUpdateResult:
        manifest = received.manifest
        try:
            paused, seconds = await self.adapters.load(manifest, received.tensors)
        except ServiceError as exc:
            _log_refused(received.update, exc)
            raise
        self._metrics.weight_update.observe(seconds)
        return WeightsUpdateResult(version=manifest.version, load_seconds=seconds, paused_requests=paused)

    async def _run_update(self, update: WeightsUpdate, source: WeightSource) -> WeightsUpdateResult:
        return await self._shielded(self._update_weights(update, source))

    async def _shielded(self, work) -> WeightsUpdateResult:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return await asyncio.shield(task)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an orphaned update's error already went to its (gone) caller

    async def _update_weights(self, update: WeightsUpdate, source: WeightSource) -> WeightsUpdateResult:
        version = update.version
        try:
            async with self._lock:
                current, run = self._engine.policy_version, self.run_id
                self.check_version(update)  # again: another update may have won the lock meanwhile
                if isinstance(source, delta.DeltaSource):  # and the base it patches
                    delta.check_base(source.manifest, self.weights_served, self._engine)
                paused, seconds = await source.load(self._engine, version)
                stream.now_serving(self._engine, source)
                self._fingerprint = self._verified_fingerprint(source)
                self.run_id = update.run_id
                self.base_fingerprint = ""  # other weights now, even if the load was of the same bytes
                # No adapter trained on the base fits the new weights: every namespace back to them.
                await self.adapters.drop_all()
        except ServiceError as exc:
            _log_refused(update, exc, source)
            raise
        finally:
            source.release()  # loaded or refused, what it held here goes
            trim_heap()  # the replaced weights and the push's buffers, back to the system
        log.info(
            "weights: loaded version %d of run %s (was %d of run %s) from %s in %.2f s, %d requests paused",
            version,
            update.run_id or "-",
            current,
            run or "-",
            source.describe(),
            seconds,
            paused,
        )
        self._metrics.weight_update.observe(seconds)
        self._metrics.policy_version.set(self._engine.policy_version)
        return WeightsUpdateResult(
            version=self._engine.policy_version, load_seconds=seconds, paused_requests=paused
        )

    def _verified_fingerprint(self, source: WeightSource) -> str:
        """The digests' fingerprint of a loaded push whose every tensor had one and came in the dtype the
        engine holds it in (the engine keeps the bytes it was sent); "" for anything else."""
        manifest = getattr(source, "manifest", None)
        if not isinstance(manifest, WeightsManifest):
            return ""
        served = self._engine.settings.dtype
        for t in manifest.tensors:
            dtype = checkpoints.torch_dtype(t.dtype)
            if dtype.is_floating_point and str(dtype).removeprefix("torch.") != served:
                return ""
        return manifest.digests_fingerprint


def _log_refused(update: WeightsUpdate, exc: ServiceError, source: WeightSource | None = None) -> None:
    # The run id and path are the client's: quoted cut short, as the message the client gets.
    log.warning(
        "weights: refused version %d of run %s from %s: %s %s",
        update.version,
        _cut(update.run_id) or "-",
        source.describe() if source is not None else _path_of(update),
        exc.code,
        message_of(str(exc)),
    )


def _path_of(update: WeightsUpdate) -> str:
    path = update.checkpoint_dir
    if path is None:
        return "an NCCL group" if update.collective else "no source"
    return _cut(path, 256)


def _cut(text: str, limit: int = 64) -> str:
    """A client's string in a log line: as it is when short, else quoted and cut (errors.shown)."""
    return text if len(text) <= limit and text.isprintable() else shown(text, limit)
