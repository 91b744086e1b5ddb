"""deploy/compose.yaml (+ compose.gpu.yaml, compose.tls.yaml) as `docker compose` sees it, without Docker:
interpolated with deploy/.env.example, validated against the official compose-spec schema (vendored in
the check-jsonschema wheel), then checked for what the deployment relies on: secrets never on a command
line, memory limits on every service, TLS end to end with the TLS file."""

from __future__ import annotations

import importlib.resources
import json
import re
import shlex
import subprocess
from urllib.parse import urlsplit

import jsonschema
import pytest
from deploy_files import (
    COMPOSE,
    COMPOSE_GPU,
    COMPOSE_SHARED_WEIGHTS,
    COMPOSE_TLS,
    ENV_EXAMPLE,
    InterpolationError,
    Local,
    Replica,
    build_args,
    clean_environ,
    compose_variables,
    deployable_env,
    duration_s,
    healthcheck,
    interpolate,
    load_compose,
    load_env_file,
    merge_compose,
    resolve_argv,
)

from maskroll.local.redis_server import LocalRedis, free_port
from maskroll.server.app import ABORT_GRACE_S, STOP_GRACE_S


@pytest.fixture(scope="module")
def compose_schema() -> dict:
    # The official schema (compose-spec/compose-spec, schema/compose-spec.json) as check-jsonschema
    # vendors it for its `--builtin-schema vendor.compose-spec`.
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return load_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def compose(env) -> dict:
    return load_compose(COMPOSE, env)


def replicas(compose: dict) -> dict[str, dict]:
    """Services that run `maskroll serve` in pull mode."""
    return {
        name: svc
        for name, svc in compose["services"].items()
        if svc.get("environment", {}).get("MASKROLL_PULL") == "true"
    }


def validate(schema: dict, doc: dict) -> list[str]:
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize(
    "path", [COMPOSE, COMPOSE_GPU, COMPOSE_TLS, COMPOSE_SHARED_WEIGHTS], ids=lambda p: p.name
)
def test_compose_files_match_the_compose_spec(path, env, compose_schema):
    assert validate(compose_schema, load_compose(path, env)) == []
    if path != COMPOSE:  # and what `docker compose -f compose.yaml -f <path>` runs
        assert (
            validate(compose_schema, merge_compose(load_compose(COMPOSE, env), load_compose(path, env))) == []
        )


def test_the_schema_check_catches_a_typo(compose, compose_schema):
    broken = json.loads(json.dumps(compose))
    broken["services"]["replica-1"]["stop_grace_periode"] = "90s"
    assert any("stop_grace_periode" in e for e in validate(compose_schema, broken))


def test_every_variable_is_documented_in_env_example(env):
    documented = set(env) | set(re.findall(r"^#\s*([A-Z_][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), re.M))
    used = set().union(*(compose_variables(p.read_text()) for p in (COMPOSE, COMPOSE_GPU, COMPOSE_TLS)))
    assert used - documented == set()


def test_secrets_are_required_and_the_examples_are_placeholders(env):
    for name in ("REDIS_PASSWORD", "MASKROLL_AUTH_TOKEN", "MASKROLL_MODEL_DIR"):
        without = {k: v for k, v in env.items() if k != name}
        with pytest.raises(InterpolationError, match=name):
            load_compose(COMPOSE, without)
    assert all(env[k].startswith("REPLACE-ME") for k in ("REDIS_PASSWORD", "MASKROLL_AUTH_TOKEN"))


def test_interpolation_forms():
    e = {"A": "a", "EMPTY": ""}
    assert interpolate("${A}-${A:-x}-${B:-d}-${EMPTY:-d}-${EMPTY-d}-$A-$$A", e) == "a-a-d-d--a-$A"
    assert interpolate(["${A:+alt}", "${EMPTY:+alt}", "${EMPTY+alt}"], e) == ["alt", "", "alt"]
    with pytest.raises(InterpolationError, match="B"):
        interpolate("${B:?needed}", e)


def redis_command(redis: dict) -> tuple[dict[str, str], str]:
    """(redis-server's options, the configuration it reads on stdin) from the service's `sh -c` script."""
    assert redis["command"][:2] == ["sh", "-c"]
    head, _, rest = redis["command"][2].partition("<<EOF\n")
    argv = shlex.split(head.replace("\\\n", " "))
    # The image's entrypoint drops root; `-` last: it reads the configuration from stdin.
    assert argv[:3] == ["exec", "docker-entrypoint.sh", "redis-server"] and argv[-1] == "-"
    return dict(zip(argv[3:-1:2], argv[4:-1:2], strict=True)), rest.partition("\nEOF")[0]


def test_redis_is_persistent_password_protected_and_never_evicts(compose, env):
    redis = compose["services"]["redis"]
    opt, stdin = redis_command(redis)
    assert opt["--appendonly"] == "yes"
    assert opt["--maxmemory-policy"] == "noeviction"
    # The password: in the environment, fed to redis-server on stdin by the shell; not in its argv.
    assert stdin == "requirepass $REDIS_PASSWORD" and "--requirepass" not in opt
    assert redis["environment"]["REDIS_PASSWORD"] == env["REDIS_PASSWORD"]
    assert redis["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")
    source, target = redis["volumes"][0].split(":")[:2]
    assert target == "/data" and source in compose["volumes"]
    # Published for a trainer on this host only, never on every interface.
    assert all(p.startswith("127.0.0.1:") for p in redis["ports"])


def test_two_pull_mode_replicas_wait_for_redis_and_drain_within_the_grace_period(compose, env):
    reps = replicas(compose)
    assert len(reps) >= 2
    _, health_argv = healthcheck()
    for name, svc in reps.items():
        e = svc["environment"]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["healthcheck"]["test"] == ["CMD", *health_argv]
        assert svc["stop_signal"] == "SIGTERM" and svc["init"] is True
        grace, drain = duration_s(svc["stop_grace_period"]), float(e["MASKROLL_DRAIN_TIMEOUT_S"])
        assert grace > drain + ABORT_GRACE_S + STOP_GRACE_S, (name, grace, drain)
        url = urlsplit(e["MASKROLL_REDIS_URL"])
        assert (url.scheme, url.hostname, url.port) == ("redis", "redis", 6379)
        assert url.password == env["REDIS_PASSWORD"]
        assert e["MASKROLL_AUTH_TOKEN"] == env["MASKROLL_AUTH_TOKEN"]
        # The advertised address is this container on the compose network, at its gRPC port.
        assert e["MASKROLL_ADVERTISE_ADDRESS"] == f"{svc['hostname']}:{e['MASKROLL_PORT']}"
        assert svc["hostname"] == name
        assert all(p.startswith("127.0.0.1:") for p in svc.get("ports", []))
    for key in ("MASKROLL_REPLICA_ID", "MASKROLL_ADVERTISE_ADDRESS"):
        values = [svc["environment"][key] for svc in reps.values()]
        assert len(set(values)) == len(values), f"{key} must differ between replicas: {values}"
    namespaces = {svc["environment"]["MASKROLL_NAMESPACE"] for svc in reps.values()}
    assert len(namespaces) == 1


def _mounts(svc: dict) -> dict[str, tuple[str, str]]:
    """target -> (source, mode)"""
    out = {}
    for spec in svc["volumes"]:
        source, target, *mode = spec.split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


def trainer_flags(trainer: dict) -> dict[str, str]:
    argv = trainer["entrypoint"] + trainer["command"]
    assert argv[:3] == ["maskroll", "demo", "--no-spawn"]
    return dict(zip(argv[3::2], argv[4::2], strict=True))


def test_replicas_share_only_the_model_and_get_weights_over_grpc(compose):
    """The default needs no shared weights volume: the trainer pushes over gRPC (stream) and keeps its
    own copy on a volume no replica mounts; replicas mount the model read-only and nothing else."""
    reps = replicas(compose)
    trainer = compose["services"]["trainer"]
    assert trainer["profiles"] == ["trainer"]
    flags = trainer_flags(trainer)
    # No --redis-url: the demo reads MASKROLL_REDIS_URL, so the password is on no command line.
    assert set(flags) == {"--namespace", "--weight-transport", "--weights-dir", "--model", "--out"}
    assert flags["--weight-transport"] == "stream"
    own_source, own_mode = _mounts(trainer)[flags["--weights-dir"]]
    assert own_source in compose["volumes"] and own_mode == "rw"
    for svc in reps.values():
        e = svc["environment"]
        assert trainer["environment"]["MASKROLL_REDIS_URL"] == e["MASKROLL_REDIS_URL"]
        assert flags["--namespace"] == e["MASKROLL_NAMESPACE"]
        assert "MASKROLL_WEIGHTS_ROOT" not in e
        assert set(_mounts(svc)) == {e["MASKROLL_MODEL"]}
        assert _mounts(svc)[e["MASKROLL_MODEL"]][1] == "ro"
        # The learner starts from the weights the replicas serve.
        assert flags["--model"] == e["MASKROLL_MODEL"]
        assert _mounts(trainer)[e["MASKROLL_MODEL"]][0] == _mounts(svc)[e["MASKROLL_MODEL"]][0]
    assert set(compose["volumes"]) == {"redis-data", own_source}
    tokens = {svc["environment"]["MASKROLL_AUTH_TOKEN"] for svc in [*reps.values(), trainer]}
    assert len(tokens) == 1
    assert trainer["healthcheck"] == {"disable": True}


def test_shared_weights_file_puts_replicas_and_trainer_on_one_weights_volume(compose, env):
    """compose.shared-weights.yaml: the directory transport, the trainer writing where the replicas
    read (their MASKROLL_WEIGHTS_ROOT, same volume, same path), the trainer's command otherwise equal."""
    shared = merge_compose(compose, load_compose(COMPOSE_SHARED_WEIGHTS, env))
    trainer = shared["services"]["trainer"]
    flags = trainer_flags(trainer)
    assert flags["--weight-transport"] == "directory"
    assert {**flags, "--weight-transport": "stream"} == trainer_flags(compose["services"]["trainer"])
    weights_dir = flags["--weights-dir"]
    source, mode = _mounts(trainer)[weights_dir]
    assert source in shared["volumes"] and mode == "rw"
    reps = replicas(shared)
    assert set(reps) == {"replica-1", "replica-2"}
    for name, svc in reps.items():
        e = svc["environment"]
        assert e["MASKROLL_WEIGHTS_ROOT"] == weights_dir
        assert _mounts(svc)[weights_dir] == (source, "ro")
        # Everything else as compose.yaml has it.
        plain = compose["services"][name]
        assert {k: v for k, v in e.items() if k != "MASKROLL_WEIGHTS_ROOT"} == plain["environment"]
        assert {t: m for t, m in _mounts(svc).items() if t != weights_dir} == _mounts(plain)


def test_gpu_file_gives_each_replica_its_own_gpu_and_the_default_vllm_image(env):
    gpu = load_compose(COMPOSE_GPU, env)
    base = load_compose(COMPOSE, env)
    devices = []
    for name in replicas(base):
        svc = gpu["services"][name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        devices += device["device_ids"]
        assert svc["build"]["args"] == {"VARIANT": "gpu", "BASE_IMAGE": build_args()["BASE_IMAGE"]}
    assert len(devices) == len(set(devices)) == len(replicas(base))
    assert base["services"]["replica-1"]["build"]["args"]["VARIANT"] == "cpu"


@pytest.mark.parametrize(
    "files",
    [(COMPOSE,), (COMPOSE, COMPOSE_TLS), (COMPOSE, COMPOSE_SHARED_WEIGHTS)],
    ids=["plain", "tls", "shared-weights"],
)
def test_no_secret_on_any_command_line(env, files):
    """Arguments are visible to every process on the host (`ps`); secrets travel in the environment."""
    compose = load_compose(files[0], env)
    for extra in files[1:]:
        compose = merge_compose(compose, load_compose(extra, env))
    secrets = {env["REDIS_PASSWORD"], env["MASKROLL_AUTH_TOKEN"]}
    for name, svc in compose["services"].items():
        argv = [*svc.get("entrypoint", []), *svc.get("command", [])]
        assert not any(s in a for s in secrets for a in argv), (name, argv)


def test_every_service_has_a_memory_limit(compose):
    for name, svc in compose["services"].items():
        limits = svc["deploy"]["resources"]["limits"]
        assert re.fullmatch(r"[0-9]+[kmg]", limits["memory"]), (name, limits)
    redis = compose["services"]["redis"]
    maxmemory = redis_command(redis)[0]["--maxmemory"]
    as_bytes = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    limit = redis["deploy"]["resources"]["limits"]["memory"]
    assert int(maxmemory[:-2]) * as_bytes[maxmemory[-2]] < int(limit[:-1]) * as_bytes[limit[-1]]


def test_the_tls_file_turns_on_tls_for_grpc_and_redis(compose, env):
    tls = merge_compose(compose, load_compose(COMPOSE_TLS, env))
    opt, stdin = redis_command(tls["services"]["redis"])
    assert opt["--port"] == "0" and opt["--tls-port"] == "6379", "no plaintext listener"
    assert stdin == "requirepass $REDIS_PASSWORD"
    assert "--tls --cacert" in tls["services"]["redis"]["healthcheck"]["test"][1]

    def mounted(svc: dict, path: str) -> bool:
        return any(
            path.startswith(spec.split(":")[1] + "/") and spec.endswith(":ro") for spec in svc["volumes"]
        )

    for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file"):
        assert mounted(tls["services"]["redis"], opt[flag]), flag
    for name, svc in replicas(tls).items():
        e = svc["environment"]
        for key in ("MASKROLL_TLS_CERT", "MASKROLL_TLS_KEY", "MASKROLL_HEALTHCHECK_TLS_CA"):
            assert mounted(svc, e[key]), (name, key)
        url = urlsplit(e["MASKROLL_REDIS_URL"])
        assert (url.scheme, url.hostname, url.port, url.query) == (
            "rediss",
            "redis",
            6379,
            f"ssl_ca_certs={e['MASKROLL_HEALTHCHECK_TLS_CA']}",
        )
        assert url.password == env["REDIS_PASSWORD"]
    trainer = tls["services"]["trainer"]
    assert mounted(trainer, trainer["environment"]["MASKROLL_HEALTHCHECK_TLS_CA"])
    assert (
        trainer["environment"]["MASKROLL_REDIS_URL"]
        == tls["services"]["replica-1"]["environment"]["MASKROLL_REDIS_URL"]
    )


@pytest.mark.slow
def test_trainer_command_trains_against_the_replicas(compose, env, tmp_path):
    """The compose deployment run outside containers: Redis with the .env password, both replicas with
    their environment, then the trainer service's command line (one short step) against them: it
    must find the replicas, train, push the version to them and keep its own checkpoint."""
    from maskroll.app.model_init import init_model

    weights = tmp_path / "weights"
    weights.mkdir()
    model = init_model(tmp_path / "model", seed=0)
    compose = load_compose(COMPOSE, deployable_env(env))  # replicas refuse the placeholder secrets
    trainer = compose["services"]["trainer"]
    with LocalRedis(password=compose["services"]["redis"]["environment"]["REDIS_PASSWORD"]) as redis:
        local = Local(model, weights, redis.port)
        started: list[tuple[Replica, list[str]]] = []
        try:
            for name, svc in replicas(compose).items():
                serve_env = {**clean_environ(), **local.replica_env(svc, free_port(), free_port())}
                replica = Replica(["maskroll", "serve"], serve_env, tmp_path / f"{name}.log")
                started.append((replica, svc["healthcheck"]["test"][1:]))
            for replica, check in started:  # started together: the model loads overlap
                replica.wait_healthy(check)
            paths = {
                "/models/model": str(model),
                "/weights": str(weights),
                "/tmp/maskroll-demo": str(tmp_path),
            }
            argv = [paths.get(a, a) for a in trainer["entrypoint"] + trainer["command"]]
            argv += ["--steps", "1", "--prompts-per-step", "1", "--n", "2"]
            run_env = {**clean_environ(), **trainer["environment"]}
            run_env["MASKROLL_REDIS_URL"] = local.url(run_env["MASKROLL_REDIS_URL"])
            out = subprocess.run(resolve_argv(argv), env=run_env, capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, out.stdout + out.stderr
            assert (tmp_path / "summary.json").is_file()
            assert any(weights.iterdir()), "no checkpoint in the trainer's own weights directory"
            for replica, _ in started:
                code, _ = replica.terminate(within=90)
                assert code == 0, replica.output()
        finally:
            for replica, _ in started:
                replica.stop()
