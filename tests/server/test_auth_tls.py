"""Bearer-token authentication on every RPC (health excepted) and TLS with a self-signed certificate
made in the test by the `openssl` command line."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import pytest
from grpc_fixtures import replica, server_config, server_loop, torch_engine  # noqa: F401

from maskroll.client import RolloutClient, RolloutError, SamplingOptions

PROMPT = [256, 65]
TOKEN = "test-token-0123456789"


@pytest.fixture(scope="module")
def token_server(server_loop, torch_engine, tiny_model_dir):  # noqa: F811
    with replica(server_loop, server_config(tiny_model_dir, auth_token=TOKEN), torch_engine) as r:
        yield r


async def _every_rpc(c: RolloutClient) -> dict[str, object]:
    """Each RPC's result, or the status code it failed with."""
    calls = {
        "Generate": lambda: c.generate_record(
            PROMPT, SamplingOptions(max_tokens=2, logprobs_k=1, ignore_eos=True)
        ),
        "GetInfo": c.info,
        "UpdateWeights": lambda: c.update_weights(1, "/nonexistent"),
    }
    out = {}
    for name, call in calls.items():
        try:
            out[name] = await call()
        except RolloutError as exc:
            out[name] = exc.code
    return out


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN[:-1], TOKEN + "x"])
def test_missing_or_wrong_token_is_unauthenticated_on_every_rpc(token_server, token):
    async def main():
        async with RolloutClient(token_server.address, token=token) as c:
            return await _every_rpc(c)

    assert asyncio.run(main()) == dict.fromkeys(
        ("Generate", "GetInfo", "UpdateWeights"), grpc.StatusCode.UNAUTHENTICATED
    )


def test_right_token_is_served(token_server):
    async def main():
        async with RolloutClient(token_server.address, token=TOKEN) as c:
            return await _every_rpc(c)

    out = asyncio.run(main())
    assert out["Generate"].num_tokens == 2 and out["GetInfo"].engine == "torch"
    # Past authentication: refused for its own reason (this server has no weights_root).
    assert out["UpdateWeights"] == grpc.StatusCode.PERMISSION_DENIED


def test_refused_calls_are_counted_in_the_metrics(token_server):
    reg = token_server.metrics.registry
    labels = {"method": "GetInfo", "code": "UNAUTHENTICATED"}
    before = reg.get_sample_value("maskroll_requests_total", labels) or 0

    async def main():
        async with RolloutClient(token_server.address, token="nope") as c:
            with pytest.raises(RolloutError):
                await c.info()

    asyncio.run(main())
    assert reg.get_sample_value("maskroll_requests_total", labels) == before + 1


def test_health_stays_open_without_a_token(token_server):
    async def main():
        async with RolloutClient(token_server.address) as c:
            return await c.health()

    assert asyncio.run(main()) == "SERVING"


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def tls_server(server_loop, torch_engine, tiny_model_dir, self_signed):  # noqa: F811
    cert, key = self_signed
    config = server_config(tiny_model_dir, tls_cert=cert, tls_key=key, auth_token=TOKEN)
    with replica(server_loop, config, torch_engine) as r:
        yield r


def test_tls_client_trusting_the_certificate_is_served(tls_server, self_signed):
    async def main():
        roots = self_signed[0].read_bytes()
        async with RolloutClient(tls_server.address, token=TOKEN, root_certs=roots) as c:
            return await c.generate_record(PROMPT, SamplingOptions(max_tokens=3, ignore_eos=True))

    assert asyncio.run(main()).num_tokens == 3


@pytest.mark.parametrize("client", ["plaintext", "untrusted"])
def test_plaintext_or_untrusting_clients_cannot_connect(tls_server, client):
    async def main():
        kwargs = {"tls": True} if client == "untrusted" else {}
        async with RolloutClient(tls_server.address, token=TOKEN, timeout=5, **kwargs) as c:
            with pytest.raises(RolloutError) as err:
                await c.info()
            return err.value.code

    assert asyncio.run(main()) == grpc.StatusCode.UNAVAILABLE
