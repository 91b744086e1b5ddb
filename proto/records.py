"""Plain-numpy domain objects of the wire schema: sampling options, streamed chunks, finished records.

These are what users and the rest of maskroll handle; protobuf messages never leave `wire.py`.
Array dtypes are fixed: ids int32, logprobs float32, so records are the same bytes everywhere.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from . import sampling
from .tensor_push import CollectiveSpec

SCHEMA_VERSION = 1
# A RolloutRecord with a loss mask (a multi-turn trajectory) is written as version 2: its logprob arrays
# cover the sampled tokens only on the wire, which a version-1 reader would misread, so it refuses them;
# single-turn records stay version 1 and every reader reads them.
MULTI_TURN_SCHEMA_VERSION = 2
LOGPROBS_MODE = "processed"  # the logprobs of the distribution the engine actually sampled from
# A log-probability is <= 0; float32 log-softmax of a near-certain token can round a hair above.
LOGPROB_SLACK = 1e-3


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
        return sampling.problems(self, n=self.n)


@dataclass(frozen=True)
class GenerateRequest:
    """A Generate request as a replica serves it: the gRPC message's (and the native JSON API's) fields as
    plain values (`wire.generate_from_pb`); what the SDK sends is built by `wire.generate_request`."""

    prompt_ids: np.ndarray  # int32 [P]
    options: SamplingOptions
    request_id: str = ""  # "" = the replica makes one
    job_id: str = ""  # gives the rollout ids (a retried job yields the same ones)
    group_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    rollout_stream: str = ""  # publish the finished records there ("" = don't)
    include_record_arrays: bool = False  # the last chunk's record carries its arrays too
    namespace: str = ""  # sample with this namespace's current LoRA adapter ("" = the replica's own)


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
    run_id: str = ""  # the submitting trainer's run; the replica copies it into every record


@dataclass(frozen=True)
class Semantics:
    """How to read the logprobs (docs/math.md §6): the trainer refuses records whose semantics don't match."""

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

    @property
    def logprobs_k(self) -> int:
        """K: the width of the chunk's top-K arrays (its record's K; `RecordAssembler` refuses another)."""
        return int(self.topk_ids.shape[1]) if self.topk_ids.ndim == 2 else 0


@dataclass
class RolloutRecord:
    """One sampled completion with everything a trainer needs (docs/records.md describes every field).

    Identity: `rollout_id` = f(job_id, sample_index), so a re-run job yields duplicates, not new rollouts;
    `request_id`, `job_id`, `group_id` (the GRPO group), `sample_index` of `group_size` samples,
    `metadata` (the job's, copied), `replica_id`, `created_at` (unix seconds), `run_id` (the training run:
    the job's run in pull mode; a trainer refuses records of another run, and records without one).
    Tokens: `prompt_ids` [P], `completion_ids` [T], `finish_reason` ("stop" | "length" | "abort").
    Logprobs of the *processed* distribution μ the engine sampled from (temperature, then top-k / top-p):
    `sampled_logprobs` [T] = log μ(sampled token), `sampled_ranks` [T] (1 = the most likely),
    `topk_ids` / `topk_logprobs` [T, K] sorted by rank. `semantics` says how to read them (temperature,
    top_p, top_k, K, engine, model). Versions: the policy version at the first and last token and
    `version_changes` [(token_index, version)] where an UpdateWeights landed mid-generation.

    A record read from Redis (wire.decode_record: every record a RolloutQueue hands out) holds its
    [T, K] top-K arrays as read-only views of its payload, not copies: copy one before writing into it.
    """

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
    run_id: str = ""  # the training run; "" = unknown (a producer older than run ids)
    # Multi-turn trajectories (an HTTP agent session): the completion is every token after the first
    # prompt; loss_mask (bool [T]) marks the ones the model sampled (None: all of them, one turn). The
    # logprob arrays stay [T] / [T, K], zero where the mask is False. segment_starts: completion indices
    # where a fresh prompt begins (the client edited its history); num_turns: model calls (0: one record).
    loss_mask: np.ndarray | None = None
    segment_starts: list[int] = field(default_factory=list)
    num_turns: int = 0
    # The reward, set by the reward stage (docs/rewards.md "The reward stage"); None: not scored.
    # reward_verifier: which verifier or function scored it; reward_reason: why this value.
    reward: float | None = None
    reward_verifier: str = ""
    reward_reason: str = ""
    # The teacher's scores, set by the teacher stage (docs/records.md "Teacher fields"); None: no teacher
    # scored it. At the record's positions (multi-turn: zero where loss_mask is False); teacher_semantics
    # says which μ_teacher they describe (its model, temperature / top-k / top-p, K_teacher).
    teacher_topk_ids: np.ndarray | None = None  # int32 [T, K_teacher], sorted by rank
    teacher_topk_logprobs: np.ndarray | None = None  # float32 [T, K_teacher]
    teacher_sampled_logprobs: np.ndarray | None = None  # float32 [T] log μ_teacher(completion token)
    teacher_semantics: Semantics | None = None
    teacher_policy_version: int = 0
    # The LoRA adapter that sampled every token, "<namespace>/<run_id>/v<version>" (docs/lora.md); "": the
    # replica's full weights. Its version is policy_version_first == policy_version_last (an adapter
    # request never changes version mid-sample).
    adapter: str = ""

    @property
    def has_teacher(self) -> bool:
        """Whether a teacher scored this record (its teacher arrays and semantics are set)."""
        return self.teacher_semantics is not None

    @property
    def num_tokens(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def logprobs_k(self) -> int:
        """K, the number of top-K logprobs per token: the one answer every reader of a record asks. It is
        the width of the [T, K] arrays, which `semantics.logprobs_k` must declare: `wire.decode_record`
        reads the arrays at the declared K (so no record it returns disagrees) and `problems()` names a
        record built in memory whose arrays and semantics disagree."""
        return int(self.topk_ids.shape[1])

    @property
    def generated(self) -> np.ndarray:  # bool [T]: which completion tokens the model sampled
        if self.loss_mask is None:
            return np.ones(self.num_tokens, bool)
        return np.asarray(self.loss_mask, bool)

    def token_versions(self) -> np.ndarray:  # int64 [T]: the policy version that produced each token
        out = np.full(self.num_tokens, self.policy_version_first, np.int64)
        for index, version in self.version_changes:
            out[index:] = version
        return out

    @property
    def max_policy_version(self) -> int:
        """The newest policy version any of its tokens came from."""
        return max(
            [self.policy_version_first, self.policy_version_last, *(v for _, v in self.version_changes)]
        )

    def problems(self) -> list[str]:
        """Why a trainer must not use this record (empty: it may). The checks a decoded record can pass
        and still be wrong: identity, group, versions, and values no engine produces (ranks < 1, NaN or
        positive logprobs, negative ids, an invalid temperature). Cheap: one pass over each array.

        The trainer queue runs this on every record it reads (batching.refusal), so each attribute is
        read once and each array check is one ufunc reduction called directly (ndarray.min / max add a
        Python wrapper per call: ~0.3 µs of a ~1 µs reduction over T = 1024 values)."""
        out = []
        if not self.rollout_id or not (self.job_id or self.request_id):
            out.append("rollout_id and job_id / request_id must be set")
        if self.group_size < 1 or not 0 <= self.sample_index < self.group_size:
            out.append(f"sample_index {self.sample_index} is not in [0, group_size {self.group_size})")
        if self.finish_reason not in ("stop", "length", "abort"):
            out.append(f"finish_reason {self.finish_reason!r} is not stop / length / abort")
        t = sampling.temperature_problem(self.semantics.temperature)
        if t:
            out.append(f"semantics.{t}")
        n = self.num_tokens
        topk_ids, topk_logprobs = self.topk_ids, self.topk_logprobs
        k = self.semantics.logprobs_k  # what the record declares; its arrays must have that width
        if k < 0 or topk_ids.shape != (n, k) or topk_logprobs.shape != topk_ids.shape:
            out.append(f"top-K arrays have shape {topk_ids.shape}, expected ({n}, {k})")
        ranks, lp = self.sampled_ranks, self.sampled_logprobs
        if lp.shape != (n,) or ranks.shape != (n,):
            out.append("sampled_logprobs / sampled_ranks do not have one entry per completion token")
        if self.reward is not None and not math.isfinite(self.reward):
            out.append(f"reward {self.reward} is not a finite number")
        if (
            self.teacher_semantics is not None
            or self.teacher_topk_ids is not None
            or self.teacher_topk_logprobs is not None
            or self.teacher_sampled_logprobs is not None
        ):  # else teacher_problems() has nothing to say
            out += self.teacher_problems()
        if out:
            return out  # the array checks below assume consistent shapes
        first, last, changes = self.policy_version_first, self.policy_version_last, self.version_changes
        versions = [first, last, *(v for _, v in changes)] if changes else [first, last]
        if min(versions) < 0:
            out.append(f"negative policy version in {versions}")
        after = changes[-1][1] if changes else first
        if last != after:
            out.append(f"policy_version_last {last} is not the version after the last change ({after})")
        if changes:
            indices = [i for i, _ in changes]
            if any(not 0 < i < n for i in indices) or indices != sorted(set(indices)):
                out.append(f"version_changes token indices {indices} are not increasing within (0, {n})")
        minimum, maximum = np.minimum.reduce, np.maximum.reduce
        prompt, completion = self.prompt_ids, self.completion_ids
        if prompt.size and minimum(prompt, axis=None) < 0:
            out.append("prompt_ids holds a negative token id")
        if completion.size and minimum(completion, axis=None) < 0:
            out.append("completion_ids holds a negative token id")
        if prompt.size == 0:
            out.append("prompt_ids is empty")
        if n:
            mask = self.loss_mask
            if mask is not None and np.shape(mask) != (n,):
                out.append(f"loss_mask has shape {np.shape(mask)}, expected ({n},)")
                return out
            # One reduction per check and no temporary arrays: this runs on every record a trainer reads.
            # min / max propagate NaN, and NaN fails every comparison, so `not lo > x` also catches NaN.
            if mask is not None:
                ranks = ranks[self.generated]
            if minimum(ranks, axis=None, initial=1) < 1:  # 0 where nothing was sampled
                out.append("sampled_ranks holds a rank < 1 (ranks are 1-based)")
            if not (minimum(lp, axis=None) > -np.inf and maximum(lp, axis=None) <= LOGPROB_SLACK):
                out.append("sampled_logprobs holds a NaN, an infinity or a positive value")
            if k and not maximum(topk_logprobs, axis=None) <= LOGPROB_SLACK:
                out.append("topk_logprobs holds a NaN or a positive value")
            if k and minimum(topk_ids, axis=None) < 0:
                out.append("topk_ids holds a negative token id")
        return out

    def teacher_problems(self) -> list[str]:
        """Why the teacher fields are inconsistent (empty: they are, or absent): all set or none, shapes
        [T, K_teacher] / [T] at teacher_semantics' K, no NaN or positive logprob (−∞ is allowed: a token
        the teacher's truncation removed), no negative id."""
        arrays = (self.teacher_topk_ids, self.teacher_topk_logprobs, self.teacher_sampled_logprobs)
        if self.teacher_semantics is None:
            if any(a is not None for a in arrays):
                return ["teacher arrays are set without teacher_semantics"]
            return []
        kt = self.teacher_semantics.logprobs_k
        t = self.num_tokens
        if any(a is None for a in arrays):
            return ["teacher_semantics is set but a teacher array is missing"]
        if kt < 0 or self.teacher_topk_ids.shape != (t, kt) or self.teacher_topk_logprobs.shape != (t, kt):
            return [
                f"teacher top-K arrays have shapes {self.teacher_topk_ids.shape} / "
                f"{self.teacher_topk_logprobs.shape}, expected ({t}, {kt})"
            ]
        if self.teacher_sampled_logprobs.shape != (t,):
            shape = self.teacher_sampled_logprobs.shape
            return [f"teacher_sampled_logprobs has shape {shape}, expected ({t},)"]
        out = []
        lp = self.teacher_sampled_logprobs  # -inf is allowed: a token the teacher's truncation removed
        if t and (np.isnan(lp).any() or not lp.max() <= LOGPROB_SLACK):
            out.append("teacher_sampled_logprobs holds a NaN or a positive value")
        if t and kt and not self.teacher_topk_logprobs.max() <= LOGPROB_SLACK:
            out.append("teacher_topk_logprobs holds a NaN or a positive value")
        if t and kt and self.teacher_topk_ids.min() < 0:
            out.append("teacher_topk_ids holds a negative token id")
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
        k = header.logprobs_k  # a header decoded without arrays still has [0, K] ones
        other = next((c.logprobs_k for c in parts if len(c.token_ids) and c.logprobs_k != k), None)
        if other is not None:
            raise ValueError(f"sample {chunk.sample_index}: a chunk carries K = {other}, its record K = {k}")
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
class AdapterInfo:
    """A namespace's current LoRA adapter on a replica (GetInfo.adapters; docs/lora.md)."""

    namespace: str
    run_id: str
    version: int
    name: str  # "<namespace>/<run_id>/v<version>": RolloutRecord.adapter of what it samples
    rank: int


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
    run_id: str = ""  # the run of the weights served (the last UpdateWeights); "" = none yet
    weights_fingerprint: str = ""  # the starting weights' or a verified push's (weights/updates.py)
    # load (the replica's metrics): running now, and counters since start
    in_flight: int = 0
    jobs_running: int = 0
    generated_tokens: int = 0
    published_records: int = 0
    tokenizer_fingerprint: str = ""  # of --model's tokenizer (proto/tokenizer_fingerprint.py); "" = none
    # LoRA (docs/lora.md): the fingerprint of the base adapters apply to ("" once full weights replaced
    # it, or unknown); the largest rank taken (0 = LoRA off); adapters resident at once; each served
    # namespace's current adapter.
    base_fingerprint: str = ""
    max_lora_rank: int = 0
    max_loras: int = 0
    adapters: tuple[AdapterInfo, ...] = ()


@dataclass(frozen=True)
class WeightsUpdate:
    """An UpdateWeights request: a checkpoint directory, an NCCL broadcast, or the starting weights
    adopted (exactly one source is set)."""

    version: int
    checkpoint_dir: str | None = None  # set when the source is a checkpoint
    collective: CollectiveSpec | None = None  # set when the source is a CollectiveSource (NCCL)
    run_id: str = ""  # the run the version belongs to ("" = a client older than runs)
    # set when the source is an AdoptSource: the starting weights' fingerprint the trainer expects
    adopt_fingerprint: str | None = None


@dataclass(frozen=True)
class WeightsUpdateResult:
    version: int
    load_seconds: float
    paused_requests: int  # in-flight requests that were paused and resumed
