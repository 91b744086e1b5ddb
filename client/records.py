"""Plain-numpy domain objects of the wire schema: sampling options, streamed chunks, finished records.

These are what users and the rest of maskroll handle; protobuf messages never leave `wire.py`.
Array dtypes are fixed: ids int32, logprobs float32, so records are the same bytes everywhere.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from . import sampling

SCHEMA_VERSION = 1
LOGPROBS_MODE = "processed"  # the logprobs of the distribution the engine actually sampled from


def rollout_id_for(job_id: str, sample_index: int) -> str:
    """Deterministic from job and sample index, so a retried job produces duplicates, not new rollouts."""
    return hashlib.sha256(f"{job_id}\x00{sample_index}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class SamplingOptions:
    """What to sample. Validated by the server against its limits (INVALID_ARGUMENT names the field)."""

    max_tokens: int = 64
    temperature: float = 1.0  # > 0: the record's μ must be a distribution, so there is no greedy mode
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    logprobs_k: int = 20  # K top-K logprobs per token
    n: int = 1  # samples per prompt
    seed: int | None = None  # sample i uses seed + i
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # the model's EOS token stops generation unless this is set

    def problems(self) -> list[str]:
        """What needs no server knowledge (`sampling.problems`); the server re-checks with its limits."""
        return sampling.problems(self)


@dataclass(frozen=True)
class PromptJob:
    """One prompt on the prompt stream: replicas generate `options.n` samples and publish their records."""

    job_id: str
    prompt_ids: np.ndarray  # int32 [P]
    options: SamplingOptions
    group_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    submitted_at: float = 0.0
    rollout_stream: str = ""  # empty: the replica's configured stream


@dataclass(frozen=True)
class Semantics:
    """How to read the logprobs (MATH.md §6): the trainer refuses records whose semantics don't match."""

    logprobs_mode: str = LOGPROBS_MODE
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    logprobs_k: int = 0
    engine: str = ""
    engine_version: str = ""
    model: str = ""


def _empty_k(k: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)


@dataclass
class RolloutChunk:
    """New tokens of one sample, as streamed: arrays cover completion indices [start, start + t)."""

    request_id: str
    sample_index: int
    start_index: int
    token_ids: np.ndarray  # int32 [t]
    sampled_logprobs: np.ndarray  # float32 [t]
    sampled_ranks: np.ndarray  # int32 [t]
    topk_ids: np.ndarray  # int32 [t, K]
    topk_logprobs: np.ndarray  # float32 [t, K]
    policy_version: int
    record: RolloutRecord | None = None  # set on the last chunk of the sample

    @property
    def finished(self) -> bool:
        return self.record is not None


@dataclass
class RolloutRecord:
    """One sampled completion with everything a trainer needs (ARCHITECTURE.md, "The record")."""

    rollout_id: str
    request_id: str
    prompt_ids: np.ndarray  # int32 [P]
    completion_ids: np.ndarray  # int32 [T]
    sampled_logprobs: np.ndarray  # float32 [T]
    sampled_ranks: np.ndarray  # int32 [T], 1-based rank of the sampled token in μ
    topk_ids: np.ndarray  # int32 [T, K], sorted by rank
    topk_logprobs: np.ndarray  # float32 [T, K]
    finish_reason: str  # "stop" | "length" | "abort"
    semantics: Semantics
    policy_version_first: int = 0
    policy_version_last: int = 0
    version_changes: list[tuple[int, int]] = field(default_factory=list)  # (token_index, version)
    job_id: str = ""
    group_id: str = ""
    sample_index: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    replica_id: str = ""
    created_at: float = 0.0
    group_size: int = 1  # samples of this job (n)
    schema_version: int = SCHEMA_VERSION

    @property
    def num_tokens(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def logprobs_k(self) -> int:
        return int(self.topk_ids.shape[1])

    def token_versions(self) -> np.ndarray:  # int64 [T]: the policy version that produced each token
        out = np.full(self.num_tokens, self.policy_version_first, np.int64)
        for index, version in self.version_changes:
            out[index:] = version
        return out


class RecordAssembler:
    """Reassembles streamed chunks into records, one per sample index; checks contiguity."""

    def __init__(self) -> None:
        self._parts: dict[int, list[RolloutChunk]] = {}

    def add(self, chunk: RolloutChunk) -> RolloutRecord | None:
        parts = self._parts.setdefault(chunk.sample_index, [])
        expected = sum(len(c.token_ids) for c in parts)
        if chunk.start_index != expected:
            raise ValueError(
                f"sample {chunk.sample_index}: chunk starts at {chunk.start_index}, expected {expected}"
            )
        parts.append(chunk)
        if chunk.record is None:
            return None
        del self._parts[chunk.sample_index]
        header = chunk.record
        k = header.semantics.logprobs_k
        ids_k, lp_k = _empty_k(k)
        rec = RolloutRecord(**{**header.__dict__})
        rec.completion_ids = np.concatenate([c.token_ids for c in parts]).astype(np.int32, copy=False)
        rec.sampled_logprobs = np.concatenate([c.sampled_logprobs for c in parts]).astype(
            np.float32, copy=False
        )
        rec.sampled_ranks = np.concatenate([c.sampled_ranks for c in parts]).astype(np.int32, copy=False)
        rec.topk_ids = np.concatenate([ids_k, *(c.topk_ids for c in parts)]).astype(np.int32, copy=False)
        rec.topk_logprobs = np.concatenate([lp_k, *(c.topk_logprobs for c in parts)]).astype(
            np.float32, copy=False
        )
        return rec


@dataclass(frozen=True)
class ServerInfo:
    """What a replica serves and the limits it enforces (GetInfo)."""

    model: str
    engine: str
    engine_version: str
    maskroll_version: str
    policy_version: int
    max_logprobs_k: int
    max_model_len: int
    vocab_size: int
    max_tokens: int
    max_n: int
    logprobs_mode: str
    replica_id: str
    max_message_bytes: int
    # How the engine runs the model, defaults resolved (rollout.proto ServerInfo says what each means).
    dtype: str = ""
    seed: int = 0
    max_batch: int = 0
    tensor_parallel_size: int = 1
    quantization: str = ""
    prefix_caching: bool = False
    kv_cache_bytes: int = 0
    gpu_memory_utilization: float = 0.0
    kv_cache_tokens: int = 0


@dataclass(frozen=True)
class WeightsUpdate:
    """An UpdateWeights request: a checkpoint directory, or (not implemented yet) an NCCL broadcast."""

    version: int
    checkpoint_dir: str | None = None  # set when the source is a checkpoint
    collective: bool = False  # the source is a CollectiveSource


@dataclass(frozen=True)
class WeightsUpdateResult:
    version: int
    load_seconds: float
    paused_requests: int  # in-flight requests that were paused and resumed
