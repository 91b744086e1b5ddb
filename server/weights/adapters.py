"""The replica's LoRA adapters (docs/lora.md): which adapters are resident in the engine, which one each
served namespace samples with, and the rules a pushed adapter must pass. One `AdapterTable` per replica,
the only owner of adapter state; the engine only holds what the table tells it to (`add_adapter`,
`remove_adapter`).

Rules of a load (`load`), checked in this order, each refusal naming what to change; a refused or failed
load leaves the namespace's current adapter serving:

- LoRA on: the engine takes adapters (max_lora_rank > 0) of at most its rank (FAILED_PRECONDITION, naming
  --max-lora-rank);
- the namespace is one this replica serves (FAILED_PRECONDITION naming those it serves);
- the base: the adapter's base fingerprint is this replica's starting weights' (INVALID_ARGUMENT), and
  those weights still serve (FAILED_PRECONDITION once full weights replaced them);
- the tensors fit the base (`tensor_rules.check_adapter`: INVALID_ARGUMENT naming the module);
- the version rule of full weights, per namespace: within the current run a version must be greater
  than the current one (FAILED_PRECONDITION); another run's is a new start (any version >= 0).

Residency: an adapter is one (namespace, run, version), with an id never reused (vLLM's lora_int_id keys
its prefix cache). A request samples with the adapter that was current when it started (`use` counts it
in) to its last token, so older adapters stay resident while a request uses them. A namespace keeps its
run's `versions_per_run` newest versions; older ones, another run's and a dropped namespace's are
*retired*: removed from the engine as soon as no request uses them. Over every namespace at most
`max_loras` are resident: a load that needs room evicts retired ones first, then the least recently used
that no request uses and is no namespace's current one; with none such it is refused
(RESOURCE_EXHAUSTED naming --max-loras).

Pure bookkeeping on the event loop plus the engine's two calls; knows nothing of gRPC or of how the
tensors arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from maskroll.proto.records import AdapterInfo
from maskroll.proto.tensor_push import WeightsManifest

from ..engines.contract import AdapterRef, Engine, LoraWeights
from ..errors import FailedPrecondition, InvalidArgument, ResourceExhausted, shown
from . import tensor_rules

log = logging.getLogger("maskroll.weights")


def adapter_name(namespace: str, run_id: str, version: int) -> str:
    """RolloutRecord.adapter of what an adapter samples (docs/lora.md)."""
    return f"{namespace}/{run_id}/v{version}"


@dataclass
class _Resident:
    ref: AdapterRef
    rank: int
    users: int = 0  # requests sampling with it now (`use`)
    last_used: int = 0  # the table's clock at its load or its latest `use`: LRU order


class AdapterTable:
    def __init__(
        self,
        engine: Engine,
        *,
        base_fingerprint: str,
        max_loras: int,
        versions_per_run: int,
        namespaces: tuple[str, ...],
        base_layouts: Callable[[], Mapping[str, tensor_rules.Layout]] | None = None,
    ) -> None:
        """namespaces[0]: the replica's own (config.namespace), the one a manifest or request without a
        namespace means. base_layouts: the served base's tensor layouts (read once, at the first load:
        `tensor_rules.directory_layouts(config.model)`); None: none known, every adapter is refused."""
        if not namespaces:
            raise ValueError("an adapter table serves at least one namespace")
        if max_loras < 1 or versions_per_run < 1:
            raise ValueError(f"max_loras {max_loras} and versions_per_run {versions_per_run} must be >= 1")
        self._engine = engine
        # The starting weights' fingerprint while they serve (weights/updates.py sets "" once full weights
        # replaced them: an adapter trained on the base would then be applied to other weights).
        self.base_fingerprint = base_fingerprint
        self.max_loras = max_loras
        self.versions_per_run = versions_per_run
        self.namespaces = tuple(namespaces)
        self._base_layouts = base_layouts
        self._layouts: Mapping[str, tensor_rules.Layout] | None = None
        self._resident: dict[int, _Resident] = {}  # by id, in load order
        self._current: dict[str, AdapterRef] = {}  # namespace → the adapter new requests sample with
        self._ids = itertools.count(1)  # never reused in the replica's life
        self._clock = itertools.count(1)
        self._lock = asyncio.Lock()  # one load or eviction at a time: the version rule and the room
        self._sweeps: set[asyncio.Task] = set()  # strong references to background evictions

    # ---- what samples ---------------------------------------------------------------------------

    def namespace_of(self, namespace: str) -> str:
        """A request's or manifest's namespace ("" = the replica's own)."""
        return namespace or self.namespaces[0]

    def current(self, namespace: str = "") -> AdapterRef | None:
        """The adapter a new request of `namespace` samples with; None: the base (or full weights)."""
        return self._current.get(self.namespace_of(namespace))

    def served(self, namespace: str = "") -> tuple[str, int] | None:
        """(run_id, version) of the namespace's current adapter, for its join and heartbeat; None: none."""
        ref = self.current(namespace)
        return None if ref is None else (ref.run_id, ref.version)

    @contextlib.contextmanager
    def use(self, namespace: str = "") -> Iterator[AdapterRef | None]:
        """The namespace's current adapter, kept resident until the block ends (a request samples with it
        from its first token to its last); None when the namespace has none. A namespace this replica
        does not serve is refused (FAILED_PRECONDITION)."""
        ns = self.namespace_of(namespace)
        if ns not in self.namespaces:
            raise FailedPrecondition(self._not_served(ns))
        ref = self._current.get(ns)
        entry = None if ref is None else self._resident.get(ref.id)
        if entry is None:
            yield None
            return
        entry.users += 1
        entry.last_used = next(self._clock)
        try:
            yield ref
        finally:
            entry.users -= 1
            if entry.users == 0 and self._retired(entry):
                self._sweep_soon()

    def resident(self) -> list[AdapterRef]:
        """The adapters resident in the engine, in load order."""
        return [e.ref for e in self._resident.values()]

    def users(self, ref: AdapterRef) -> int:
        """Requests sampling with `ref` now (0 when it is not resident)."""
        entry = self._resident.get(ref.id)
        return 0 if entry is None else entry.users

    def info(self) -> tuple[AdapterInfo, ...]:
        """Each served namespace's current adapter, in the order served (GetInfo.adapters)."""
        return tuple(
            AdapterInfo(ref.namespace, ref.run_id, ref.version, ref.name, self._resident[ref.id].rank)
            for ns in self.namespaces
            if (ref := self._current.get(ns)) is not None and ref.id in self._resident
        )

    # ---- loading --------------------------------------------------------------------------------

    def check_manifest(self, manifest: WeightsManifest) -> str:
        """The rules a push's manifest can be held to before any byte is received; returns its namespace.
        Raises FailedPrecondition / InvalidArgument. `load` asks them again."""
        spec = manifest.adapter
        if spec is None:
            raise InvalidArgument("the manifest has no adapter: full weights are not an adapter")
        limit = self._engine.max_lora_rank
        if limit <= 0:
            raise FailedPrecondition(
                f"this replica takes no LoRA adapters: start it with --max-lora-rank {spec.rank} or more "
                f"(the {self._engine.name} engine's max_lora_rank is 0)"
            )
        if spec.rank > limit:
            raise FailedPrecondition(
                f"adapter rank {spec.rank} is above this replica's --max-lora-rank {limit}: restart it with "
                f"--max-lora-rank {spec.rank} or more, or train a smaller rank"
            )
        ns = self.namespace_of(manifest.namespace)
        if ns not in self.namespaces:
            raise FailedPrecondition(self._not_served(ns))
        if not self.base_fingerprint:
            raise FailedPrecondition(
                "this replica no longer serves its base model (full weights replaced it, or its --model has "
                "no safetensors to fingerprint): an adapter needs a replica on its base"
            )
        if spec.base_fingerprint != self.base_fingerprint:
            raise InvalidArgument(
                f"adapter trained on base {spec.base_fingerprint}, this replica serves "
                f"{self.base_fingerprint}: push it to replicas of the model it was trained on"
            )
        self._check_version(ns, manifest.run_id, manifest.version)
        return ns

    async def load(self, manifest: WeightsManifest, tensors: dict) -> tuple[int, float]:
        """Check the adapter (the module docstring's rules), make it resident and the namespace's current
        one; returns (requests paused: always 0, seconds). On any refusal or engine failure the old
        adapter stays current and resident. `tensors`: {name: torch tensor} as received."""
        t0 = time.perf_counter()
        async with self._lock:
            ns = self.check_manifest(manifest)  # again: another load may have won the lock meanwhile
            spec = manifest.adapter
            layouts = await self._layouts_of_base()
            try:
                await asyncio.to_thread(
                    tensor_rules.check_adapter, spec, tensors, layouts, max_rank=self._engine.max_lora_rank
                )
            except ValueError as e:
                raise InvalidArgument(f"adapter v{manifest.version} refused: {e}") from e
            await self._make_room()
            ref = AdapterRef(
                name=adapter_name(ns, manifest.run_id, manifest.version),
                id=next(self._ids),
                version=manifest.version,
                namespace=ns,
                run_id=manifest.run_id,
            )
            try:
                # a dict of its own: the engine may keep it (the tensors are the received ones, not copied)
                await self._engine.add_adapter(ref, LoraWeights(spec, dict(tensors)))
            except (ValueError, RuntimeError) as e:
                raise InvalidArgument(
                    f"adapter {ref.name} refused by the {self._engine.name} engine: {e}"
                ) from e
            # Only now does the namespace move: a failure above left the old adapter serving.
            self._resident[ref.id] = _Resident(ref, spec.rank, last_used=next(self._clock))
            old = self._current.get(ns)
            self._current[ns] = ref
            await self._evict_retired()
        seconds = time.perf_counter() - t0
        was = f"{old.name}" if old is not None else "the base"
        log.info(
            "weights: adapter %s (rank %d) now serves namespace %s (was %s), %.3f s",
            ref.name,
            spec.rank,
            ns,
            was,
            seconds,
        )
        return 0, seconds

    async def drop_namespace(self, namespace: str) -> None:
        """The namespace's run ended (or the replica stops serving it): its requests go back to the base,
        and its adapters leave the engine as soon as no request uses them."""
        async with self._lock:
            ref = self._current.pop(self.namespace_of(namespace), None)
            if ref is not None:
                log.info("weights: namespace %s dropped its adapter %s", ref.namespace, ref.name)
            await self._evict_retired()

    async def drop_all(self) -> None:
        """Every namespace back to the base (full weights replaced it: no adapter fits them any more)."""
        async with self._lock:
            self._current.clear()
            await self._evict_retired()

    # ---- the rules ------------------------------------------------------------------------------

    def _not_served(self, ns: str) -> str:
        return (
            f"namespace {shown(ns)} is not served by this replica (it serves {list(self.namespaces)}; add it "
            "with --lora-namespaces)"
        )

    def _check_version(self, ns: str, run_id: str, version: int) -> None:
        if version < 0:
            raise InvalidArgument(f"version {version} is negative")
        current = self._current.get(ns)
        if current is not None and current.run_id == run_id and version <= current.version:
            of_run = f" of run {run_id}" if run_id else ""
            raise FailedPrecondition(
                f"version {version} must be greater than the current adapter version "
                f"{current.version}{of_run} in namespace {ns!r}"
            )

    async def _layouts_of_base(self) -> Mapping[str, tensor_rules.Layout]:
        if self._layouts is None:
            self._layouts = {} if self._base_layouts is None else await asyncio.to_thread(self._base_layouts)
        return self._layouts

    def _retired(self, entry: _Resident) -> bool:
        """Whether an adapter is done with once no request uses it: not its namespace's current run's, or
        older than that run's `versions_per_run` newest resident versions."""
        ref = entry.ref
        current = self._current.get(ref.namespace)
        if current is None or current.run_id != ref.run_id:
            return True
        newer = sum(
            1
            for e in self._resident.values()
            if e.ref.namespace == ref.namespace and e.ref.run_id == ref.run_id and e.ref.version > ref.version
        )
        return newer >= self.versions_per_run

    def _is_current(self, entry: _Resident) -> bool:
        return self._current.get(entry.ref.namespace) == entry.ref

    async def _make_room(self) -> None:
        """Evict until one more adapter fits within max_loras: retired unused ones first, then the least
        recently used unused one that is no namespace's current adapter."""
        while len(self._resident) >= self.max_loras:
            free = [e for e in self._resident.values() if e.users == 0 and not self._is_current(e)]
            if not free:
                raise ResourceExhausted(
                    f"{len(self._resident)} adapters are resident, the --max-loras {self.max_loras}, and "
                    "each is a namespace's current one or sampling a request: raise --max-loras or serve "
                    "fewer namespaces"
                )
            victim = min(free, key=lambda e: (not self._retired(e), e.last_used))
            await self._remove(victim)

    async def _evict_retired(self) -> None:
        for entry in [e for e in self._resident.values() if e.users == 0 and self._retired(e)]:
            await self._remove(entry)

    async def _remove(self, entry: _Resident) -> None:
        del self._resident[entry.ref.id]
        try:
            await self._engine.remove_adapter(entry.ref)
        except Exception:  # the table must go on: the engine keeps a stale adapter no request names
            log.exception("weights: the engine failed to remove adapter %s", entry.ref.name)
        else:
            log.info("weights: adapter %s evicted", entry.ref.name)

    def _sweep_soon(self) -> None:
        """Evict retired adapters after a request ended (`use` is synchronous; eviction is not)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): the next load sweeps
            return
        task = loop.create_task(self._sweep())
        self._sweeps.add(task)
        task.add_done_callback(self._sweeps.discard)

    async def _sweep(self) -> None:
        async with self._lock:
            await self._evict_retired()
