"""StreamPublisher: new policy versions pushed to every live replica over gRPC (PushWeights), with no
shared filesystem between the trainer and the replicas.

One call per version: the model's state dict is copied to CPU in the replicas' dtype (`dtype`, "auto":
the one they report; a tied tensor once: `delta.replica_copy`), the trainer's one copy, what a replica
that joins or restarts later is sent; described by a manifest (names, safetensors dtypes, shapes, sizes,
a CRC-32 and an xxh3 digest per tensor) and streamed to every live replica in parallel in chunks of
`chunk_bytes`, a timeout each (`broadcast.push_weights`). With `deltas="auto"` (the default) every version
after the first goes as a delta on the last (delta.py) to the replicas that serve the last, whole to the
others and to any that refuse it; a replica checks every tensor's digest before the version serves, and
`fingerprint` (the digests') is then its GetInfo weights fingerprint. The run record in Redis gets the version
with `checkpoint = "stream"` (`run_record.STREAM_CHECKPOINT`): a replica that starts while the run is at
version v > 0 registers and waits (server/weights/join.py); the publisher's follower thread sees it
serving other weights within `follow_s` and pushes it the current version. With `save_root`, each version
is also written there in the `checkpoint.py` layout, on the trainer's own disk, so a restarted trainer
can resume the run from it; without it, `start()` of a resumed run refuses, or with
`resume_from_base=True` publishes the model it is given as a new version (never as the run's current
one).

Each chunk is serialized straight from the tensor's memory with one copy (`wire.push_chunk_bytes`),
per replica, so the trainer holds the snapshot plus the chunks each replica's gRPC stream has in flight.

A model sharded across trainer ranks (FSDP2) is never snapshotted whole: `ranked.RankedPublisher` has
every rank gather it one parameter at a time into a file (`sharded.write_gathered`: `written_path`, the
resume copy under save_root or else a spool file of this publisher's), and `publish_written` pushes that
file, read chunk by chunk, to the replicas and keeps it for the follower instead of a snapshot.

A PEFT LoRA model (`lora.is_lora`) is published as its adapter only (`lora.adapter_of`: the "default"
adapter's A and B, a few MB where the model is hundreds): the manifest carries the `AdapterSpec` (rank,
alpha, targets, the base's fingerprint) and the queue's namespace, and the replicas apply it on their base.
A new run's version 0 is the adapter as initialised (B = 0: the base's outputs), pushed, never adopted;
save_root holds each version as an adapter directory in PEFT's layout (`lora.save_adapter`), which
start() loads back into the model when the run resumes. `last_update_bytes` says what one replica was
sent for the last version either way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from maskroll.client import BroadcastError, ReplicaWeights
from maskroll.proto.heap import trim_heap
from maskroll.proto.run_record import STREAM_CHECKPOINT
from maskroll.proto.safetensors_layout import safetensors_header
from maskroll.proto.tensor_push import (
    DEFAULT_CHUNK_BYTES,
    AdapterSpec,
    TensorSpec,
    WeightsManifest,
    digest_of,
)

from . import broadcast, delta, lora
from .checkpoint import checkpoint_dir, load_checkpoint, prune
from .model_fingerprint import model_fingerprint
from .sharded import WrittenVersion, dtype_name, raw, specs_of, version_file
from .versions import WeightSyncError, checked, next_version, publish_first

log = logging.getLogger(__name__)


def manifest_of(
    tensors: Mapping[str, torch.Tensor],
    version: int,
    run_id: str = "",
    *,
    digests: bool | Sequence[str] = False,
) -> WeightsManifest:
    """The manifest of `tensors` (CPU, contiguous), each with its CRC-32 and, with `digests`, the xxh3-64
    digest the replica checks what it loaded against (delta.py): computed here, or given (one per tensor,
    in order: a delta's, which computed them already)."""
    dtypes = [dtype_name(name, t.dtype) for name, t in tensors.items()]  # before any byte is summed
    raws = [raw(t) for t in tensors.values()]
    # The checksums are on the critical path (the manifest goes first): zlib releases the GIL, so the
    # tensors are summed on every core (0.15 s for 472 MB on one).
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="maskroll-crc") as pool:
        crcs = list(pool.map(zlib.crc32, raws))
        if digests is True:
            sums = list(pool.map(digest_of, raws))
        else:
            sums = list(digests) if digests else [""] * len(raws)
    specs = (
        TensorSpec(name, dtype, tuple(t.shape), data.nbytes, crc, digest=digest)
        for (name, t), dtype, data, crc, digest in zip(tensors.items(), dtypes, raws, crcs, sums, strict=True)
    )
    return WeightsManifest(version=version, tensors=tuple(specs), run_id=run_id)


def chunks_of(
    tensors: Mapping[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tuple[int, int, memoryview]]:
    """(tensor index, byte offset, bytes) of every tensor in order, at most `chunk_bytes` each."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    for index, t in enumerate(tensors.values()):
        data = raw(t)
        for offset in range(0, data.nbytes, chunk_bytes):
            yield index, offset, data[offset : offset + chunk_bytes]


def save_snapshot(tensors: Mapping[str, torch.Tensor], manifest: WeightsManifest, directory: Path) -> Path:
    """`tensors` (a snapshot: CPU, contiguous) written as `<directory>/model.safetensors`, the checkpoint
    layout, straight from their memory: safetensors' save_file copies every tensor to bytes first (one
    more model in memory). Under a temporary name, renamed when complete."""
    return _write(manifest.tensors, tensors.values(), directory)


def save_state(state: Mapping[str, torch.Tensor], directory: Path) -> Path:
    """The model's own state (every name, its own dtype: the master weights a resume loads, not the
    replicas' copy the pushes send) written as save_snapshot does, one tensor on the CPU at a time."""
    tensors = {name: t.detach() for name, t in state.items()}
    return _write(specs_of(tensors), (t.to("cpu").contiguous() for t in tensors.values()), directory)


def _write(specs, tensors: Iterable[torch.Tensor], directory: Path) -> Path:
    path = version_file(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(safetensors_header(list(specs)))
            for t in tensors:
                f.write(raw(t))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)  # atomic: a reader sees the whole file or none
    return directory


class StreamPublisher:
    """Publishes versions of a model to the replicas behind `queue` through PushWeights.

        q = RolloutQueue(url, "run1", run="new", batch_size=64, max_staleness=1)
        pub = StreamPublisher(q)
        pub.start(model)
        for step in ...:
            ...                       # an optimiser step
            pub.publish(model)        # version + 1: recorded, streamed to every replica
        pub.close()                   # stops the follower thread

    Args:
        queue: a `maskroll.client.RolloutQueue` (its run, policy version and replica registry are used).
        save_root: also write each version to `<save_root>/v<version>` (the trainer's local disk), for
            resuming the run after a trainer restart; None keeps no file.
        keep: versions kept under save_root.
        timeout: seconds each replica may take to receive and load a version.
        require_all: as CheckpointPublisher: raise WeightSyncError if any live replica failed.
        chunk_bytes: bytes per PushWeights message (under the replicas' --max-message-bytes).
        follow_s: every this many seconds, push the current version to live replicas that do not
            serve it (joined or restarted since the last publish); None: no follower thread.
        resume_from_base: what start() does when the run is at a version v > 0 and `save_root` holds
            no copy of it: False (the default) refuses (the model would be taken for version v while
            it most likely holds the base weights); True publishes the model as a new version v + 1.
        held: (run id, version) that the model given to start() already holds, as the `held` of an
            earlier publisher of the same model says (a trainer that reopens its queue in one process,
            such as TRL's evaluate after train): start() takes the model as that version.
        dtype: the replicas' dtype (e.g. torch.bfloat16, or its name): floating-point weights are cast
            to it on the trainer, as the replicas would cast them (round to nearest even), and sent in it
            (half the bytes of float32); None sends the model's own dtype; "auto" (the default) asks the
            live replicas at start() (GetInfo) and takes the dtype they all report, else the model's.
        deltas: "auto" sends each version after the first as a delta on the last (delta.py: per tensor
            nothing, a sparse patch or the dense tensor, whichever is smallest, so never more than the
            full bytes) to the replicas that serve the last, the full version to the others; "off" sends
            every version whole. A LoRA adapter and a sharded model's written file are always sent whole.
    """

    def __init__(
        self,
        queue,
        *,
        save_root: str | os.PathLike | None = None,
        keep: int = 2,
        timeout: float = 120.0,
        require_all: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        follow_s: float | None = 5.0,
        resume_from_base: bool = False,
        held: tuple[str, int] | None = None,
        dtype: torch.dtype | str | None = "auto",
        deltas: str = "auto",
    ) -> None:
        if deltas not in ("auto", "off"):
            raise ValueError(f"deltas must be 'auto' or 'off', got {deltas!r}")
        self._auto_dtype = dtype == "auto"
        self.dtype = None if self._auto_dtype else delta.floating_dtype(dtype)
        self.deltas = deltas
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.queue, self.keep, self.timeout, self.require_all = queue, keep, timeout, require_all
        self.save_root = None if save_root is None else os.path.abspath(save_root)
        self.chunk_bytes = chunk_bytes
        self.resume_from_base = resume_from_base
        self.held = held  # (run id, version) of the weights the trainer's model holds, as last known
        self._fingerprint = ""  # of the model start() was given at version 0: replicas holding it adopt
        self._tensors: dict[str, torch.Tensor] | None = None  # the last published version's snapshot
        self._written: WrittenVersion | None = None  # ... or its file (a sharded model's, publish_written)
        self._spool: str | None = None  # where written versions go without save_root (made on first use)
        self._manifest: WeightsManifest | None = None
        self._delta: delta.Delta | None = None  # the last version as a delta on the one before, if any
        self.fingerprint = ""  # the digests' fingerprint of the last version (full weights), or ""
        self.updates = {"delta": 0, "full": 0}  # replicas pushed a version after the first, by how
        self.update_bytes: list[float] = []  # per version after the first: bytes sent per replica pushed
        self.update_seconds: list[float] = []  # per version after the first: until every replica serves it
        self.last_pushed: dict[str, str] = {}  # {replica_id: "delta" | "full"} of the last push round
        self._base_fingerprint = ""  # a LoRA model's base (frozen: computed once)
        self.last_update_bytes = 0  # tensor bytes one replica is sent for the last version published
        self.last_sent_bytes = (
            0  # tensor bytes streamed by the last push round (publish or catch-up), all replicas
        )
        self._count_lock = threading.Lock()
        self._lock = threading.Lock()  # one push at a time: publish vs the follower's catch-up
        self._stop = threading.Event()
        self._follower: threading.Thread | None = None
        if follow_s is not None:
            if follow_s <= 0:
                raise ValueError(f"follow_s must be > 0 or None, got {follow_s}")
            self._follower = threading.Thread(
                target=self._follow, args=(follow_s,), name="maskroll-weights-follow", daemon=True
            )
            self._follower.start()

    @property
    def version(self) -> int:
        """The last version published: the queue's policy version (its run's, recorded in Redis)."""
        return self.queue.policy_version

    def start(self, model: torch.nn.Module) -> int:
        """Put the trainer and every live replica on the run's current version; returns it. A resumed
        run at v > 0 loads `<save_root>/v<v>` into `model` and pushes it to the replicas not serving
        it (with `held` naming v of this run, `model` is taken to hold it). Without that copy
        (the stream keeps none outside the trainer) it raises RuntimeError, unless
        `resume_from_base=True`: then `model` is published as a new version v + 1 (returned), never
        labelled v. A run at 0 publishes `model` as its version 0: live replicas whose starting weights
        are `model`'s (equal weights fingerprints) adopt it, the others are pushed it, and the follower
        does the same for replicas that join later (CheckpointPublisher.start). A PEFT LoRA model: its
        adapter, version 0 pushed to every replica (never adopted), a resumed run's adapter loaded from
        `<save_root>/v<v>` (PEFT's layout) into the model's adapter."""
        run = self.queue.run
        adapter = lora.is_lora(model)
        if self._auto_dtype:
            self.dtype = self._replicas_dtype()
        if run.version > 0:
            own = checkpoint_dir(self.save_root, run.version) if self.save_root else None
            if own is not None and own.exists():
                if adapter:
                    self._resume_adapter(model, own)
                    self.catch_up()
                    return run.version
                if (own / lora.CONFIG_FILE).exists():
                    raise RuntimeError(
                        f"{own} holds a LoRA adapter (the run trained one), but the model given to start() "
                        "is not a PEFT LoRA model: wrap it with peft.get_peft_model as the run did"
                    )
                load_checkpoint(model, own)
            elif self.held == (run.run_id, run.version):
                pass  # the caller's model holds it (published or loaded by an earlier publisher)
            elif self.resume_from_base:
                return self._resume_as_new_version(model, run)
            else:
                where = f"no {own}" if own is not None else "save_root=None"
                raise RuntimeError(
                    f"run {run.run_id} is at policy version {run.version} but this trainer has no copy of "
                    f"it ({where}): the stream transport keeps versions only on the trainer's disk, and "
                    f"the model here most likely holds the base weights, not version {run.version}. Point "
                    "save_root (StreamPublisher / make_publisher root=; MaskrollConfig.weights_root with "
                    "TRL) at the directory the run saved into, start a new run (run='new'), or pass "
                    f"resume_from_base=True to publish this model as a new version {run.version + 1}"
                )
            self._remember_model(model, run.version)
            self.catch_up()
            return run.version
        # a LoRA run's version 0 is an adapter (B = 0): pushed, never adopted as full weights
        self._fingerprint = "" if adapter else model_fingerprint(model)
        results = publish_first(self.publish, model)
        log.info("run %s starts at version 0: %s", run.run_id, results or "no live replica yet")
        return 0

    def _replicas_dtype(self) -> torch.dtype | None:
        """The one floating-point dtype every live replica reports holding its weights in, else None."""
        try:
            served = broadcast.replica_weights(self.queue)
        except Exception as e:  # no replica reachable yet: the model's own dtype, as without auto
            log.info("replicas' dtype unknown (%s: %s): the model's own is sent", type(e).__name__, e)
            return None
        names = {w.dtype for w in served.values() if isinstance(w, ReplicaWeights)}
        try:
            dtype = delta.floating_dtype(names.pop()) if len(names) == 1 else None
        except ValueError:  # a replica that reports no dtype, or a non-floating one
            return None
        if dtype is None:
            return None
        log.info("the replicas hold %s weights: versions are cast to it and sent in it", dtype)
        return dtype

    def _resume_as_new_version(self, model: torch.nn.Module, run) -> int:
        """resume_from_base: `model` (not version run.version) published as run.version + 1; recorded
        even when no replica is alive yet (the follower and joining replicas get it pushed)."""
        version = run.version + 1
        log.warning(
            "resuming run %s at version %d with no local copy under save_root=%s: resume_from_base=True, "
            "so the model is published as a new version %d",
            run.run_id,
            run.version,
            self.save_root,
            version,
        )
        try:
            self.publish(model, version)
        except WeightSyncError as e:
            if e.results:  # some replica was there and did not take it
                raise
        return version

    def publish(
        self, model: Mapping[str, torch.Tensor] | torch.nn.Module, version: int | None = None
    ) -> dict[str, str]:
        """Snapshot `model` as `version` (default: the last + 1), record it as the run's latest and push
        it to every live replica; returns {replica_id: "ok" | "unchanged" | error}."""
        version = next_version(self.version, version)
        with self._lock:
            # The last version's snapshot goes before the next is taken, and its freed heap back to the
            # system (glibc keeps it in its arenas otherwise): rank 0 holds one snapshot beside the model,
            # not two plus what the allocator kept (bench/learner.py: 835 MB extra for a 271 MB model
            # before). Under the lock, so the follower never pushes a half-replaced version: a replica
            # that joins mid-publish waits for the lock and is then pushed the new one (catch_up).
            # With deltas, the last version (in the replicas' dtype: half a float32 snapshot in bf16) is
            # kept until the new one is compared with it.
            base = self._tensors if self._delta_base_ok() else None
            base_version = self._manifest.version if base is not None else None
            self._tensors, self._written, self._manifest, self._delta = None, None, None, None
            if base is not None:  # compared tensor by tensor, each old copy replaced by the new one
                self._delta = self._advance(base, model, base_version, version)
            trim_heap()
            if self._delta is not None:  # its digests are the new version's: not summed again
                self._remember(base, version, digests=[t.digest for t in self._delta.manifest.tensors])
            else:
                self._remember_model(model, version)
            del base
            if self.save_root is not None:  # before the push records the version: a resume finds it
                out = checkpoint_dir(self.save_root, version)
                if self._manifest.adapter is not None:
                    lora.save_adapter(out, self._manifest.adapter, self._tensors)
                else:  # the master weights, not the replicas' copy: a resume goes on training them
                    save_state(model if isinstance(model, Mapping) else model.state_dict(), out)
            results = self._push_new(version)
        self._prune(version)
        return checked(version, results, self.require_all)

    def written_path(self, version: int) -> Path:
        """Where `publish_written`'s file for `version` goes: `<save_root>/v<version>/model.safetensors`
        (the resume copy, the checkpoint layout), or without save_root a spool directory private to this
        publisher under the temporary directory (TMPDIR: it needs room for one model on rank 0's disk;
        removed by close()), which keeps the current version only."""
        if self.save_root is not None:
            return version_file(checkpoint_dir(self.save_root, version))
        if self._spool is None:
            import tempfile

            self._spool = tempfile.mkdtemp(prefix="maskroll-publish-")
        return Path(self._spool) / f"v{version}.safetensors"

    def publish_written(self, written: WrittenVersion) -> dict[str, str]:
        """Publish a version already written to `written.path` (`sharded.write_gathered` into
        `written_path(version)`): recorded as the run's latest, its file pushed to every live replica
        (read chunk by chunk: the model is never in memory whole) and kept for the follower. As
        publish(), {replica_id: result}; version 0 is offered for adoption by its fingerprint."""
        version = next_version(self.version, written.manifest.version)
        with self._lock:
            before = self._written
            self._tensors, self._written, self._manifest = None, written, written.manifest
            self._delta, self.fingerprint = None, written.manifest.digests_fingerprint
            self.held = (self.queue.run.run_id, version)
            self.last_update_bytes = written.manifest.total_bytes
            if version == 0:
                self._fingerprint = written.fingerprint
            try:
                results = self._push_new(version)
            finally:  # recorded or not, no push will read the superseded file again
                if before is not None and self._spool and before.path.parent == Path(self._spool):
                    before.path.unlink(missing_ok=True)  # the spool keeps the current version only
        self._prune(version)
        return checked(version, results, self.require_all)

    def _delta_base_ok(self) -> bool:
        """The last version can be the base of a delta: full weights, in memory."""
        m = self._manifest
        return self.deltas == "auto" and self._tensors is not None and m is not None and m.adapter is None

    def _advance(
        self, base: dict[str, torch.Tensor], model, base_version: int, version: int
    ) -> delta.Delta | None:
        """`model` as a delta on `base` (which becomes the new version's copy); None when it cannot be
        one (the model changed layout: `base` is then left as it was and dropped)."""
        state = model.state_dict() if isinstance(model, torch.nn.Module) else model
        try:
            d = delta.advance(base, state, self.dtype, version=version, base_version=base_version)
        except ValueError as e:  # every replica is sent the full version
            log.warning("version %d is sent whole: %s", version, e)
            return None
        full = sum(t.numel() * t.element_size() for t in base.values())
        sent = d.manifest.total_bytes
        log.info(
            "version %d as a delta on %d: %.2f MB of %.2f MB (%.2f %%)",
            version,
            base_version,
            sent / 1e6,
            full / 1e6,
            100 * sent / max(full, 1),
        )
        return d

    def _push_new(self, version: int) -> dict[str, str]:
        self.last_sent_bytes = 0
        sent: dict[str, str] = {}
        d = self._delta
        t0 = time.perf_counter()
        try:
            results = broadcast.push_weights(
                self.queue,
                version,
                self._manifest,
                self._chunks,
                timeout=self.timeout,
                record=STREAM_CHECKPOINT,  # a version only the trainer holds
                fingerprint=self._fingerprint if version == 0 else "",
                delta=None if d is None else (d.manifest, lambda: self._counted(d.chunks(self.chunk_bytes))),
                sent=sent,
            )
        except BroadcastError as e:
            raise WeightSyncError(version, e.failed, e.results) from e
        if version > 0:
            self.update_seconds.append(time.perf_counter() - t0)
        self._count(version, results, sent)
        return results

    def _count(self, version: int, results: dict[str, str], sent: dict[str, str]) -> None:
        """The figures of a push round (`updates`, `update_bytes`): versions after the first only."""
        self.last_pushed = sent
        pushed = [r for r, e in results.items() if e == "ok" and r in sent]
        if version == 0 or not pushed:
            return
        for r in pushed:
            self.updates[sent[r]] += 1
        self.update_bytes.append(self.last_sent_bytes / len(pushed))

    @property
    def model_bytes(self) -> int | None:
        """The last version's full bytes as sent (the replicas' dtype, a tied tensor once); None for an
        adapter (a LoRA run's model is its base) or before the first version."""
        m = self._manifest
        return None if m is None or m.adapter is not None else m.total_bytes

    @property
    def weight_bytes_per_update(self) -> float | None:
        """Mean bytes sent per replica per update after version 0 (None before any)."""
        return sum(self.update_bytes) / len(self.update_bytes) if self.update_bytes else None

    def catch_up(self) -> dict[str, str]:
        """Push the current version to the live replicas that do not serve it; {replica_id: result}.
        Nothing to do (no replica, or all current) is not an error."""
        with self._lock:
            if self._manifest is None:
                return {}
            self.last_sent_bytes = 0
            sent: dict[str, str] = {}
            results = broadcast.push_weights(
                self.queue,
                self._manifest.version,
                self._manifest,
                self._chunks,
                timeout=self.timeout,
                record=None,
                fingerprint=self._fingerprint if self._manifest.version == 0 else "",
                sent=sent,
            )
            self._count(self._manifest.version, results, sent)
            return results

    def close(self) -> None:
        """Stop the follower thread (the queue stays open: it is the caller's)."""
        self._stop.set()
        if self._follower is not None:
            self._follower.join(timeout=self.timeout + 15)
            self._follower = None
        if self._spool is not None:
            import shutil

            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool = None

    def __enter__(self) -> StreamPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _remember(
        self,
        tensors: dict[str, torch.Tensor],
        version: int,
        adapter: AdapterSpec | None = None,
        digests: Sequence[str] | None = None,
    ) -> None:
        manifest = manifest_of(tensors, version, digests=digests or adapter is None)
        if adapter is not None:  # applied on the replicas' base, for the queue's namespace
            manifest = replace(manifest, adapter=adapter, namespace=self.queue.namespace)
        self.fingerprint = manifest.digests_fingerprint
        self._tensors, self._manifest = tensors, manifest
        self._written = None
        self.held = (self.queue.run.run_id, version)
        self.last_update_bytes = manifest.total_bytes

    def _remember_model(self, model: Mapping[str, torch.Tensor] | torch.nn.Module, version: int) -> None:
        """`model` as the version to send: a LoRA model's adapter (CPU copies), else a copy in the
        replicas' dtype, a tied tensor once (delta.replica_copy)."""
        if not lora.is_lora(model):
            state = model.state_dict() if isinstance(model, torch.nn.Module) else model
            self._remember(delta.replica_copy(state, self.dtype), version)
            return
        if not self._base_fingerprint:
            self._base_fingerprint = lora.base_fingerprint(model)
        spec, tensors = lora.adapter_of(model, fingerprint=self._base_fingerprint)
        self._remember(tensors, version, spec)

    def _resume_adapter(self, model: torch.nn.Module, directory: Path) -> None:
        """A resumed LoRA run: the adapter saved in `directory` loaded into `model` and remembered as the
        run's current version, after checking it was trained on this model's base."""
        if not (directory / lora.CONFIG_FILE).exists():
            raise RuntimeError(
                f"{directory} holds no LoRA adapter (the run trained the full model), but the model given to "
                "start() is a PEFT LoRA model: resume with the plain model, or start a new run (run='new')"
            )
        spec, tensors = lora.load_adapter(directory)
        base = self._base_fingerprint = lora.base_fingerprint(model)
        if spec.base_fingerprint and spec.base_fingerprint != base:
            raise RuntimeError(
                f"the adapter in {directory} was trained on base {spec.base_fingerprint}, but the model "
                f"given to start() has base {base}: start it from the run's base model"
            )
        lora.load_into(model, tensors)
        self._remember_model(model, self.queue.run.version)

    def remember_written(self, written: WrittenVersion) -> None:
        """Take `written` (a resumed run's version, loaded into a sharded model from it) as the version
        the follower sends, instead of a snapshot; nothing is recorded or pushed here (catch_up does)."""
        with self._lock:
            self._tensors, self._written, self._manifest = None, written, written.manifest
            self._delta, self.fingerprint = None, written.manifest.digests_fingerprint
            self.held = (self.queue.run.run_id, written.manifest.version)

    def _chunks(self) -> Iterator[tuple[int, int, memoryview | bytes]]:
        # the version being sent, even if a publish replaces it meanwhile
        tensors, written = self._tensors, self._written
        chunks = (
            written.chunks(self.chunk_bytes) if written is not None else chunks_of(tensors, self.chunk_bytes)
        )
        return self._counted(chunks)

    def _counted(self, chunks: Iterator[tuple[int, int, memoryview | bytes]]):
        for chunk in chunks:
            with self._count_lock:  # the replicas' pushes read their chunks concurrently
                self.last_sent_bytes += len(chunk[2])
            yield chunk

    def _follow(self, period: float) -> None:
        while not self._stop.wait(period):
            if getattr(self.queue, "closed", False):  # the trainer closed it without close(): done
                return
            try:
                results = self.catch_up()
            except Exception as e:  # a closed queue, Redis away: the next round tries again
                log.warning("weights follower: catch-up failed: %s: %s", type(e).__name__, e)
                continue
            pushed = {r: e for r, e in results.items() if e != "unchanged"}
            if pushed:
                log.info("weights follower: version %d pushed to %s", self._manifest.version, pushed)

    def _prune(self, version: int) -> None:
        if self.save_root is not None:
            prune(self.save_root, version, self.keep)  # the checkpoints and their trained-ids ledgers
