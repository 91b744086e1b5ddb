"""`maskroll serve --http-port 0` as a real process: the ready line names the HTTP address, both front
ends serve one engine, and SIGTERM drains them together (readiness off, running streams aborted after
the drain timeout, exit 0). Only the process started here is ever signalled."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from maskroll.client import SamplingOptions, SyncRolloutClient
from maskroll.local.replica import LocalReplica

TOKEN = "serve-test-token-0123456789"


@pytest.mark.slow
def test_serve_with_http_port_zero_serves_both_and_drains_both_on_sigterm(tiny_model_dir, tmp_path):
    env = {"OMP_NUM_THREADS": "1", "MASKROLL_AUTH_TOKEN": TOKEN}
    serve = ["--model", str(tiny_model_dir), "--engine", "torch", "--port", "0", "--http-port", "0"]
    # --drain-timeout-s 0.5: the stream below needs longer, the drain ends it
    serve += ["--threads", "1", "--drain-timeout-s", "0.5"]
    replica = LocalReplica(serve, env=env, log=tmp_path / "serve.log").start()
    proc = replica.proc
    try:
        replica.wait_ready(120)
        m = re.search(r"ready on 127\.0\.0\.1:(\d+) .*; http (http://127\.0\.0\.1:\d+)\)", replica.ready_line)
        assert m, replica.ready_line
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
        replica.kill()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"  # ended by the drain timeout
    assert "stopped" in replica.log_text()
