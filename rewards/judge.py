"""The LLM-judge verifier: score a completion with a rubric through any OpenAI-compatible chat endpoint.

Owns the judge's request (rubric as the system message, the sample as the user message), the verdict format
and its parsing, and the retry rule. Knows nothing about which server answers (vLLM, a maskroll replica's
/v1/chat/completions, a hosted API); only this module imports httpx.

Verdict format: the judge ends its reply with `SCORE: <n>/<m>` (numbers, 0 <= n <= m, m > 0); the reward is
n/m (the last such line counts). A reply without one is an error (JudgeError), not a zero: the stage must
not invent a reward from a judge that did not answer.

Retries (one named rule, `_retryable`): timeouts, connection errors and HTTP 429 / 500 / 502 / 503 / 504 are
retried up to `retries` times with exponential backoff (`backoff_s * 2**k`); each attempt has its own
`timeout_s`. Any other HTTP error and an unparseable verdict fail at once.
"""

from __future__ import annotations

import re
import time

import httpx

from .types import RewardInput, RewardResult

DEFAULT_RUBRIC = """You grade one response to a prompt.
Judge correctness first, then completeness and clarity.
Think briefly, then end your reply with one line of exactly this form:
SCORE: <n>/10
where <n> is an integer from 0 (useless or wrong) to 10 (fully correct and clear)."""
REFERENCE_KEY = "reference"  # optional metadata: a reference answer shown to the judge

_VERDICT = re.compile(r"SCORE:\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class JudgeError(RuntimeError):
    """The judge gave no verdict: HTTP failure after the retries, a refused request, an unparseable reply."""


def parse_verdict(text: str) -> float:
    """The reward in a judge's reply: the last `SCORE: n/m` as n/m. Raises JudgeError if there is none or
    it is out of range."""
    found = _VERDICT.findall(text)
    if not found:
        raise JudgeError(f"no 'SCORE: n/m' in the judge's reply: {text[-300:]!r}")
    n, m = (float(x) for x in found[-1])
    if m <= 0 or n > m:
        raise JudgeError(f"verdict SCORE: {found[-1][0]}/{found[-1][1]} is not a score in [0, 1]")
    return n / m


def _retryable(error: Exception | None, response: httpx.Response | None) -> bool:
    if error is not None:
        return isinstance(error, (httpx.TimeoutException, httpx.TransportError))
    return response is not None and response.status_code in _RETRY_STATUS


def _messages(rubric: str, inp: RewardInput) -> list[dict[str, str]]:
    user = f"Prompt:\n{inp.prompt}\n\nResponse:\n{inp.completion}"
    if REFERENCE_KEY in inp.metadata:
        user += f"\n\nReference answer:\n{inp.metadata[REFERENCE_KEY]}"
    return [{"role": "system", "content": rubric}, {"role": "user", "content": user}]


class Judge:
    """A reward function that asks an LLM to grade each sample (see `make_judge`). Thread-safe: one pooled
    httpx.Client; `close()` releases it."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        rubric: str,
        api_key: str | None,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        max_tokens: int,
        temperature: float,
    ) -> None:
        if retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(
                f"retries={retries}, timeout_s={timeout_s}, backoff_s={backoff_s}; need >= 0, > 0, >= 0"
            )
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.rubric, self.retries, self.backoff_s = model, rubric, retries, backoff_s
        self.sampling = {"max_tokens": max_tokens, "temperature": temperature}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers)

    def _post(self, body: dict) -> dict:
        for attempt in range(self.retries + 1):
            error, response = None, None
            try:
                response = self.client.post(self.url, json=body)
            except httpx.HTTPError as e:
                error = e
            if response is not None and response.status_code == 200:
                return response.json()
            if attempt == self.retries or not _retryable(error, response):
                what = (
                    repr(error)
                    if response is None
                    else f"HTTP {response.status_code}: {response.text[:300]!r}"
                )
                raise JudgeError(
                    f"judge {self.model} at {self.url}: {what} (attempt {attempt + 1} of {self.retries + 1})"
                )
            time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def __call__(self, inp: RewardInput) -> RewardResult:
        reply = self._post({"model": self.model, "messages": _messages(self.rubric, inp), **self.sampling})
        try:
            text = reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as e:
            raise JudgeError(f"judge {self.model}: not a chat completion: {str(reply)[:300]}") from e
        reward = parse_verdict(text)
        n, m = _VERDICT.findall(text)[-1]
        return RewardResult(reward, "judge", f"{self.model}: SCORE: {n}/{m}")

    def close(self) -> None:
        self.client.close()


def make_judge(
    base_url: str,
    model: str,
    *,
    rubric: str = DEFAULT_RUBRIC,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    max_tokens: int = 512,
    temperature: float = 0.0,
) -> Judge:
    """A reward function that asks `model` at `base_url` (OpenAI style, including the /v1: it POSTs to
    `{base_url}/chat/completions`) to grade each sample with `rubric` (the system message; the user message
    is the prompt, the response and `metadata["reference"]` if the job has one); reward = the verdict's n/m.
    timeout_s is per attempt; retries and backoff_s follow `_retryable`. Raises JudgeError (at call time)
    when the judge gives no verdict."""
    return Judge(
        base_url,
        model,
        rubric=rubric,
        api_key=api_key,
        timeout_s=timeout_s,
        retries=retries,
        backoff_s=backoff_s,
        max_tokens=max_tokens,
        temperature=temperature,
    )
