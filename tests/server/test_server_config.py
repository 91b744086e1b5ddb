"""ServerConfig: bounds, cross-field rules, env vars under flags, and `maskroll serve` failing fast (exit 2,
nothing heavy imported) on a bad configuration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from maskroll.server.config import ConfigError, ServerConfig, build_parser, load_config


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("MASKROLL_"):
            monkeypatch.delenv(key)


def test_defaults(model):
    c = load_config(["--model", str(model)])
    assert (c.engine, c.host, c.port, c.metrics_port, c.max_logprobs) == (
        "auto",
        "127.0.0.1",
        50051,
        None,
        20,
    )
    assert c.weights_root is None and c.token is None and c.tls_cert is None
    assert c.resolved_engine in ("torch", "vllm") and c.replica_id


def test_flags_override_env_vars_which_override_defaults(model, monkeypatch):
    monkeypatch.setenv("MASKROLL_MODEL", str(model))
    monkeypatch.setenv("MASKROLL_PORT", "6000")
    monkeypatch.setenv("MASKROLL_MAX_N", "3")
    c = load_config(["--port", "7000"])
    assert (c.port, c.max_n) == (7000, 3)


def test_every_field_has_a_flag_with_help():
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(flags) == set(ServerConfig.model_fields)
    for name, action in flags.items():
        assert action.help and "MASKROLL_" + name.upper() in action.help, name


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--port", "70000"], "port: Input should be less than or equal to 65535"),
        (["--port", "-1"], "port: Input should be greater than or equal to 0"),
        (["--max-logprobs", "-1"], "max_logprobs"),
        (["--max-n", "0"], "max_n"),
        (["--max-message-bytes", "10"], "max_message_bytes"),
        (["--drain-timeout-s", "-1"], "drain_timeout_s"),
        (["--max-tokens", "lots"], "max_tokens: Input should be a valid integer"),
        (["--auth-token", "a b"], "auth_token must be printable with no spaces"),
    ],
)
def test_out_of_bounds_values_name_the_field(model, argv, needle):
    with pytest.raises(ConfigError) as err:
        load_config(["--model", str(model), *argv])
    assert needle in str(err.value)


def test_model_must_exist_and_contain_config_json(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["--model", str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        load_config(["--model", str(tmp_path)])


def test_tls_needs_both_files(model, tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match=r"tls_cert=.*cert.pem, tls_key=None"):
        load_config(["--model", str(model), "--tls-cert", str(cert)])
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(["--model", str(model), "--tls-cert", str(cert), "--tls-key", str(tmp_path / "missing")])


def test_metrics_port_must_differ_from_port(model):
    with pytest.raises(ConfigError, match="metrics_port=9000 equals port=9000"):
        load_config(["--model", str(model), "--port", "9000", "--metrics-port", "9000"])
    assert load_config(["--model", str(model), "--port", "0", "--metrics-port", "0"]).metrics_port == 0


def test_weights_root_must_be_a_directory_and_is_resolved(model, tmp_path):
    with pytest.raises(ConfigError, match="weights_root"):
        load_config(["--model", str(model), "--weights-root", str(tmp_path / "nope")])
    (tmp_path / "w").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "w")
    assert (
        load_config(["--model", str(model), "--weights-root", str(tmp_path / "link")]).weights_root
        == (tmp_path / "w").resolve()
    )


def test_engine_vllm_without_vllm_installed_is_refused(model, monkeypatch):
    import maskroll.server.config as config

    monkeypatch.setattr(config, "vllm_available", lambda: False)
    with pytest.raises(ConfigError, match="engine='vllm' but vllm is not installed"):
        load_config(["--model", str(model), "--engine", "vllm"])
    assert load_config(["--model", str(model), "--engine", "auto"]).resolved_engine == "torch"


def test_unknown_engine_is_an_argparse_error(model):
    with pytest.raises(SystemExit) as err:
        load_config(["--model", str(model), "--engine", "tensorrt"])
    assert err.value.code == 2


def test_the_token_never_appears_in_the_config_repr(model):
    c = load_config(["--model", str(model), "--auth-token", "s3cret"])
    assert c.token == "s3cret" and "s3cret" not in repr(c)


def test_serve_exits_2_on_a_bad_config_before_importing_anything_heavy(tmp_path):
    code = (
        "import sys, json\n"
        "from maskroll.server.cli import main\n"
        f"rc = main(['serve', '--model', {str(tmp_path / 'nope')!r}, '--port', '99999'])\n"
        "heavy = [m for m in ('grpc', 'torch', 'vllm', 'transformers') if m in sys.modules]\n"
        "print(json.dumps([rc, heavy]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    rc, heavy = json.loads(out.stdout)
    assert rc == 2 and heavy == []
    assert (
        "model: model directory" in out.stderr
        and "port: Input should be less than or equal to 65535" in out.stderr
    )


@pytest.mark.slow
def test_serve_on_a_port_in_use_exits_1_with_a_clear_message(tiny_model_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "maskroll.server.cli", "serve", "--model", str(tiny_model_dir),
             "--engine", "torch", "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert f"maskroll serve: cannot listen on 127.0.0.1:{port}" in out.stderr
