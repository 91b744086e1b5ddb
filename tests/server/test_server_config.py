"""ServerConfig: bounds, cross-field rules, env vars under flags, and `maskroll serve` failing fast (exit 2,
nothing heavy imported) on a bad configuration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from maskroll.server.config import (
    ConfigError,
    EngineConfig,
    ServerConfig,
    build_parser,
    config_fields,
    load_config,
)


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


def test_chunk_gathering_defaults_flags_and_env(model, monkeypatch):
    c = load_config(["--model", str(model)])
    assert (c.chunk_interval_ms, c.chunk_max_tokens) == (100.0, 64)
    monkeypatch.setenv("MASKROLL_CHUNK_INTERVAL_MS", "0")
    c = load_config(["--model", str(model), "--chunk-max-tokens", "8"])
    assert (c.chunk_interval_ms, c.chunk_max_tokens) == (0.0, 8)


def test_every_field_has_a_flag_with_help():
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    engine_fields = set(EngineConfig.model_fields)
    assert set(flags) == (set(ServerConfig.model_fields) - {"engine_config"}) | engine_fields
    assert set(flags) == set(config_fields())
    for name, action in flags.items():
        assert action.help and "MASKROLL_" + name.upper() in action.help, name
    assert engine_fields >= {
        "max_model_len",
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "kv_cache_gb",
        "enable_prefix_caching",
        "quantization",
        "seed",
        "dtype",
        "vllm_args",
    }


def test_help_lists_the_engine_flags():
    text = build_parser().format_help()
    for flag in (
        "--max-model-len",
        "--tensor-parallel-size",
        "--gpu-memory-utilization",
        "--kv-cache-gb",
        "--enable-prefix-caching",
        "--quantization",
        "--seed",
        "--dtype",
        "--enforce-eager",
        "--vllm-arg NAME=VALUE",
    ):
        assert flag in text, flag
    text = " ".join(text.split())  # argparse wraps the help lines
    assert "MASKROLL_VLLM_ARGS" in text and "bfloat16 on CUDA, float32 on CPU" in text


def test_engine_defaults(model):
    e = load_config(["--model", str(model)]).engine_config
    assert (e.dtype, e.max_model_len, e.seed, e.tensor_parallel_size) == ("auto", None, 0, 1)
    assert (e.gpu_memory_utilization, e.kv_cache_gb, e.enable_prefix_caching, e.quantization) == (
        None,
        None,
        None,
        None,
    )
    assert e.enforce_eager is False and e.vllm_args == {}


def test_engine_flags_parse_and_override_their_env_vars(model, monkeypatch):
    monkeypatch.setenv("MASKROLL_MAX_MODEL_LEN", "512")
    monkeypatch.setenv("MASKROLL_SEED", "9")
    monkeypatch.setenv("MASKROLL_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv(
        "MASKROLL_VLLM_ARGS", '{"max_num_batched_tokens": 8192, "enable_chunked_prefill": true}'
    )
    c = load_config(
        ["--model", str(model), "--engine", "vllm", "--max-model-len", "256", "--tensor-parallel-size", "4",
         "--gpu-memory-utilization", "0.85", "--enable-prefix-caching", "--quantization", "fp8",
         "--dtype", "bfloat16", "--enforce-eager"]
    )  # fmt: skip
    e = c.engine_config
    assert (e.max_model_len, e.seed, e.tensor_parallel_size, e.gpu_memory_utilization) == (256, 9, 4, 0.85)
    assert (e.enable_prefix_caching, e.quantization, e.dtype, e.enforce_eager) == (
        True,
        "fp8",
        "bfloat16",
        True,
    )
    # JSON values from the environment become the strings vLLM's command line would have been given.
    assert e.vllm_args == {"max_num_batched_tokens": "8192", "enable_chunked_prefill": "true"}
    flags = load_config(
        ["--model", str(model), "--vllm-arg", "block-size=32", "--vllm-arg", "stream_interval=4"]
    )
    assert flags.engine_config.vllm_args == {"block_size": "32", "stream_interval": "4"}  # flags replace env
    auto = load_config(["--model", str(model), "--tensor-parallel-size", "auto"])
    assert auto.engine_config.tensor_parallel_size == "auto"


def test_engine_config_is_nested_and_read_from_the_environment(model, monkeypatch):
    monkeypatch.setenv("MASKROLL_KV_CACHE_GB", "0.5")
    c = ServerConfig(model=model)  # as tests and the bench build it: env vars still apply
    assert c.engine_config.kv_cache_gb == 0.5
    c = ServerConfig(model=model, engine_config=EngineConfig(max_model_len=64))
    assert c.engine_config.max_model_len == 64 and c.engine_config.kv_cache_gb == 0.5


VA = "--vllm-arg"
OWN = "has its own setting: use"


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        ([VA, "logprobs_mode=raw_logprobs"], ["'logprobs_mode' is fixed by maskroll", "[--vllm-arg /"]),
        ([VA, "skip-tokenizer-init=false"], ["'skip_tokenizer_init' is fixed by maskroll"]),
        ([VA, "max_logprobs=100"], ["'max_logprobs' is fixed by maskroll"]),
        ([VA, "max_model_len=99"], [f"'max_model_len' {OWN} --max-model-len"]),
        ([VA, "kv_cache_memory_bytes=1G"], [f"'kv_cache_memory_bytes' {OWN} --kv-cache-gb"]),
        ([VA, "max_num_seqs=3"], [f"'max_num_seqs' {OWN} --max-batch"]),
        ([VA, "block_size"], ["--vllm-arg takes NAME=VALUE, got 'block_size'"]),
        ([VA, "Block Size=1"], ["'Block Size' is not a vLLM engine argument name"]),
        ([VA, "block_size=16", VA, "block-size=32"], ["'block_size' is given twice"]),
        (["--max-model-len", "1"], ["max_model_len: Input should be greater than or equal to 2",
                                    "MASKROLL_MAX_MODEL_LEN"]),
        (["--tensor-parallel-size", "0"], ["tensor_parallel_size must be auto or an integer in [1, 1024]"]),
        (["--tensor-parallel-size", "many"], ["tensor_parallel_size must be auto or an integer"]),
        (["--gpu-memory-utilization", "1.5"], ["gpu_memory_utilization: Input should be less than or"]),
        (["--kv-cache-gb", "0"], ["kv_cache_gb: Input should be greater than 0"]),
        (["--kv-cache-gb", "2", "--gpu-memory-utilization", "0.5"],
         ["give kv_cache_gb (2.0) or gpu_memory_utilization (0.5), not both"]),
        (["--seed", "-1"], ["seed: Input should be greater than or equal to 0"]),
        (["--seed", str(1 << 32)], ["seed: Input should be less than or equal to 4294967295"]),
        (["--quantization", "fp8; rm"], ["quantization: String should match pattern"]),
        (["--enable-prefix-caching", "maybe"], ["enable_prefix_caching: Input should be a valid boolean"]),
    ],
)  # fmt: skip
def test_bad_engine_settings_name_the_setting(model, argv, needles):
    with pytest.raises(ConfigError) as err:
        load_config(["--model", str(model), *argv])
    for needle in needles:
        assert needle in str(err.value)


def test_engine_and_server_errors_are_reported_together(model):
    with pytest.raises(ConfigError) as err:
        load_config(["--model", str(model), "--max-model-len", "1", "--port", "70000"])
    assert "max_model_len" in str(err.value) and "port: Input should be less than" in str(err.value)


def test_vllm_args_env_var_must_be_json(model, monkeypatch):
    monkeypatch.setenv("MASKROLL_VLLM_ARGS", "block_size=16")
    with pytest.raises(ConfigError, match=r"vllm_args.*must hold JSON"):
        load_config(["--model", str(model)])


@pytest.mark.parametrize(
    ("argv", "given"),
    [
        (["--tensor-parallel-size", "2"], "tensor_parallel_size=2"),
        (["--gpu-memory-utilization", "0.9"], "gpu_memory_utilization=0.9"),
        (["--kv-cache-gb", "4"], "kv_cache_gb=4.0"),
        (["--enable-prefix-caching"], "enable_prefix_caching=True"),
        (["--quantization", "fp8"], "quantization='fp8'"),
        (["--vllm-arg", "block_size=16"], "vllm_args={'block_size': '16'}"),
    ],
)
def test_the_torch_engine_refuses_what_only_vllm_can_honour(model, argv, given):
    with pytest.raises(ConfigError) as err:
        load_config(["--model", str(model), "--engine", "torch", *argv])
    assert f"the torch engine cannot honour {given}" in str(err.value)


def test_the_torch_engine_takes_what_it_can_honour(model, monkeypatch):
    import maskroll.server.config as config

    c = load_config(
        ["--model", str(model), "--engine", "torch", "--max-model-len", "128", "--seed", "7", "--dtype",
         "bfloat16", "--tensor-parallel-size", "1", "--enable-prefix-caching", "false", "--enforce-eager"]
    )  # fmt: skip
    assert (c.engine_config.max_model_len, c.engine_config.seed, c.engine_config.dtype) == (
        128,
        7,
        "bfloat16",
    )
    # engine=auto without vllm resolves to torch, and the refusal says so.
    monkeypatch.setattr(config, "vllm_available", lambda: False)
    with pytest.raises(ConfigError, match=r"torch engine \(engine=auto and vllm is not installed\)"):
        load_config(["--model", str(model), "--tensor-parallel-size", "auto", "--quantization", "awq"])


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
        (["--chunk-interval-ms", "-5"], "chunk_interval_ms: Input should be greater than or equal to 0"),
        (["--chunk-max-tokens", "0"], "chunk_max_tokens: Input should be greater than or equal to 1"),
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
        "from maskroll.app.cli import main\n"
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
            [sys.executable, "-m", "maskroll.app.cli", "serve", "--model", str(tiny_model_dir),
             "--engine", "torch", "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert f"maskroll serve: cannot listen on 127.0.0.1:{port}" in out.stderr


def test_every_setting_is_in_exactly_one_help_section():
    from maskroll.server.config import HELP_GROUPS, build_parser, config_fields

    placed = [name for names in HELP_GROUPS.values() for name in names]
    assert sorted(placed) == sorted(config_fields()), "a setting is in no --help section, or in two"
    text = build_parser().format_help()
    # each section lists its own flags: --pull under "pull mode", --auth-token under "security"
    body = text[text.index("\nengine:") :]  # past the usage line, which names every flag
    pull, security = body.index("pull mode (Redis):"), body.index("security:")
    assert pull < body.index("--pull-concurrency") < security < body.index("--auth-token")
