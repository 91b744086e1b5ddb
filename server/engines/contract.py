"""The engine contract: what the replica needs from vLLM or the torch reference engine.

An engine generates one sample per request and streams `EngineOutput`s: new tokens with the logprobs
of the *processed* distribution it sampled from (temperature, then top-k, then top-p, renormalised),
exactly K top-K entries per token sorted by rank, and the sampled token's logprob and rank separately.
Cancelling the consumer of `generate` (CancelledError / aclose) must abort the request in the engine.
`score` scores given completions under the same processed μ without sampling (a teacher; docs/records.md
"Scoring"). Engines stop only on `stop_token_ids` and max_tokens / the context (the validation decides
which ids stop, the model's EOS included, so both engines follow one rule). Ranks follow vLLM: the number
of tokens whose μ is at least the sampled token's (so 1 for the most likely token; ties rank it lower).
Engines know nothing of gRPC, Redis or protobuf.

An engine that can serve no more (its decode loop died or is stuck, vLLM's engine core is gone) says why
in `failure()`, which the replica's health status follows (NOT_SERVING: an orchestrator restarts it),
and fails its in-flight and new requests with `EngineDead` (UNAVAILABLE: the client retries elsewhere).
One request that fails inside the engine ends with its own error; the others go on.

Weight updates mid-generation: tokens after the update are sampled by the new weights. vLLM recomputes
the in-flight requests' KV cache with them (pause with clear_cache); the torch reference engine keeps
the cache the old weights wrote. Either way the record's μ is exactly what was sampled and its
version_changes say which tokens came after the update.
"""

from __future__ import annotations

import abc
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from maskroll.proto import sampling
from maskroll.proto.prompts import prompt_problem
from maskroll.proto.tensor_push import AdapterSpec, CollectiveSpec


class EngineDead(Exception):
    """The engine can serve no more requests (its loop died or is stuck, or its core process is gone):
    the replica must be restarted. Not a RuntimeError, so no load or request path mistakes it for bad
    input; the RPC boundary answers UNAVAILABLE."""


@dataclass(frozen=True)
class SamplingParams:
    """One sample's validated sampling parameters (`generation.validation` checked them against the
    replica's limits; `check_request` asks the same rules of them again, as an engine's own guard)."""

    max_tokens: int
    temperature: float = 1.0  # > 0
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    logprobs_k: int = 0  # K
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter resident in an engine (docs/lora.md): one per (namespace, run, version), so an engine
    that caches KV by adapter (vLLM's prefix cache) never mixes versions. A request naming it is sampled
    with base + adapter from its first token to its last, and every output says `version`."""

    name: str  # "<namespace>/<run_id>/v<version>": RolloutRecord.adapter
    id: int  # >= 1, never reused in the replica's life (vLLM's lora_int_id)
    version: int  # the run's policy version this adapter is
    namespace: str
    run_id: str


@dataclass(frozen=True)
class LoraWeights:
    """An adapter's tensors, checked (`weights.tensor_rules.check_adapter`) against the served base:
    "<module>.lora_A.weight" [rank, in] and "<module>.lora_B.weight" [out, rank] (torch tensors, the
    pushed dtype) for each targeted Linear "<module>" of the base; spec: rank, alpha (scale alpha/rank),
    PEFT's target_modules, the base fingerprint."""

    spec: AdapterSpec
    tensors: dict  # {name: torch.Tensor}


@dataclass(frozen=True)
class EngineRequest:
    request_id: str  # unique per sample
    prompt_ids: np.ndarray  # int32 [P]
    params: SamplingParams
    adapter: AdapterRef | None = None  # sample with base + this resident adapter; None: the base weights


@dataclass
class EngineOutput:
    """Tokens produced since the previous output of the same request, all under one policy version.

    Once yielded, its arrays are the consumer's: the engine must not write to them afterwards (the
    serving path keeps them, uncopied, until it joins a chunk: records_builder.SampleBuilder.hold)."""

    token_ids: np.ndarray  # int32 [t]
    sampled_logprobs: np.ndarray  # float32 [t]
    sampled_ranks: np.ndarray  # int32 [t], 1-based
    topk_ids: np.ndarray  # int32 [t, K]
    topk_logprobs: np.ndarray  # float32 [t, K]
    policy_version: int
    finish_reason: str | None = None  # "stop" | "length" on the last output

    @classmethod
    def empty(cls, k: int, policy_version: int, finish_reason: str | None = None) -> EngineOutput:
        """No tokens: how a stream ends without a new token (abort, or a finish after the last one)."""
        return cls(
            token_ids=np.zeros(0, np.int32),
            sampled_logprobs=np.zeros(0, np.float32),
            sampled_ranks=np.zeros(0, np.int32),
            topk_ids=np.zeros((0, k), np.int32),
            topk_logprobs=np.zeros((0, k), np.float32),
            policy_version=policy_version,
            finish_reason=finish_reason,
        )


@dataclass(frozen=True)
class ScoreRequest:
    """Completions of one prompt to score under the processed μ of `params` (temperature, top_k, top_p,
    logprobs_k = K; max_tokens is the longest completion, seed and stop ids are unused): nothing sampled."""

    request_id: str
    prompt_ids: np.ndarray  # int32 [P]
    completions: tuple[np.ndarray, ...]  # int32 [T_i] each
    params: SamplingParams
    adapter: AdapterRef | None = None  # score under base + this resident adapter


@dataclass
class ScoreOutput:
    """Per completion, per token: log μ of the given token (-inf where truncation removed it), its rank
    (the number of tokens whose μ is at least its own, as a sampled token's), the top-K of μ sorted by
    rank. One policy version for every completion of the request."""

    logprobs: list[np.ndarray]  # float32 [T_i]
    ranks: list[np.ndarray]  # int32 [T_i], 1-based
    topk_ids: list[np.ndarray]  # int32 [T_i, K]
    topk_logprobs: list[np.ndarray]  # float32 [T_i, K]
    policy_version: int


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int  # prompt + completion tokens
    max_logprobs: int  # largest K a request may ask for
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids; validation adds them as stops


@dataclass(frozen=True)
class EngineSettings:
    """How an engine runs the model, with every default resolved (GetInfo reports them): what a trainer
    needs to compare its own recompute with, and what an operator sizes a replica by."""

    dtype: str = ""  # "float32" | "bfloat16" | "float16"; "" = not reported
    seed: int = 0  # seeds the random state of requests that bring no seed of their own
    max_batch: int = 0  # most sequences in one engine batch
    tensor_parallel_size: int = 1  # devices the model is split across
    quantization: str = ""  # "" = none
    prefix_caching: bool = False  # KV of shared prompt prefixes is reused
    kv_cache_bytes: int = 0  # fixed KV cache size; 0 = sized by gpu_memory_utilization, or no paged cache
    gpu_memory_utilization: float = 0.0  # fraction of device memory the engine sizes itself to; 0 = fixed
    kv_cache_tokens: int = 0  # tokens the KV cache holds over all sequences; 0 = no paged cache


def check_request(request: EngineRequest, limits: EngineLimits) -> None:
    """An engine's own guard (the pipeline validated already; this catches a caller that did not): a bad
    request fails with a ValueError naming the field instead of inside the engine, or in a batch it shares
    with other requests. The rules are validation's own, asked of the parameters as they are; each engine
    adds only what its arithmetic needs beyond them (its temperature range)."""
    problem = prompt_problem(
        np.asarray(request.prompt_ids),
        vocab_size=limits.vocab_size,
        max_model_len=limits.max_model_len,
        name="prompt_ids",
    )
    if problem:
        raise ValueError(problem)
    # The context and the vocabulary are not limits here: an engine ends a sample at max_model_len
    # ("length"), and a stop id it can never sample is harmless.
    problems = sampling.problems(
        request.params, n=1, max_logprobs=min(limits.max_logprobs, limits.vocab_size)
    )
    if problems:
        raise ValueError(problems[0])


def check_score_request(request: ScoreRequest, limits: EngineLimits) -> None:
    """`check_request` for a score: the prompt and every completion are ids in the vocabulary, each
    prompt + completion fits max_model_len, and the options pass the sampling rules."""
    prompt = np.asarray(request.prompt_ids)
    if not request.completions:
        raise ValueError("completions is empty")
    for i, c in enumerate(request.completions):
        c = np.asarray(c)
        problem = prompt_problem(c, vocab_size=limits.vocab_size, name=f"completion_ids[{i}]")
        if problem:
            raise ValueError(problem)
        check_request(
            EngineRequest(request.request_id, prompt, replace(request.params, max_tokens=int(c.size))),
            limits,
        )
        if prompt.size + c.size > limits.max_model_len:
            raise ValueError(
                f"completion_ids[{i}]: {prompt.size} + {c.size} tokens exceed max_model_len "
                f"{limits.max_model_len}"
            )


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """The model's end-of-sequence ids: generation_config.json, else config.json (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(int(x) for x in (eos if isinstance(eos, list) else [eos]))
    return ()


@dataclass(frozen=True)
class WeightCapabilities:
    """The weight sources an engine loads besides a checkpoint directory (`Engine.update_weights`, which
    every engine has). server/weights/ asks these and nothing else: a new weight transport is a module
    there plus a capability here."""

    # update_weights_from_tensors: a push received straight into memory (one copy, no disk); without it
    # a push is spooled to a file and loaded as a directory
    tensors: bool = False
    nccl: bool = False  # init_weight_transfer + update_weights_collective: NCCL broadcasts (GPUs)
    # apply_weight_patches: a delta push applied in place (no full reload, no second copy of the weights in
    # memory: the torch engine writes the changed elements, vLLM reloads the layers they touch), each
    # tensor's result checked against its digest before the version serves
    patches: bool = False


@dataclass(frozen=True)
class WeightPatch:
    """One changed tensor of a delta push, in checkpoint coordinates (the names and shapes of the model's
    safetensors, as vLLM's `CheckpointWeightPatch`). `values`: a 1-D CPU tensor in the dtype the engine
    holds the tensor in; `indices`: 1-D int32 / int64 flat positions into the tensor (strictly increasing),
    one per value, or None: `values` is the whole tensor, flattened."""

    name: str
    shape: tuple[int, ...]
    values: object  # torch.Tensor [n]
    indices: object | None = None  # torch.Tensor [n] of int32 / int64, or None (dense: n = numel)


class Engine(abc.ABC):
    """A generation backend. One instance per server process; `start` before use, `close` at exit."""

    name: str  # "vllm" | "torch"
    version: str  # engine library version
    model_id: str
    weight_capabilities: WeightCapabilities = WeightCapabilities()

    @property
    @abc.abstractmethod
    def limits(self) -> EngineLimits: ...

    @property
    @abc.abstractmethod
    def policy_version(self) -> int: ...

    @property
    def settings(self) -> EngineSettings:
        """The settings in effect once started. Not abstract: an engine that reports none (a test
        fake) shows the defaults, which say "not reported" where a real engine would say more."""
        return EngineSettings()

    def failure(self) -> str | None:
        """Why the engine can serve no more (dead or stuck), or None while it can. Polled by the replica's
        health monitor about once a second, so it must be cheap; an engine may declare itself dead here
        (a stuck loop), failing what is in flight with EngineDead."""
        return None

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the sample's tokens; the last output has `finish_reason` set."""

    @abc.abstractmethod
    async def update_weights(self, version: int, checkpoint_dir: Path) -> int:
        """Load safetensors weights from `checkpoint_dir` and make `version` current. In-flight requests
        are paused (not dropped) while loading and resume under the new version. Returns the number of
        requests that were in flight."""

    async def update_weights_from_tensors(self, version: int, tensors: dict, label: str) -> int:
        """`update_weights` for tensors already in memory ({name: CPU tensor}, consumed), checked as a
        checkpoint's are; `label` names them in errors. Only with `weight_capabilities.tensors`."""
        raise NotImplementedError(f"the {self.name} engine loads weights from files only")

    async def apply_weight_patches(
        self, version: int, patches: list[WeightPatch], digests: dict[str, str], label: str
    ) -> int:
        """Apply a delta in place and make `version` current (requests paused, as for `update_weights`);
        returns the requests paused. `digests`: {name: xxh3-64 hex (`proto.tensor_push`) of the tensor's
        bytes once applied} for every tensor the engine holds, a tied one once under either name; the
        tensors the patches leave alone must match as they are. Any mismatch, an unknown name, a dtype
        other than the engine's, an index out of range: ValueError naming the first tensor, with nothing
        changed (the old version serves on). Only with `weight_capabilities.patches`."""
        raise NotImplementedError(f"the {self.name} engine applies no weight deltas")

    async def init_weight_transfer(self, spec: CollectiveSpec) -> None:
        """Join the trainer's NCCL group (no weights change). Only with `weight_capabilities.nccl`."""
        raise NotImplementedError(f"the {self.name} engine takes no NCCL weights")

    async def update_weights_collective(self, version: int, spec: CollectiveSpec) -> int:
        """Receive `spec.tensors` over the joined group and make `version` current (requests paused, as
        for `update_weights`); returns the requests paused. Only with `weight_capabilities.nccl`."""
        raise NotImplementedError(f"the {self.name} engine takes no NCCL weights")

    @property
    def max_lora_rank(self) -> int:
        """The largest adapter rank this engine can apply; 0: it takes no adapters (LoRA off)."""
        return 0

    async def add_adapter(self, ref: AdapterRef, weights: LoraWeights) -> None:
        """Make `ref` resident: requests naming it are sampled with base + adapter. The tensors were
        checked against the base; an engine that cannot take them raises ValueError (the old adapters
        keep serving). Requests in flight are not paused: none of them names `ref` yet."""
        raise NotImplementedError(f"the {self.name} engine takes no LoRA adapters")

    async def remove_adapter(self, ref: AdapterRef) -> None:
        """Drop a resident adapter no request in flight names any more (the adapter table's eviction)."""
        raise NotImplementedError(f"the {self.name} engine takes no LoRA adapters")

    async def score(self, request: ScoreRequest) -> ScoreOutput:
        """Score the request's completions without sampling (`ScoreOutput`), all under one policy
        version: the logprobs of the same processed μ `generate` samples from for the same parameters.
        Not abstract: an engine that cannot score (a test fake) says so (UNIMPLEMENTED)."""
        raise NotImplementedError(f"the {self.name} engine does not score")
