"""The PushWeights and CollectiveSource half of the protobuf ⇄ domain converter (`wire` re-exports it, so
callers import one converter): a push's manifest and data chunks, and an NCCL update's source.

Beside the plain conversions, the byte paths a push's throughput rests on: `push_chunk_bytes` serialises a
data chunk with one copy of the tensor's bytes, and `push_chunk_from_pb` reads one from its raw bytes as a
view (the replica's handler takes them undeserialised), where protobuf's own parse and field access would
copy every pushed byte twice more (bench/weights.py).
"""

from __future__ import annotations

from . import varint
from ._generated import rollout_pb2 as pb
from .tensor_push import DENSE, AdapterSpec, CollectiveSpec, TensorSpec, WeightsManifest


def tensor_spec_to_pb(t: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(
        name=t.name,
        dtype=t.dtype,
        shape=list(t.shape),
        nbytes=t.nbytes,
        crc32=t.crc32,
        encoding="" if t.encoding == DENSE else t.encoding,
        changed=t.changed,
        digest=t.digest,
    )


def tensor_spec_from_pb(m: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(
        name=m.name,
        dtype=m.dtype,
        shape=tuple(m.shape),
        nbytes=m.nbytes,
        crc32=m.crc32,
        encoding=m.encoding or DENSE,
        changed=m.changed,
        digest=m.digest,
    )


def adapter_spec_to_pb(a: AdapterSpec) -> pb.AdapterSpec:
    return pb.AdapterSpec(
        rank=a.rank, alpha=a.alpha, target_modules=list(a.target_modules), base_fingerprint=a.base_fingerprint
    )


def adapter_spec_from_pb(m: pb.AdapterSpec) -> AdapterSpec:
    return AdapterSpec(
        rank=m.rank,
        alpha=m.alpha,
        target_modules=tuple(m.target_modules),
        base_fingerprint=m.base_fingerprint,
    )


def manifest_to_pb(m: WeightsManifest) -> pb.WeightsPushChunk:
    return pb.WeightsPushChunk(
        manifest=pb.WeightsManifest(
            version=m.version,
            run_id=m.run_id,
            tensors=[tensor_spec_to_pb(t) for t in m.tensors],
            adapter=None if m.adapter is None else adapter_spec_to_pb(m.adapter),
            namespace=m.namespace,
            base_version=m.base_version,
        )
    )


def manifest_from_pb(m: pb.WeightsPushChunk | bytes) -> WeightsManifest:
    """The manifest a push starts with (a message, or its serialized bytes: the replica's PushWeights
    handler takes raw bytes, `push_chunk_from_pb`); ValueError if the first message is not one."""
    if isinstance(m, bytes):
        try:
            m = pb.WeightsPushChunk.FromString(m)
        except Exception as e:  # protobuf's DecodeError
            raise ValueError(f"the first PushWeights message is not a WeightsPushChunk: {e}") from e
    if m.WhichOneof("part") != "manifest":
        raise ValueError("a PushWeights call must start with its manifest, got a data chunk first")
    mf = m.manifest
    return WeightsManifest(
        version=mf.version,
        run_id=mf.run_id,
        tensors=tuple(tensor_spec_from_pb(t) for t in mf.tensors),
        adapter=adapter_spec_from_pb(mf.adapter) if mf.HasField("adapter") else None,
        namespace=mf.namespace,
        base_version=mf.base_version if mf.HasField("base_version") else None,
    )


def push_chunk_to_pb(index: int, offset: int, data: bytes | memoryview) -> pb.WeightsPushChunk:
    return pb.WeightsPushChunk(data=pb.TensorChunk(index=index, offset=offset, data=bytes(data)))


def push_chunk_bytes(index: int, offset: int, data: bytes | memoryview) -> bytes:
    """`push_chunk_to_pb(index, offset, data).SerializeToString()`, built with one copy of `data` (a
    view of the trainer's tensor) instead of three (bytes(), the message, its serialization): the
    trainer's CPU time per pushed byte, per replica (bench/weights.py). The PushWeights caller sends it
    with no request serializer (`PUSH_WEIGHTS_METHOD`)."""
    n = memoryview(data).nbytes
    inner = b""
    if index:  # proto3 leaves zero scalars out, as SerializeToString does
        inner += b"\x08" + varint.encode(index)  # TensorChunk.index = 1, varint
    if offset:
        inner += b"\x10" + varint.encode(offset)  # TensorChunk.offset = 2, varint
    inner += b"\x1a" + varint.encode(n)  # TensorChunk.data = 3, length-delimited
    # WeightsPushChunk.data = 2, length-delimited
    return b"".join((b"\x12", varint.encode(len(inner) + n), inner, data))


_PUSH = pb.DESCRIPTOR.services_by_name["RolloutService"].methods_by_name["PushWeights"]
PUSH_WEIGHTS_METHOD = f"/{_PUSH.containing_service.full_name}/{_PUSH.name}"


def _fields(buf: memoryview):
    """(field number, wire type, value) of a serialized message: an int for varints, a memoryview slice
    (no copy) for length-delimited fields; fixed-width fields are skipped."""
    i = 0
    while i < len(buf):
        key, i = varint.decode(buf, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, i = varint.decode(buf, i)
        elif kind == 2:
            n, i = varint.decode(buf, i)
            if i + n > len(buf):
                raise ValueError(f"a PushWeights message is truncated: field {number} needs {n} bytes")
            value, i = buf[i : i + n], i + n
        elif kind in (1, 5):
            value, i = None, i + (8 if kind == 1 else 4)
        else:
            raise ValueError(f"a PushWeights message is malformed (wire type {kind} of field {number})")
        yield number, kind, value
    if i != len(buf):
        raise ValueError("a PushWeights message is truncated (a fixed-width field runs past its end)")


def _chunk_from_bytes(raw: bytes) -> tuple[int, int, memoryview]:
    # WeightsPushChunk {manifest = 1, data = 2}; TensorChunk {index = 1, offset = 2, data = 3}. Later
    # occurrences of a field win, as in protobuf's own parser (an embedded message merges).
    index = offset = 0
    data, part = memoryview(b""), None
    for number, kind, value in _fields(memoryview(raw)):
        if number in (1, 2) and kind == 2:
            part = number
        if number == 2 and kind == 2:
            for n, k, v in _fields(value):
                if k == 0 and n == 1:
                    index = v
                elif k == 0 and n == 2:
                    offset = v
                elif k == 2 and n == 3:
                    data = v
    if part != 2:
        raise ValueError("a PushWeights call carries one manifest, first; got another one mid-stream")
    return index, offset, data


def push_chunk_from_pb(m: pb.WeightsPushChunk | bytes) -> tuple[int, int, bytes | memoryview]:
    """(tensor index, byte offset, bytes); ValueError for a second manifest. Given the message's
    serialized bytes (the replica's PushWeights handler has no request deserializer:
    server/grpc_api/servicer.py `add_raw_handlers`), the data is a view into them: protobuf's parse
    and its field access would copy every pushed byte twice more, over half of a replica's CPU for a
    push (bench/weights.py)."""
    if isinstance(m, bytes):
        return _chunk_from_bytes(m)
    if m.WhichOneof("part") != "data":
        raise ValueError("a PushWeights call carries one manifest, first; got another one mid-stream")
    return m.data.index, m.data.offset, m.data.data


def collective_to_pb(c: CollectiveSpec) -> pb.CollectiveSource:
    return pb.CollectiveSource(
        group_name=c.group_name,
        master_address=c.master_address,
        master_port=c.master_port,
        rank_offset=c.rank_offset,
        world_size=c.world_size,
        init=c.init,
        tensors=[tensor_spec_to_pb(t) for t in c.tensors],
        packed=c.packed,
        backend="" if c.backend == "nccl" else c.backend,
    )


def collective_request(version: int, c: CollectiveSpec, run_id: str = "") -> pb.UpdateWeightsRequest:
    return pb.UpdateWeightsRequest(version=version, collective=collective_to_pb(c), run_id=run_id)


def collective_from_pb(m: pb.UpdateWeightsRequest) -> CollectiveSpec | None:
    """The request's NCCL source, or None when its source is not `collective`."""
    if m.WhichOneof("source") != "collective":
        return None
    c = m.collective
    return CollectiveSpec(
        group_name=c.group_name,
        master_address=c.master_address,
        master_port=c.master_port,
        rank_offset=c.rank_offset,
        world_size=c.world_size,
        init=c.init,
        tensors=tuple(tensor_spec_from_pb(t) for t in c.tensors),
        packed=c.packed,
        backend=c.backend or "nccl",  # "": what every trainer sent before the field existed
    )
