"""Readers for the files under deploy/ as their tools read them, and a `maskroll serve` child process.

- compose: `.env` parsing and compose's `${VAR}` interpolation (the forms compose.yaml uses), so the
  file is validated and checked as `docker compose` would see it;
- Dockerfile: instructions through dockerfile-parse, exec-form commands decoded;
- Kubernetes: a container's environment as the kubelet builds it (envFrom, then env in order with
  `$(VAR)` expansion, secretKeyRef, fieldRef);
- Replica: runs a command line with an environment, polls a health command, stops it with SIGTERM.
Knows nothing of what the tests assert.
"""

from __future__ import annotations

import atexit
import base64
import copy
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from kustomize_lite import render

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_GPU = DEPLOY / "compose.gpu.yaml"
COMPOSE_TLS = DEPLOY / "compose.tls.yaml"
COMPOSE_SHARED_WEIGHTS = DEPLOY / "compose.shared-weights.yaml"
COMPOSE_SESSIONS = DEPLOY / "compose.sessions.yaml"
COMPOSE_SESSIONS_TLS = DEPLOY / "compose.sessions-tls.yaml"
PROXY = DEPLOY / "proxy"  # the session proxy's Caddyfile and its snippets
ENV_EXAMPLE = DEPLOY / ".env.example"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "cpu": K8S / "overlays" / "cpu",
    "gpu": K8S / "overlays" / "gpu",
    "trainer": K8S / "trainer",
    "reward": K8S / "reward",
    "teacher": K8S / "teacher",
    "tools": K8S / "tools",
    "tls-ca": K8S / "tls-ca",
}
SHARED_WEIGHTS = K8S / "components" / "shared-weights"
SESSIONS = K8S / "components" / "sessions"  # the HTTP front end behind the session proxy
# What an operator writes to opt in to the directory transport: a kustomization of the replicas' overlay
# (or the trainer's) with the shared-weights component, in a directory of its own outside the repository.
COMPOSED = {
    "gpu+shared-weights": ("gpu", SHARED_WEIGHTS),
    "trainer+shared-weights": ("trainer", SHARED_WEIGHTS),
    "gpu+sessions": ("gpu", SESSIONS),
}
_COMPOSED_ROOT = Path(tempfile.mkdtemp(prefix="maskroll-kustomize-"))
atexit.register(shutil.rmtree, _COMPOSED_ROOT, ignore_errors=True)
for _name, (_of, _component) in COMPOSED.items():
    _dir = _COMPOSED_ROOT / _name
    _dir.mkdir()
    (_dir / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(KUSTOMIZATIONS[_of], _dir)],
                "components": [os.path.relpath(_component, _dir)],
            }
        )
    )
    KUSTOMIZATIONS[_name] = _dir
SCHEMAS = Path(__file__).resolve().parent / "schemas"


# ---- Kubernetes ---------------------------------------------------------------------------------------


@functools.cache
def _rendered(name: str) -> tuple[dict, ...]:
    return tuple(render(KUSTOMIZATIONS[name]))


def rendered(name: str) -> list[dict]:
    """The resources of one kustomization (a fresh copy: tests may mutate it)."""
    return copy.deepcopy(list(_rendered(name)))


def find(resources: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]


def one(resources: list[dict], kind: str, name: str | None = None) -> dict:
    hits = find(resources, kind, name)
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"] if workload["kind"] == "Pod" else workload["spec"]["template"]["spec"]


# What a test runs replicas with instead of the shipped placeholders, which `maskroll serve` refuses.
PLACEHOLDER = "REPLACE-ME"


def test_secret(placeholder_key: str) -> str:
    return f"test-{placeholder_key.lower().replace('_', '-')}-0123456789abcdef"


def deployable(resources: list[dict]) -> list[dict]:
    """The resources with every placeholder Secret value replaced by a test secret (what an operator
    does before deploying)."""
    out = copy.deepcopy(resources)
    for r in out:
        if r["kind"] == "Secret":
            for key, value in (r.get("stringData") or {}).items():
                if value.startswith(PLACEHOLDER):
                    r["stringData"][key] = test_secret(key)
    return out


def deployable_env(env: dict[str, str]) -> dict[str, str]:
    """A compose .env with every placeholder replaced by a test secret."""
    return {k: test_secret(k) if v.startswith(PLACEHOLDER) else v for k, v in env.items()}


def secret_values(secret: dict) -> dict[str, str]:
    values = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    values.update(secret.get("stringData") or {})
    return values


_K8S_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand_k8s(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ escapes, unknown ones stay as is."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _K8S_REF.sub(sub, value)


def container_env(
    resources: list[dict],
    container: dict,
    field_refs: dict[str, str],
    configmap_overrides: dict | None = None,
) -> dict[str, str]:
    """The environment the kubelet gives `container`: envFrom ConfigMaps / Secrets first, then `env` in
    order, each value expanded against what came before. configmap_overrides replaces ConfigMap values
    (the test's local addresses and paths) before anything reads them."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            data = dict(one(resources, "ConfigMap", source["configMapRef"]["name"])["data"])
            data.update(configmap_overrides or {})
            env.update(data)
        else:
            env.update(secret_values(one(resources, "Secret", source["secretRef"]["name"])))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand_k8s(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "secretKeyRef" in ref:
            secret = one(resources, "Secret", ref["secretKeyRef"]["name"])
            env[var["name"]] = secret_values(secret)[ref["secretKeyRef"]["key"]]
        elif "configMapKeyRef" in ref:
            cm = one(resources, "ConfigMap", ref["configMapKeyRef"]["name"])
            env[var["name"]] = {**cm["data"], **(configmap_overrides or {})}[ref["configMapKeyRef"]["key"]]
        else:
            env[var["name"]] = field_refs[ref["fieldRef"]["fieldPath"]]
    return env


# ---- compose ------------------------------------------------------------------------------------------


class InterpolationError(ValueError):
    pass


def load_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose .env file (comments and blank lines skipped)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path}: not KEY=VALUE: {line!r}"
            env[key.strip()] = value.strip()
    return env


_COMPOSE_REF = re.compile(r"\$(?:(\$)|\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?", re.S)


def compose_variables(text: str) -> set[str]:
    """Names of the variables a compose file interpolates."""
    names = set()
    for m in _COMPOSE_REF.finditer(text):
        if m.group(2) is not None:
            names.add(_BRACED.fullmatch(m.group(2)).group(1))
        elif m.group(3):
            names.add(m.group(3))
    return names


def interpolate(node, env: dict[str, str]):
    """Compose's interpolation of every string value: $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e},
    ${VAR?e}, ${VAR:+a}, ${VAR+a}, and $$ for a literal $."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        if m.group(3):
            return env.get(m.group(3), "")
        parsed = _BRACED.fullmatch(m.group(2))
        if parsed is None:
            raise InterpolationError(f"invalid interpolation ${{{m.group(2)}}}")
        name, op, arg = parsed.groups()
        value, is_set = env.get(name), name in env
        non_empty = bool(value)
        if op is None:
            return value or ""
        if op in (":-", "-"):
            return value if (non_empty if op == ":-" else is_set) else arg
        if op in (":?", "?"):
            if not (non_empty if op == ":?" else is_set):
                raise InterpolationError(f"required variable {name} is missing a value: {arg}")
            return value
        return arg if (non_empty if op == ":+" else is_set) else ""

    return _COMPOSE_REF.sub(sub, node)


def load_compose(path: Path, env: dict[str, str]) -> dict:
    return interpolate(yaml.safe_load(path.read_text()), env)


def merge_compose(base: dict, override: dict) -> dict:
    """`docker compose -f base -f override`: mappings merge key by key, `command` / `entrypoint` /
    healthcheck `test` are replaced, `volumes` and `ports` merge by their target."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        old = out.get(key)
        if key in ("volumes", "ports") and isinstance(old, list):
            by_target = {str(v).split(":")[1 if key == "volumes" else -1]: v for v in old}
            by_target.update({str(v).split(":")[1 if key == "volumes" else -1]: v for v in value})
            out[key] = list(by_target.values())
        elif isinstance(old, dict) and isinstance(value, dict) and key not in ("command", "entrypoint"):
            out[key] = merge_compose(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def duration_s(text: str | int | float) -> float:
    """A compose duration ('90s', '1m30s', '500ms') in seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a compose duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


class Local:
    """What differs outside a container: host paths for the volumes, loopback ports, Redis's address."""

    def __init__(self, model: Path, weights: Path, redis_port: int) -> None:
        self.model, self.weights, self.redis_port = model, weights, redis_port

    def url(self, url: str) -> str:
        """A compose redis:// URL pointed at the local Redis (the password and db stay as written)."""
        local = url.replace("@redis:6379/", f"@127.0.0.1:{self.redis_port}/")
        assert local != url, f"not a URL of the compose Redis: {url}"
        return local

    def replica_env(self, svc: dict, port: int, metrics_port: int) -> dict[str, str]:
        """A compose replica service's environment, localised."""
        env = dict(svc["environment"])
        mounts = {spec.split(":")[1] for spec in svc["volumes"]}
        # The model, and a weights root only where one is set (compose.shared-weights.yaml).
        paths = {env["MASKROLL_MODEL"], env.get("MASKROLL_WEIGHTS_ROOT", env["MASKROLL_MODEL"])}
        assert mounts == paths, f"volumes {sorted(mounts)} and paths {sorted(paths)} disagree"
        if "MASKROLL_WEIGHTS_ROOT" in env:
            env["MASKROLL_WEIGHTS_ROOT"] = str(self.weights)
        env.update(
            MASKROLL_MODEL=str(self.model),
            MASKROLL_HOST="127.0.0.1",  # not 0.0.0.0 on a shared machine
            MASKROLL_PORT=str(port),
            MASKROLL_METRICS_PORT=str(metrics_port),
            MASKROLL_REDIS_URL=self.url(env["MASKROLL_REDIS_URL"]),
            MASKROLL_ADVERTISE_ADDRESS=f"127.0.0.1:{port}",
        )
        if "MASKROLL_HTTP_PORT" in env:  # compose.sessions.yaml: a free one here
            env["MASKROLL_HTTP_PORT"] = "0"
        return env


# ---- Dockerfile ---------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[dict]:
    from dockerfile_parse import DockerfileParser

    return DockerfileParser(path=str(DOCKERFILE), cache_content=True).structure


def last(instruction: str) -> str:
    values = [i["value"] for i in dockerfile_instructions() if i["instruction"] == instruction]
    assert values, f"the Dockerfile has no {instruction}"
    return values[-1]


def exec_form(value: str) -> list[str]:
    """A JSON-array (exec form) command; fails for shell form."""
    try:
        argv = json.loads(value)
    except json.JSONDecodeError:
        raise AssertionError(f"not exec form (a JSON array): {value!r}") from None
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), value
    return argv


def healthcheck() -> tuple[dict[str, str], list[str]]:
    """The HEALTHCHECK instruction: its --options and its exec-form command."""
    m = re.fullmatch(r"((?:--[a-z-]+=\S+\s+)*)CMD\s+(.*)", last("HEALTHCHECK").strip(), re.S)
    assert m, f"HEALTHCHECK is not `[--opt=value ...] CMD [...]`: {last('HEALTHCHECK')!r}"
    options = dict(re.findall(r"--([a-z-]+)=(\S+)", m.group(1)))
    return options, exec_form(m.group(2))


def image_env() -> dict[str, str]:
    """ENV of the final image (dockerfile-parse resolves the ENV instructions in order)."""
    from dockerfile_parse import DockerfileParser

    return dict(DockerfileParser(path=str(DOCKERFILE), cache_content=True).envs)


def build_args() -> dict[str, str]:
    """ARG defaults, including those declared before FROM."""
    args = {}
    for ins in dockerfile_instructions():
        if ins["instruction"] == "ARG":
            key, _, default = ins["value"].partition("=")
            args[key.strip()] = default.strip()
    return args


# ---- a replica process --------------------------------------------------------------------------------


def resolve_argv(argv: list[str]) -> list[str]:
    """argv[0] looked up where the test's interpreter installed its scripts first (the venv's bin)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(argv[0], path=path)
    assert found, f"{argv[0]} is not installed next to {sys.executable} or on PATH"
    return [found, *argv[1:]]


def clean_environ() -> dict[str, str]:
    """This process's environment without MASKROLL_* (a developer's settings must not leak in)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MASKROLL_")}


def run_check(argv: list[str], env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(resolve_argv(argv), env=env, capture_output=True, text=True, timeout=timeout)


class Replica:
    """A child process running `argv` with `env`; only this PID is ever signalled or killed."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv, self.env, self.log = resolve_argv(argv), env, log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            self.argv, env=env, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    def wait_healthy(self, check_argv: list[str], timeout: float = 240.0, period: float = 1.0) -> float:
        """Poll `check_argv` (a health command, run with the same environment, as Docker and the
        kubelet do) until it exits 0; returns the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode} before healthy; log:\n{self.output()}")
            if run_check(check_argv, self.env).returncode == 0:
                return time.monotonic() - t0
            time.sleep(period)
        raise AssertionError(f"not healthy after {timeout} s; log:\n{self.output()}")

    def terminate(self, within: float) -> tuple[int, float]:
        """SIGTERM, as `docker stop` and the kubelet send it; (exit code, seconds to exit)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(within)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {within} s after SIGTERM; log:\n{self.output()}") from None
        return code, time.monotonic() - t0

    def output(self) -> str:
        self._log_file.flush()
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()
