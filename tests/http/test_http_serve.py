"""`maskroll serve --http-port 0` as a real process: the ready line names the HTTP address, both front
ends serve one engine, and SIGTERM drains them together (readiness off, running streams aborted after
the drain timeout, exit 0). Only the process started here is ever signalled."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from maskroll.client import SamplingOptions, SyncRolloutClient

TOKEN = "serve-test-token-0123456789"


@pytest.mark.slow
def test_serve_with_http_port_zero_serves_both_and_drains_both_on_sigterm(tiny_model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASKROLL_AUTH_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "maskroll.app.cli", "serve", "--model", str(tiny_model_dir)]
    cmd += [
        "--engine",
        "torch",
        "--port",
        "0",
        "--http-port",
        "0",
        "--threads",
        "1",
        "--drain-timeout-s",
        "0.5",  # the stream below needs longer: the drain ends it
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, ready = time.monotonic() + 120, ""
        while "ready on" not in ready:
            ready = proc.stdout.readline()
            assert ready or proc.poll() is None, f"serve exited with {proc.returncode}"
            assert time.monotonic() < deadline, "not ready after 120 s"
        m = re.search(r"ready on 127\.0\.0\.1:(\d+) .*; http (http://127\.0\.0\.1:\d+)\)", ready)
        assert m, ready
        grpc_port, base = m.group(1), m.group(2)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with SyncRolloutClient(f"127.0.0.1:{grpc_port}", token=TOKEN) as c:
            assert (
                c.generate_record([256, 65], SamplingOptions(max_tokens=2, ignore_eos=True)).num_tokens == 2
            )
        events: list[str] = []
        streaming = threading.Event()

        def consume() -> None:
            body = {"model": "model", "prompt": "x", "max_tokens": 1022, "stream": True, "ignore_eos": True}
            with (
                httpx.Client(base_url=base, headers=headers, timeout=60) as h,
                h.stream("POST", "/v1/completions", json=body) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        streaming.set()

        t = threading.Thread(target=consume)
        t.start()
        assert streaming.wait(60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(base + "/readyz").status_code != 503:  # drain began: not ready, still listening
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"  # ended by the drain timeout
    assert "stopped" in proc.stdout.read()
