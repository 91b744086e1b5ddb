"""The vLLM engine's weight updates, the halves that import no vllm: a delta checked bit for bit against
the checkpoint the engine serves and written as the new version's checkpoint, the workers' end that reloads
the layers it touches from that file, and an NCCL broadcast's layout checked against the served model.

Deltas, and why not vLLM's sparse patches on the live parameters:
- vLLM's parameters are not the checkpoint's tensors (q/k/v fused into qkv_proj, gate/up into
  gate_up_proj), so the digests, taken over the checkpoint's tensors, are checked on the served checkpoint
  (the engine's `_weights_dir`), one tensor at a time: read, cast to the engine's dtype (`Tensor.to`, round
  to nearest even, as vLLM's loader casts), patched, hashed. Nothing is paused or changed until every
  tensor matches. The results are written as they are checked: the new version's checkpoint, which becomes
  the engine's restore point (`_recover`) and the base the next delta is checked against.
- vLLM's `load_checkpoint_weight_patches` (model_executor/model_loader/checkpoint_weight_patch.py) writes
  into the live parameters, which on the CPU platform are not what the kernels read: every Linear weight is
  prepacked for oneDNN after loading and its parameter emptied (model_executor/layers/linear.py
  UnquantizedLinearMethod.process_weights_after_loading -> layers/utils.py dispatch_cpu_unquantized_gemm
  remove_weight=True), and the LM head's packed copy is not its embedding parameter. So the workers reload
  every tensor of each decoder layer (or top-level module) a patch touches, from the checked file, through
  vLLM's in-place layerwise reload, which repacks what it reloads and keeps every other layer's kernel
  tensors as they are (model_loader/reload/layerwise.py finalize_layerwise_processing): the same code and
  the same bytes as a full reload of that file, for the touched layers only, one layer in memory at a time.

The engine module hands `WORKER_EXTENSION` to vLLM and calls `WORKER_METHOD` on the workers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from maskroll.proto.safetensors_layout import SAFETENSORS_NAMES, safetensors_header
from maskroll.proto.tensor_push import TensorSpec, digest_of

from ..weights import checkpoints, tensor_rules
from .contract import EngineSettings, WeightPatch

FILE_NAME = "model.safetensors"
DISK_MARGIN = 64 << 20  # bytes the spool's filesystem keeps free after a delta's checkpoint is written
# Fusion never crosses a decoder layer (qkv_proj, gate_up_proj, an MoE layer's experts are all under
# "<...>.layers.<i>.", or h / blocks / block.<i> in other families), so reloading every tensor of a touched
# layer never leaves a fused parameter half loaded: the layerwise reload would process a half-loaded one
# with uninitialised memory in its other half (NaN logits: tests/server/test_vllm_weights.py shows it).
_LAYER = re.compile(r"^(.*?\.(?:layers|layer|h|blocks|block)\.\d+)\.")


def tied_aliases(model_dir: Path) -> dict[str, str]:
    """{the tied head's name: the embedding's} of a model whose config ties them (`tensor_rules.
    tied_storage`), for the workers' reload (`DeltaWorker`); {} otherwise."""
    shared = sorted(tensor_rules.tied_storage(model_dir))
    heads = [n for n in shared if n.endswith("lm_head.weight")]
    sources = [n for n in shared if n.endswith("embed_tokens.weight")]
    return {heads[0]: sources[0]} if len(heads) == len(sources) == 1 else {}


def reload_group(name: str) -> str:
    """The unit the workers reload `name` with: its decoder layer ("model.layers.3"), else its module."""
    m = _LAYER.match(name)
    return m.group(1) if m else name.rpartition(".")[0]


def check_patch(patch: WeightPatch, shape: tuple[int, ...], dtype, label: str):
    """(int64 flat indices, or None for a whole tensor; values [n]) of a patch on a served tensor of `shape`
    and torch `dtype`, or ValueError naming it: values a 1-D CPU tensor of that dtype, finite; indices
    1-D int32 / int64, one per value, strictly increasing within [0, numel) (so no write order matters)."""
    import torch

    where, values, indices = f"{label}: the patch of {patch.name!r}", patch.values, patch.indices
    if tuple(patch.shape) != shape:
        raise ValueError(f"{where} is for shape {list(patch.shape)}; the served tensor is {list(shape)}")
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.device.type != "cpu":
        raise ValueError(f"{where}: its values must be a 1-D CPU tensor")
    if values.dtype != dtype:
        raise ValueError(f"{where} has {values.dtype} values; the engine holds the tensor in {dtype}")
    bad = tensor_rules.nonfinite(values)
    if bad:
        raise ValueError(f"{where} has {bad} non-finite values (NaN or inf)")
    numel = math.prod(shape)
    if indices is None:
        if values.numel() != numel:
            raise ValueError(f"{where} is dense with {values.numel()} values for {numel} elements")
        return None, values.contiguous()
    if (
        not isinstance(indices, torch.Tensor)
        or indices.dim() != 1
        or indices.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"{where}: its indices must be a 1-D int32 or int64 tensor")
    n = indices.numel()
    if n == 0 or n != values.numel():
        raise ValueError(f"{where} has {n} indices for {values.numel()} values")
    flat = indices.to(torch.int64)
    if int(flat[0]) < 0 or int(flat[-1]) >= numel or (n > 1 and not bool((flat[1:] > flat[:-1]).all())):
        raise ValueError(f"{where}: its indices are not strictly increasing within [0, {numel})")
    return flat, values


async def checked_delta(
    base: Path | None,
    settings: EngineSettings,
    model_dir: Path | None,
    version: int,
    patches: list[WeightPatch],
    digests: Mapping[str, str],
    label: str,
) -> tuple[Path, list[str]]:
    """`write_delta` off the event loop into a new directory of the replica's spool: (the file written,
    the names the workers reload). model_dir: the served model's (its config says whether the head is
    tied to the embedding: `tensor_rules.tied_storage`); None: not tied. On any failure, cancellation
    included, the directory is gone (a cancelled caller leaves the thread writing into a deleted
    directory, which is harmless)."""
    import asyncio

    from ..weights.stream import spool_root

    if base is None:
        raise ValueError(f"{label}: the served weights came over NCCL: no checkpoint to check a delta on")
    if settings.quantization:
        raise ValueError(f"{label}: the engine serves a {settings.quantization} model, which takes no deltas")
    spool = spool_root()
    spool.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f"delta-v{version}-", dir=spool))
    try:
        tied = tensor_rules.tied_storage(model_dir) if model_dir is not None else {}
        args = (base, patches, digests, settings.dtype, out, label, tied)
        return out / FILE_NAME, await asyncio.to_thread(write_delta, *args)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def write_delta(
    base: Path,
    patches: list[WeightPatch],
    digests: Mapping[str, str],
    dtype: str,
    out: Path,
    label: str,
    tied: Mapping[str, str] | None = None,
) -> list[str]:
    """Check a delta on the checkpoint `base` (the served one) and write the result as `out`/FILE_NAME;
    returns the names the workers must reload (the `reload_group` of every patched tensor).

    Every tensor of `base` (floating ones cast to `dtype`, the engine's: "bfloat16") with its patch applied,
    or as it is, must have its digest in `digests`; `digests` may name nothing else, nor may the patches.
    The first bad tensor found is a ValueError naming it. Holds one tensor at a time; the caller deletes
    `out` on any failure. `tied`: `tensor_rules.tied_storage` of the served model: a tied head stored
    beside the embedding (SmolLM2's files) that the delta carries once, under the embedding's name, is
    left out of the new file (the workers feed it the embedding: `DeltaWorker`, as for a full push)."""
    tied = tied or {}
    dropped = {n for n in tied if n not in digests and any(m in digests for m in tied if m != n)}
    with checkpoints.open_checked(checkpoints.checkpoint_of(base)) as opened:
        # the result's layout, in the base's order
        specs = {s.name: s for s in _served(opened, dtype) if s.name not in dropped}
        _check_names(specs, patches, digests, label)
        checked = {
            p.name: check_patch(p, specs[p.name].shape, _torch_dtype(specs[p.name]), label) for p in patches
        }
        header = safetensors_header(specs.values())
        offsets, at = {}, len(header)
        for s in specs.values():
            offsets[s.name], at = at, at + s.nbytes
        _check_room(out, at, label)
        with open(out / FILE_NAME, "wb") as f:
            f.write(header)
            # One tensor read, patched, hashed and written at a time, in the files' own order.
            for file, fd in opened:
                for name, t in checkpoints.read_safetensors(fd, str(file.real)):
                    if name in dropped:
                        continue
                    result = _raw(_result(t, specs[name], checked.get(name)))
                    got = digest_of(result)
                    if got != digests[name]:
                        raise ValueError(
                            f"{label}: tensor {name!r} would be {got} once applied, the trainer's is "
                            f"{digests[name]} (a patch on other weights, or corrupted): the version is "
                            "refused, nothing changed"
                        )
                    f.seek(offsets[name])
                    f.write(result)
    touched = {reload_group(n) for n in checked}
    return [n for n in specs if reload_group(n) in touched]


def _served(opened: list[tuple[checkpoints.CheckedFile, int]], dtype: str) -> list[TensorSpec]:
    """Every tensor of the opened files, from their headers, as the engine holds it: floating ones in
    `dtype` (a torch name), the others as stored."""
    from safetensors import safe_open

    specs: dict[str, TensorSpec] = {}
    for file, fd in opened:
        try:
            with safe_open(checkpoints.fd_path(fd, file.real), framework="pt") as f:
                layouts = [(n, f.get_slice(n)) for n in f.keys()]  # noqa: SIM118  (not a Mapping)
                layouts = [(n, h.get_dtype(), tuple(h.get_shape())) for n, h in layouts]
        except Exception as e:  # SafetensorError is no ValueError
            raise ValueError(f"{file.real} is not a readable safetensors file: {e}") from e
        for name, stored, shape in layouts:
            if name in specs:
                raise ValueError(f"the served checkpoint holds tensor {name!r} twice")
            held = SAFETENSORS_NAMES[dtype] if tensor_rules.floating_dtype(stored) else stored
            nbytes = math.prod(shape) * checkpoints.torch_dtype(held).itemsize
            specs[name] = TensorSpec(name, held, shape, nbytes)
    return list(specs.values())


def _check_room(out: Path, nbytes: int, label: str) -> None:
    free = shutil.disk_usage(out).free
    if nbytes + DISK_MARGIN > free:
        raise ValueError(
            f"{label}: the new version's checkpoint ({nbytes} bytes) does not fit in the spool "
            f"{str(out.parent)!r} ({free} bytes free)"
        )


def _torch_dtype(spec: TensorSpec):
    return checkpoints.torch_dtype(spec.dtype)


def _check_names(specs: Mapping, patches: list[WeightPatch], digests: Mapping[str, str], label: str) -> None:
    """Every served tensor has a digest, no digest or patch names another, a tensor has one patch at most."""
    for name in digests:
        if name not in specs:
            raise ValueError(f"{label}: tensor {name!r} is not in the served checkpoint")
    for name in specs:
        if name not in digests:
            raise ValueError(f"{label}: tensor {name!r} has no digest: the delta does not cover the model")
    seen: set[str] = set()
    for p in patches:
        if p.name not in specs:
            raise ValueError(f"{label}: the patch of {p.name!r} is for a tensor the served checkpoint lacks")
        if p.name in seen:
            raise ValueError(f"{label}: tensor {p.name!r} has two patches")
        seen.add(p.name)


def _result(t, spec: TensorSpec, patch):
    """The tensor `t` as read from the base, cast as the engine holds it, with `patch` applied: [numel]."""
    cast = t.to(_torch_dtype(spec)).reshape(-1)  # a new tensor, or `t` itself: ours either way
    if patch is None:
        return cast
    indices, values = patch
    if indices is None:
        return values
    return cast.index_copy_(0, indices, values)


def _raw(t) -> memoryview:
    import torch

    return memoryview(t.contiguous().view(torch.uint8).numpy())


# ---- the workers' end ---------------------------------------------------------------------------------

# vLLM warns, on every partial reload, about each layer the iterator did not reach ("Failed to load
# weights") and lists every such weight ("Following weights were not loaded"): here that is the point.
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


class DeltaWorker:
    """Mixed into vLLM's worker class (`worker_extension_cls`, v1/worker/worker_base.py
    WorkerWrapperBase.init_worker), so that `collective_rpc(WORKER_METHOD)` runs on every worker. Shim: a
    callable sent over collective_rpc would need VLLM_ALLOW_INSECURE_SERIALIZATION (v1/serial_utils.py);
    a method name needs nothing."""

    def maskroll_reload_tensors(
        self, directory: str, names: list[str] | None, aliases: dict[str, str] | None = None
    ) -> int:
        """Reload the tensors `names` (None: all) of the *.safetensors files in `directory` in place, one at
        a time, through the worker's own in-place reload (Worker.reload_weights with an iterator: the
        layerwise reload; it also drops the LoRA cache, which the engine re-adds); returns how many. vLLM
        logs "RotaryEmbedding: Failed to load weights": the rotary cache is in no checkpoint and is kept
        (model_loader/reload/layerwise.py finalize_layerwise_processing), which is correct.

        `aliases` {name: source}: a tied head (`tied_aliases`) the files leave out is fed its source's
        tensor whenever that is reloaded. On CPU vLLM keeps the head's own packed copy: a reload without
        it kept the old head (bench/vllm_tied_delta.py), whatever tie_word_embeddings says."""
        wanted = None if names is None else set(names)
        aliases = aliases or {}
        count = [0]

        def tensors() -> Iterator:
            from safetensors import safe_open

            files = sorted(Path(directory).glob("*.safetensors"))
            stored = set()
            for path in files:
                with safe_open(str(path), framework="pt") as f:
                    stored.update(f.keys())
            fed = {alias: source for alias, source in aliases.items() if alias not in stored}
            for path in files:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118
                        if wanted is None or name in wanted:
                            t = f.get_tensor(name)
                            count[0] += 1
                            yield name, t
                            for alias in (a for a, src in fed.items() if src == name):
                                count[0] += 1
                                yield alias, t

        with _quiet(_RELOAD_LOGGERS):
            self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        return count[0]


WORKER_EXTENSION = f"{DeltaWorker.__module__}.{DeltaWorker.__qualname__}"
WORKER_METHOD = DeltaWorker.maskroll_reload_tensors.__name__


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


# ---- NCCL broadcasts ----------------------------------------------------------------------------------


def broadcast_update_info(tensors: list, model_dir: Path) -> dict:
    """vLLM's update_info for a broadcast of `tensors` (`tensor_push` specs: names, torch dtype names,
    shapes, in the trainer's order), checked first against the served model's files: the weight rules
    without `missing` (a broadcast may send a part) and without finite values (the trainer's check,
    weight_sync/nccl.py: the bytes land in the model directly). A mismatch would hang NCCL or load garbage."""
    new = {t.name: tensor_rules.Layout(tuple(t.shape), tensor_rules.floating_dtype(t.dtype)) for t in tensors}
    m = tensor_rules.compare(new, tensor_rules.directory_layouts(model_dir))
    if not new or m.unexpected or m.wrong_shape or m.wrong_dtype:
        kinds = f", wrong dtype (floating point or not) {m.wrong_dtype[:5]}" if m.wrong_dtype else ""
        raise ValueError(
            f"the broadcast does not match the served model: unexpected {m.unexpected[:5]}, wrong shape "
            f"{m.wrong_shape[:5]}{kinds} ({len(m.missing)} of its tensors not sent)"
        )
    return {
        "names": [t.name for t in tensors],
        "dtype_names": [t.dtype for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
    }


def sparse_update_info(spec, model_dir: Path) -> dict:
    """`broadcast_update_info` of a "sparse_nccl" spec: also the (index, value) pairs sent per tensor
    (vLLM's SparseNCCLWeightTransferUpdateInfo.num_updates_list, from each TensorSpec's `changed`)."""
    info = broadcast_update_info(spec.tensors, model_dir)
    if spec.backend == "sparse_nccl":
        info["num_updates_list"] = [int(t.changed) for t in spec.tensors]
    return info


def check_transfer_backend(spec, vllm_config) -> None:
    """ValueError naming both unless `spec.backend` is the weight-transfer backend the engine's workers
    were started with: the other backend's update info fails in the workers, or their receives do not
    match the trainer's broadcasts (NCCL hangs). Shim: VllmConfig.weight_transfer_config (config/vllm.py;
    None without --vllm-arg weight_transfer_config) and its `backend` (config/weight_transfer.py)."""
    config = vllm_config.weight_transfer_config
    started = None if config is None else config.backend
    if started != spec.backend:
        raise ValueError(
            f"the trainer sends with weight-transfer backend {spec.backend!r}, this engine was started with "
            f"{started!r}: start it with --vllm-arg weight_transfer_config="
            + json.dumps({"backend": spec.backend})
        )


def broadcast_init_info(spec) -> dict:
    """vLLM's init_info for joining the trainer's NCCL group (a `tensor_push.CollectiveSpec` with init)."""
    return {
        "master_address": spec.master_address,
        "master_port": int(spec.master_port),
        "rank_offset": int(spec.rank_offset),
        "world_size": int(spec.world_size),
        "packed": bool(spec.packed),
    }
