"""`maskroll healthcheck` against a real `maskroll serve` child process (torch engine, the init-model
model): SERVING exits 0; nothing listening exits 1 at once; a draining replica fails readiness but
passes liveness (--live); TLS from the server's own environment, as the image's HEALTHCHECK runs it."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deploy_files import Replica, clean_environ

from maskroll.local.redis_server import free_port
from maskroll.server.healthcheck import default_address, default_tls_ca

CHECK = ["maskroll", "healthcheck"]


def healthcheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "maskroll.app.cli", "healthcheck", *args]
    return subprocess.run(cmd, env=env or clean_environ(), capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def serve_env(model_dir: Path, port: int, **extra: str) -> dict[str, str]:
    env = clean_environ()
    env.update(MASKROLL_MODEL=str(model_dir), MASKROLL_ENGINE="torch", MASKROLL_PORT=str(port), **extra)
    return env


# ---- no server needed -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "address"),
    [
        ({}, "127.0.0.1:50051"),
        ({"MASKROLL_PORT": "6000"}, "127.0.0.1:6000"),
        ({"MASKROLL_HOST": "0.0.0.0", "MASKROLL_PORT": "7"}, "127.0.0.1:7"),
        ({"MASKROLL_HOST": "::"}, "[::1]:50051"),
        ({"MASKROLL_HOST": "10.1.2.3", "MASKROLL_PORT": "9"}, "10.1.2.3:9"),
        ({"MASKROLL_HOST": "fd00::5"}, "[fd00::5]:50051"),
    ],
)
def test_default_address_is_where_serve_listens_in_this_container(env, address):
    assert default_address(env) == address


def test_tls_roots_default_to_the_healthcheck_ca_then_the_servers_own_certificate():
    assert default_tls_ca({}) is None
    assert default_tls_ca({"MASKROLL_TLS_CERT": "/tls/cert.pem"}) == "/tls/cert.pem"
    both = {"MASKROLL_TLS_CERT": "/tls/cert.pem", "MASKROLL_HEALTHCHECK_TLS_CA": "/tls/ca.pem"}
    assert default_tls_ca(both) == "/tls/ca.pem"


def test_nothing_listening_exits_1_quickly_with_the_reason():
    port = free_port()
    t0 = time.monotonic()
    out = healthcheck("--address", f"127.0.0.1:{port}", "--timeout", "20")
    elapsed = time.monotonic() - t0
    assert out.returncode == 1
    # Interpreter start-up included; a refused connection must not wait out the 20 s timeout.
    assert elapsed < 8.0, f"took {elapsed:.1f} s"
    assert out.stdout == ""
    line = out.stderr.strip()
    assert "\n" not in line and f"127.0.0.1:{port} (plaintext) failed: UNAVAILABLE" in line, line


def test_bad_arguments_exit_2():
    assert healthcheck("--timeout", "0").returncode == 2
    out = healthcheck("--tls-ca", "/nonexistent/ca.pem", "--address", "127.0.0.1:1")
    assert out.returncode == 1 and "is not a file" in out.stderr


# ---- against `maskroll serve` ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plaintext_replica(model_dir, tmp_path_factory):
    port = free_port()
    env = serve_env(model_dir, port, MASKROLL_DRAIN_TIMEOUT_S="60")
    r = Replica(["maskroll", "serve"], env, tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        r.wait_healthy(CHECK)
        yield r, port
    finally:
        r.stop()


@pytest.mark.slow
def test_serving_replica_exits_0(plaintext_replica):
    r, port = plaintext_replica
    for args in ((), ("--live",), ("--service", "maskroll.v1.RolloutService")):
        out = healthcheck(*args, env=r.env)  # the default address comes from MASKROLL_PORT
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"maskroll healthcheck: 127.0.0.1:{port} (plaintext) SERVING"


@pytest.mark.slow
def test_unknown_service_exits_1(plaintext_replica):
    r, _ = plaintext_replica
    out = healthcheck("--service", "no.such.Service", env=r.env)
    assert out.returncode == 1 and "failed: NOT_FOUND" in out.stderr


@pytest.mark.slow
def test_draining_replica_fails_readiness_but_stays_live(plaintext_replica):
    """Runs last in this module: it stops the shared replica."""
    from maskroll.client import RolloutClient, SamplingOptions

    r, port = plaintext_replica

    async def main():
        async with RolloutClient(f"127.0.0.1:{port}") as c:
            stream = c.generate(
                [256, 83], SamplingOptions(max_tokens=1000, n=8, ignore_eos=True, logprobs_k=1)
            )
            async for _ in stream:  # the first chunk: the request is in flight
                break
            r.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            ready = await asyncio.to_thread(healthcheck, env=r.env)
            live = await asyncio.to_thread(healthcheck, "--live", env=r.env)
            await stream.aclose()  # cancelled: the drain ends as soon as the engine lets go
            return ready, live

    ready, live = asyncio.run(main())
    assert ready.returncode == 1 and "NOT_SERVING" in ready.stderr, (ready.stdout, ready.stderr)
    assert live.returncode == 0 and "NOT_SERVING" in live.stdout, (live.stdout, live.stderr)
    assert r.proc.wait(60) == 0, r.output()


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line")
    d = tmp_path_factory.mktemp("tls")
    for name in ("server", "other"):
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.pem"), "-days", "1",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    return d


@pytest.mark.slow
def test_tls_replica_is_checked_with_its_own_certificate_from_the_environment(
    model_dir, self_signed, tmp_path
):
    port = free_port()
    env = serve_env(
        model_dir,
        port,
        MASKROLL_TLS_CERT=str(self_signed / "server.pem"),
        MASKROLL_TLS_KEY=str(self_signed / "server.key"),
        MASKROLL_AUTH_TOKEN="health-needs-no-token",
    )
    r = Replica(["maskroll", "serve"], env, tmp_path / "serve.log")
    try:
        r.wait_healthy(CHECK)  # bare, as the image's HEALTHCHECK: TLS roots from MASKROLL_TLS_CERT
        out = healthcheck(env=r.env)
        assert out.returncode == 0 and f"127.0.0.1:{port} (tls) SERVING" in out.stdout
        by_name = healthcheck("--address", f"localhost:{port}", env=r.env)
        assert by_name.returncode == 0, by_name.stderr
        plaintext = healthcheck("--plaintext", env=r.env)
        assert plaintext.returncode == 1 and "failed: UNAVAILABLE" in plaintext.stderr
        untrusted = healthcheck("--tls-ca", str(self_signed / "other.pem"), env=r.env)
        assert untrusted.returncode == 1 and "(tls) failed: UNAVAILABLE" in untrusted.stderr
        wrong_name = healthcheck("--tls-server-name", "not-in-the-cert.example", env=r.env)
        assert wrong_name.returncode == 1
        code, _ = r.terminate(within=60)
        assert code == 0, r.output()
    finally:
        r.stop()
