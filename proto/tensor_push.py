"""The manifest of a pushed state dict (PushWeights): which tensors follow, their layout and checksums.

A push is the manifest, then every tensor's raw little-endian bytes in manifest order, cut into chunks
of at most `chunk_bytes`. Dtypes are named as safetensors names them (F32, BF16, ...: the table is
`safetensors_layout`'s), so the replica can place the bytes straight into tensors of those dtypes, or
into a safetensors file it loads like a checkpoint directory (server/weights). Pure data and checks:
knows nothing of torch (the trainer side turns tensors into these), grpc or protobuf (`wire.py`
converts).
"""

from __future__ import annotations

from dataclasses import dataclass

from .safetensors_layout import ITEM_SIZES
from .weights_fingerprint import digests_fingerprint

# A chunk rides in one gRPC message, which the replica caps (--max-message-bytes, 16 MiB by default).
# 4 MiB: large enough that the per-message cost is noise next to the bytes (1 MiB costs 5-10 % more CPU
# on either side), small next to what gRPC's flow-control window buffers anyway on a fast link (tens of
# MiB: a replica's update peaks at the model plus 15-60 MB, bench/weights.py and docs/benchmarks.md).
DEFAULT_CHUNK_BYTES = 4 << 20


# How a delta push sends a tensor (TensorSpec.encoding; docs/architecture.md flow 4). A full push sends
# every tensor dense.
DENSE, SPARSE, SAME = "dense", "sparse", "same"
ENCODINGS = (DENSE, SPARSE, SAME)
DIGEST_HEX = 16  # xxh3-64, hex


def digest_of(data: bytes | memoryview) -> str:
    """A tensor's digest: xxh3-64 (hex) of its raw bytes (22 GB/s on one core, bench/weights.py). xxhash
    is imported here: the trainer and the replica need it, a plain client never calls this."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


def index_bytes(numel: int) -> int:
    """Bytes per flat index of a sparse patch on a tensor of `numel` elements: int32, int64 past 2**31."""
    return 4 if numel <= 2**31 - 1 else 8


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors name
    shape: tuple[int, ...]
    nbytes: int  # bytes sent: the dense tensor's, a sparse patch's (indices then values), 0 when same
    crc32: int = 0  # zlib.crc32 of the bytes sent
    encoding: str = DENSE
    changed: int = 0  # sparse: elements changed (the patch's indices, then as many values)
    digest: str = ""  # xxh3-64 hex of the tensor's bytes once applied ("": not verified)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def dense_bytes(self) -> int:
        return self.numel * ITEM_SIZES[self.dtype]

    def check(self) -> None:
        """Raise ValueError naming the tensor if its layout is inconsistent."""
        if not self.name:
            raise ValueError("a tensor in the manifest has an empty name")
        if self.dtype not in ITEM_SIZES:
            raise ValueError(f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {sorted(ITEM_SIZES)}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in shape {list(self.shape)}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"tensor {self.name!r}: encoding {self.encoding!r} is not one of {ENCODINGS}")
        if self.digest and (len(self.digest) != DIGEST_HEX or self.digest.strip("0123456789abcdef")):
            raise ValueError(f"tensor {self.name!r}: digest {self.digest[:40]!r} is not {DIGEST_HEX} hex")
        if self.encoding == SPARSE:
            if not 0 < self.changed <= self.numel:
                raise ValueError(
                    f"tensor {self.name!r}: a sparse patch of {self.changed} elements on {self.numel}"
                )
            want, what = self.changed * (index_bytes(self.numel) + ITEM_SIZES[self.dtype]), "its patch"
        elif self.encoding == SAME:
            want, what = 0, "an unchanged tensor"
        else:
            want, what = self.dense_bytes, f"shape {list(self.shape)} of {self.dtype}"
        if self.encoding != SPARSE and self.changed:
            raise ValueError(f"tensor {self.name!r}: changed={self.changed} on a {self.encoding} tensor")
        if self.nbytes != want:
            raise ValueError(f"tensor {self.name!r}: nbytes {self.nbytes} != {want} ({what})")


LORA_A = ".lora_A.weight"  # [rank, in_features] of the Linear "<module>"
LORA_B = ".lora_B.weight"  # [out_features, rank]


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter's configuration (PEFT's convention: W' = W + (alpha / rank) · B · A for each targeted
    Linear). target_modules: PEFT's short names as trained ("q_proj", ...); base_fingerprint: the
    `proto.weights_fingerprint` of the base weights it was trained on (a replica on another base refuses
    it)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_fingerprint: str

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self, tensors: tuple[TensorSpec, ...]) -> None:
        """Raise ValueError unless `tensors` are exactly pairs "<module>.lora_A.weight" [rank, in] and
        "<module>.lora_B.weight" [out, rank] of this rank (the shapes against the base: tensor_rules)."""
        if self.rank < 1:
            raise ValueError(f"adapter rank {self.rank} must be >= 1")
        if not (self.alpha > 0 and self.alpha < float("inf")):
            raise ValueError(f"adapter alpha {self.alpha} must be a positive finite number")
        if not self.base_fingerprint:
            raise ValueError("the adapter names no base fingerprint: which base was it trained on?")
        a, b = {}, {}
        for t in tensors:
            if t.name.endswith(LORA_A):
                a[t.name[: -len(LORA_A)]] = t
            elif t.name.endswith(LORA_B):
                b[t.name[: -len(LORA_B)]] = t
            else:
                raise ValueError(
                    f"tensor {t.name!r} is not a LoRA tensor ('<module>{LORA_A}' or '<module>{LORA_B}')"
                )
        if set(a) != set(b):
            lone = sorted(set(a) ^ set(b))
            raise ValueError(f"LoRA modules {lone[:3]} have lora_A without lora_B or the reverse")
        for module in a:
            ta, tb = a[module], b[module]
            if (
                len(ta.shape) != 2
                or len(tb.shape) != 2
                or ta.shape[0] != self.rank
                or tb.shape[1] != self.rank
            ):
                raise ValueError(
                    f"LoRA module {module!r}: lora_A {list(ta.shape)} and lora_B {list(tb.shape)} are not "
                    f"[{self.rank}, in] and [out, {self.rank}] (rank {self.rank})"
                )


@dataclass(frozen=True)
class WeightsManifest:
    version: int
    tensors: tuple[TensorSpec, ...]
    run_id: str = ""
    adapter: AdapterSpec | None = None  # set: the tensors are a LoRA adapter on the replica's base
    namespace: str = ""  # the run's namespace on a replica serving several; "": the replica's own
    base_version: int | None = None  # set: a delta on this version of `run_id` (every tensor listed)

    @property
    def total_bytes(self) -> int:
        """Bytes the push sends (a delta's patches, not the model's size)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def is_delta(self) -> bool:
        return self.base_version is not None

    @property
    def verified(self) -> bool:
        """Every tensor carries the digest of its result: the replica checks them all once applied."""
        return all(t.digest for t in self.tensors)

    @property
    def digests_fingerprint(self) -> str:
        """The version's weights fingerprint by its digests (`weights_fingerprint.digests_fingerprint`),
        the same on the trainer and on a replica that checked them; "" unless every tensor of full
        weights has one."""
        if not self.verified or self.adapter is not None:
            return ""
        return digests_fingerprint((t.name, t.digest) for t in self.tensors)

    def check(self, max_bytes: int | None = None) -> None:
        """Raise ValueError if the manifest is empty, names a tensor twice, has an inconsistent tensor, a
        delta that is not one (no run, no digests, not on an earlier version, an adapter) or a patch in a
        full push, or is larger than `max_bytes`."""
        if self.version < 0:
            raise ValueError(f"version {self.version} is negative")
        if not self.tensors:
            raise ValueError("the manifest lists no tensors: nothing to load")
        seen: set[str] = set()
        for t in self.tensors:
            t.check()
            if t.name in seen:
                raise ValueError(f"tensor {t.name!r} appears twice in the manifest")
            seen.add(t.name)
        if self.is_delta:
            if not self.run_id or self.adapter is not None:
                raise ValueError("a delta push needs a run id and full weights (an adapter is sent whole)")
            if not 0 <= self.base_version < self.version:
                raise ValueError(f"a delta on version {self.base_version} cannot make version {self.version}")
            if not self.verified:
                raise ValueError("a delta push must carry every tensor's digest: its result is checked")
        elif any(t.encoding != DENSE for t in self.tensors):
            raise ValueError("a full push sends every tensor dense (sparse or same only in a delta)")
        if self.adapter is not None:
            self.adapter.check(self.tensors)
        if max_bytes is not None and self.total_bytes > max_bytes:
            raise ValueError(
                f"the pushed weights are {self.total_bytes} bytes, more than this replica accepts "
                f"({max_bytes})"
            )


# vLLM's weight-transfer backends a CollectiveSource may name (proto `CollectiveSource.backend`): "nccl" sends
# every listed tensor whole, "sparse_nccl" (vLLM's sparse_nccl_engine.py) per tensor `changed` int32 flat
# indices then their values, never packed. Both ends check against this one list.
COLLECTIVE_BACKENDS = ("nccl", "sparse_nccl")
SPARSE_NCCL = "sparse_nccl"


@dataclass(frozen=True)
class CollectiveSpec:
    """An UpdateWeights through an NCCL group (proto CollectiveSource): the trainer is rank 0 of
    `world_size` ranks, this replica's workers start at `rank_offset`. `init`: join the group (the
    rendezvous at master_address:master_port) and load nothing; else receive `tensors`, in order. With
    backend "sparse_nccl" each tensor's `changed` is how many (index, value) pairs are broadcast for it."""

    group_name: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    init: bool = False
    tensors: tuple[TensorSpec, ...] = ()
    packed: bool = True
    backend: str = "nccl"

    def check(self) -> None:
        """Raise ValueError naming what the receiver cannot take: an unknown backend, a packed sparse
        broadcast, a sparse tensor with no pair, more pairs than elements or more elements than int32
        indices reach, or pair counts on a dense broadcast."""
        if self.backend not in COLLECTIVE_BACKENDS:
            raise ValueError(
                f"backend {self.backend!r} is not one of {', '.join(map(repr, COLLECTIVE_BACKENDS))}"
            )
        if self.backend != SPARSE_NCCL:
            counted = [t.name for t in self.tensors if t.changed]
            if counted:
                raise ValueError(
                    f"a {self.backend!r} broadcast sends tensors whole; {counted[:3]} carry counts"
                )
            return
        if self.packed:
            raise ValueError(
                "a sparse_nccl broadcast is never packed (vLLM's sparse engine sends no buffers)"
            )
        for t in self.tensors:
            if index_bytes(t.numel) != 4:  # vLLM's sparse engine receives int32 indices only
                raise ValueError(f"tensor {t.name!r}: {t.numel} elements, past what int32 indices address")
            if not 0 < t.changed <= t.numel:
                raise ValueError(
                    f"tensor {t.name!r}: a sparse_nccl patch of {t.changed} elements on {t.numel}"
                )
