"""Secrets at start-up: a replica refuses the placeholder secrets the deploy files ship (exit 2, naming
the setting, never echoing the value), so an unedited secret.yaml or .env cannot go live."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _placeholders() -> dict[str, str]:
    """The shipped values: secret.yaml's stringData and .env.example's secrets."""
    secret = yaml.safe_load((DEPLOY / "k8s" / "base" / "secret.yaml").read_text())
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / ".env.example").read_text().splitlines()
        if line and not line.startswith("#") and "=" in line
    )
    return {
        "k8s auth-token": secret["stringData"]["auth-token"],
        "k8s redis-password": secret["stringData"]["redis-password"],
        ".env MASKROLL_AUTH_TOKEN": env["MASKROLL_AUTH_TOKEN"],
        ".env REDIS_PASSWORD": env["REDIS_PASSWORD"],
    }


def _serve(model_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MASKROLL_")}
    cmd = [
        sys.executable,
        "-m",
        "maskroll.app.cli",
        "serve",
        "--model",
        str(model_dir),
        "--engine",
        "torch",
    ]
    return subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("which", sorted(_placeholders()))
def test_a_placeholder_secret_is_refused_at_start_up(model_dir, which):
    value = _placeholders()[which]
    if "auth" in which:
        env, field = {"MASKROLL_AUTH_TOKEN": value}, "auth_token: auth_token is a placeholder"
    else:
        env = {"MASKROLL_REDIS_URL": f"redis://:{value}@redis:6379/0"}
        field = "redis_url: the password in redis_url is a placeholder"
    out = _serve(model_dir, env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert field in out.stderr, out.stderr
    assert value not in out.stderr + out.stdout, "the refused secret was echoed"
