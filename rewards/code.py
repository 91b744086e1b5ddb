"""The code verifier: take the program out of a completion and run it against the job's tests in the sandbox.

Owns the test format (below), program extraction and the scoring rule; the sandbox (`sandbox.run`) owns the
isolation. Knows nothing about records or the stage.

Tests come from the job's metadata (strings), one or both of:
- `metadata["tests"]`: a JSON list of `{"stdin": "...", "stdout": "..."}`: the program runs once per pair
  with that stdin and passes if its stdout equals the expected one, compared line by line with trailing
  whitespace and trailing blank lines ignored;
- `metadata["test_code"]`: Python source (asserts, calls) appended to the program and run once: passes if
  the run exits 0.

The program is the last fenced block labelled python / py / python3 in the completion, else the last fenced
block without a label, else the whole completion.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from . import sandbox
from .types import RewardInput, RewardResult

TESTS_KEY = "tests"
TEST_CODE_KEY = "test_code"

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_program(completion: str) -> str:
    """The program in a completion (see the module docstring for the rule)."""
    blocks = _FENCE.findall(completion)
    for wanted in (("python", "py", "python3"), ("",)):
        labelled = [body for label, body in blocks if label.lower() in wanted]
        if labelled:
            return labelled[-1]
    return completion


@dataclass(frozen=True)
class IOTest:
    stdin: str
    stdout: str


def parse_tests(metadata) -> tuple[list[IOTest], str | None]:
    """(stdin/stdout tests, test code) from a job's metadata; ValueError / KeyError if malformed or absent."""
    if TESTS_KEY not in metadata and TEST_CODE_KEY not in metadata:
        keys = f"metadata[{TESTS_KEY!r}] or metadata[{TEST_CODE_KEY!r}]"
        raise KeyError(f"code_reward needs {keys}; got {sorted(metadata)}")
    io_tests = []
    if TESTS_KEY in metadata:
        raw = json.loads(metadata[TESTS_KEY])
        if not isinstance(raw, list) or not all(
            isinstance(t, dict) and isinstance(t.get("stdin", ""), str) and isinstance(t.get("stdout"), str)
            for t in raw
        ):
            raise ValueError(
                f'metadata[{TESTS_KEY!r}] must be a JSON list of {{"stdin": str, "stdout": str}}'
            )
        io_tests = [IOTest(t.get("stdin", ""), t["stdout"]) for t in raw]
    test_code = metadata.get(TEST_CODE_KEY)
    if not io_tests and not test_code:
        raise ValueError(f"no tests in metadata[{TESTS_KEY!r}] / metadata[{TEST_CODE_KEY!r}]")
    return io_tests, test_code


def _normalise(output: str) -> list[str]:
    lines = [line.rstrip() for line in output.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _failure(result: sandbox.SandboxResult) -> str | None:
    """Why a run failed as such (stopped, crashed), or None if it exited 0."""
    if result.stopped:
        return f"stopped in the sandbox: {result.stopped}"
    if result.exit_code != 0:
        last = result.stderr.strip().splitlines()[-1:] or [""]
        return f"exit {result.exit_code}: {_short(last[0])}"
    return None


def make_code_reward(
    *,
    scoring: Literal["fraction", "all"] = "fraction",
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_processes: int = 16,
    max_output_bytes: int = 1 << 16,
) -> Callable[[RewardInput], RewardResult]:
    """A code reward function. scoring="fraction": reward = tests passed / tests; "all": 1.0 only if every
    test passes (it stops at the first failure). The limits apply to each run of the program."""
    if scoring not in ("fraction", "all"):
        raise ValueError(f"scoring={scoring!r}; expected 'fraction' or 'all'")
    all_or_nothing = scoring == "all"
    limits = {
        "timeout_s": timeout_s,
        "memory_mb": memory_mb,
        "max_processes": max_processes,
        "max_output_bytes": max_output_bytes,
    }

    def code_reward(inp: RewardInput) -> RewardResult:
        io_tests, test_code = parse_tests(inp.metadata)
        program = extract_program(inp.completion)
        total = len(io_tests) + (1 if test_code else 0)
        passed, first_failure = 0, ""
        for i, test in enumerate(io_tests):
            result = sandbox.run(program, stdin=test.stdin, **limits)
            why = _failure(result)
            if why is None and _normalise(result.stdout) != _normalise(test.stdout):
                why = f"expected {_short(test.stdout)}, got {_short(result.stdout)}"
            if why is None:
                passed += 1
                continue
            first_failure = first_failure or f"test {i} (stdin {_short(test.stdin, 30)}): {why}"
            if all_or_nothing:
                break
        if test_code and not (first_failure and all_or_nothing):
            why = _failure(sandbox.run(program + "\n\n" + test_code + "\n", **limits))
            if why is None:
                passed += 1
            else:
                first_failure = first_failure or f"test code: {why}"
        reward = float(passed == total) if all_or_nothing else passed / total
        reason = f"{passed}/{total} tests passed" + (
            f"; first failure: {first_failure}" if first_failure else ""
        )
        return RewardResult(reward, "code", reason)

    return code_reward


code_reward = make_code_reward()
