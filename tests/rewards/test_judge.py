"""The LLM judge against a real local HTTP server (stdlib, port 0) that answers /v1/chat/completions with
canned replies chosen by the requested model name: a verdict, a malformed reply, a slow one, a 500 then a
success, a 400."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from maskroll.rewards.judge import DEFAULT_RUBRIC, JudgeError, make_judge, parse_verdict
from maskroll.rewards.types import RewardInput, RewardResult


class _Server:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict, str]] = []  # (path, body, authorization)
        self.attempts: dict[str, int] = {}
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                model = body["model"]
                with outer.lock:
                    outer.requests.append((self.path, body, self.headers.get("Authorization", "")))
                    outer.attempts[model] = attempt = outer.attempts.get(model, 0) + 1
                if model == "slow":
                    time.sleep(1.0)
                    return self._reply("SCORE: 9/10")
                if model == "flaky" and attempt == 1:
                    return self._send(500, {"error": "overloaded"})
                if model == "refuses":
                    return self._send(400, {"error": "bad request"})
                if model == "malformed":
                    return self._reply("I think it is pretty good overall.")
                if model == "not-chat":
                    return self._send(200, {"object": "error"})
                if model == "out-of-range":
                    return self._reply("SCORE: 12/10")
                return self._reply("The response is correct but terse.\nSCORE: 7/10")

            def _reply(self, content: str) -> None:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
                self._send(200, {"id": "c1", "object": "chat.completion", "choices": [choice]})

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left (the slow case)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    srv.thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()
    srv.thread.join()


def _inp(completion: str = "Paris.", **metadata: str) -> RewardInput:
    return RewardInput(
        prompt="What is the capital of France?",
        completion=completion,
        prompt_ids=np.zeros(1, np.int32),
        completion_ids=np.zeros(1, np.int32),
        metadata=metadata,
    )


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("SCORE: 7/10", 0.7),
        ("reasoning...\nscore: 3 / 4", 0.75),
        ("SCORE: 2/10 at first, but on reflection SCORE: 10/10", 1.0),
        ("SCORE: 0/10", 0.0),
        ("SCORE: 4.5/10", 0.45),
    ],
)
def test_parse_verdict(text: str, reward: float) -> None:
    assert parse_verdict(text) == pytest.approx(reward)


@pytest.mark.parametrize("text", ["great answer", "SCORE: 7", "SCORE: 11/10", "SCORE: 1/0", ""])
def test_unparseable_verdicts(text: str) -> None:
    with pytest.raises(JudgeError):
        parse_verdict(text)


def test_scores_with_rubric_and_key(server: _Server) -> None:
    judge = make_judge(server.base_url, "good", api_key="sk-test", rubric="Be strict. End with SCORE: n/10")
    try:
        result = judge(_inp("Paris.", reference="Paris"))
    finally:
        judge.close()
    assert result == RewardResult(0.7, "judge", "good: SCORE: 7/10")
    [(path, body, auth)] = server.requests
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert body["model"] == "good" and body["temperature"] == 0.0
    system, user = body["messages"]
    assert system == {"role": "system", "content": "Be strict. End with SCORE: n/10"}
    assert user["role"] == "user"
    assert "What is the capital of France?" in user["content"] and "Paris." in user["content"]
    assert "Reference answer:\nParis" in user["content"]


def test_default_rubric_asks_for_the_parsed_format(server: _Server) -> None:
    assert "SCORE: <n>/10" in DEFAULT_RUBRIC
    judge = make_judge(server.base_url + "/", "good")
    assert judge(_inp()).reward == pytest.approx(0.7)
    assert server.requests[0][1]["messages"][0]["content"] == DEFAULT_RUBRIC
    assert server.requests[0][2] == ""  # no api key, no header
    assert "Reference answer" not in server.requests[0][1]["messages"][1]["content"]


def test_malformed_verdict_is_an_error_not_retried(server: _Server) -> None:
    judge = make_judge(server.base_url, "malformed", retries=3, backoff_s=0.01)
    with pytest.raises(JudgeError, match="no 'SCORE: n/m' in the judge's reply: 'I think it is pretty good"):
        judge(_inp())
    assert server.attempts["malformed"] == 1
    with pytest.raises(JudgeError, match="not a score"):
        make_judge(server.base_url, "out-of-range")(_inp())
    with pytest.raises(JudgeError, match="not a chat completion"):
        make_judge(server.base_url, "not-chat")(_inp())


def test_500_then_success_is_retried(server: _Server) -> None:
    judge = make_judge(server.base_url, "flaky", retries=2, backoff_s=0.2)
    start = time.monotonic()
    assert judge(_inp()).reward == pytest.approx(0.7)
    assert server.attempts["flaky"] == 2
    assert time.monotonic() - start >= 0.2  # backed off once


def test_slow_judge_times_out_after_the_retries(server: _Server) -> None:
    judge = make_judge(server.base_url, "slow", timeout_s=0.3, retries=2, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(JudgeError, match=r"ReadTimeout.*\(attempt 3 of 3\)"):
        judge(_inp())
    elapsed = time.monotonic() - start
    assert server.attempts["slow"] == 3
    assert 3 * 0.3 + 0.05 + 0.1 <= elapsed < 3  # three attempts of 0.3 s and two backoffs, not 3 x 1 s


def test_client_errors_are_not_retried(server: _Server) -> None:
    judge = make_judge(server.base_url, "refuses", retries=3, backoff_s=0.01)
    with pytest.raises(JudgeError, match=r"HTTP 400.*\(attempt 1 of 4\)"):
        judge(_inp())
    assert server.attempts["refuses"] == 1


def test_unreachable_judge_is_retried_then_an_error() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = make_judge(f"http://127.0.0.1:{port}/v1", "good", retries=1, backoff_s=0.01, timeout_s=2)
    with pytest.raises(JudgeError, match=r"ConnectError.*\(attempt 2 of 2\)"):
        judge(_inp())


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="retries=-1"):
        make_judge("http://127.0.0.1:1/v1", "m", retries=-1)
