"""The code verifier with real programs in the real sandbox: extraction, stdin/stdout tests, appended test
code, the two scoring rules, and programs that hang, crash or try to escape."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from maskroll.rewards import sandbox
from maskroll.rewards.code import code_reward, extract_program, make_code_reward, parse_tests
from maskroll.rewards.types import RewardInput

_WHY = sandbox.available()
pytestmark = pytest.mark.skipif(bool(_WHY), reason=f"no sandbox here: {_WHY}")

SUM_TESTS = json.dumps(
    [
        {"stdin": "1 2\n", "stdout": "3\n"},
        {"stdin": "10 -4\n", "stdout": "6"},
        {"stdin": "0 0\n", "stdout": "0\n\n"},
    ]
)


def _inp(completion: str, **metadata: str) -> RewardInput:
    return RewardInput(
        prompt="q",
        completion=completion,
        prompt_ids=np.zeros(1, np.int32),
        completion_ids=np.zeros(1, np.int32),
        metadata=metadata,
    )


def _fenced(code: str, label: str = "python") -> str:
    return f"Here is my solution.\n```{label}\n{textwrap.dedent(code).strip()}\n```\nIt reads two numbers."


def test_extract_program() -> None:
    assert extract_program(_fenced("print(1)")) == "print(1)\n"
    two = "```python\nprint('draft')\n```\nbetter:\n```py\nprint('final')\n```"
    assert extract_program(two) == "print('final')\n"
    assert extract_program("```\nprint(2)\n```") == "print(2)\n"
    assert extract_program("```bash\nls\n```\n```python\nprint(3)\n```") == "print(3)\n"
    assert extract_program("print(4)") == "print(4)"


def test_all_tests_pass() -> None:
    result = code_reward(_inp(_fenced("a, b = map(int, input().split())\nprint(a + b)"), tests=SUM_TESTS))
    assert (result.reward, result.verifier, result.reason) == (1.0, "code", "3/3 tests passed")


def test_fraction_and_first_failure() -> None:
    # wrong when b is negative: passes tests 0 and 2
    program = "a, b = map(int, input().split())\nprint(a + abs(b))"
    result = code_reward(_inp(_fenced(program), tests=SUM_TESTS))
    assert result.reward == pytest.approx(2 / 3)
    assert (
        result.reason
        == "2/3 tests passed; first failure: test 1 (stdin '10 -4\\n'): expected '6', got '14\\n'"
    )


def test_all_or_nothing_stops_at_first_failure() -> None:
    program = "a, b = map(int, input().split())\nprint(a + abs(b))"
    strict = make_code_reward(scoring="all")
    result = strict(_inp(_fenced(program), tests=SUM_TESTS))
    assert result.reward == 0.0
    assert result.reason.startswith("1/3 tests passed; first failure: test 1")
    good = strict(_inp(_fenced("a, b = map(int, input().split())\nprint(a + b)"), tests=SUM_TESTS))
    assert good.reward == 1.0


def test_crash_and_timeout_are_named() -> None:
    crash = code_reward(_inp(_fenced("raise ValueError('nope')"), tests=SUM_TESTS))
    assert crash.reward == 0.0
    assert "first failure: test 0 (stdin '1 2\\n'): exit 1: 'ValueError: nope'" in crash.reason
    quick = make_code_reward(timeout_s=1.0, scoring="all")
    hang = quick(_inp(_fenced("while True:\n    pass"), tests=SUM_TESTS))
    assert hang.reward == 0.0
    assert (
        hang.reason
        == "0/3 tests passed; first failure: test 0 (stdin '1 2\\n'): stopped in the sandbox: timeout"
    )


def test_memory_hog_and_fork_bomb_fail_their_tests() -> None:
    hog = code_reward(_inp(_fenced("x = bytearray(2 << 30)\nprint(3)"), tests=SUM_TESTS))
    assert hog.reward == 0.0 and "stopped in the sandbox: memory" in hog.reason
    bomb = code_reward(_inp(_fenced("import os\nwhile True:\n    os.fork()"), tests=SUM_TESTS))
    assert bomb.reward == 0.0 and "stopped in the sandbox: processes" in bomb.reason


def test_assert_style_test_code() -> None:
    completion = _fenced(
        """
        def gcd(a, b):
            while b:
                a, b = b, a % b
            return a
        """
    )
    tests = "assert gcd(12, 18) == 6\nassert gcd(7, 5) == 1\nassert gcd(0, 9) == 9"
    assert code_reward(_inp(completion, test_code=tests)).reward == 1.0
    wrong = code_reward(_inp(_fenced("def gcd(a, b):\n    return min(a, b)"), test_code=tests))
    assert wrong.reward == 0.0
    assert wrong.reason == "0/1 tests passed; first failure: test code: exit 1: 'AssertionError'"


def test_both_kinds_of_tests_count() -> None:
    program = """
    import sys

    def add(a, b):
        return a + b

    if __name__ == "__main__" and (numbers := sys.stdin.read().split()):
        print(add(*map(int, numbers)))
    """
    result = code_reward(_inp(_fenced(program), tests=SUM_TESTS, test_code="assert add(2, 2) == 5"))
    assert result.reward == pytest.approx(3 / 4)
    assert result.reason == "3/4 tests passed; first failure: test code: exit 1: 'AssertionError'"


def test_whole_completion_is_the_program_without_a_fence() -> None:
    result = code_reward(_inp("print(sum(map(int, input().split())))", tests=SUM_TESTS))
    assert result.reward == 1.0


def test_malformed_or_missing_tests_are_errors() -> None:
    with pytest.raises(KeyError, match="metadata\\['tests'\\] or metadata\\['test_code'\\]"):
        code_reward(_inp("print(1)", answer="1"))
    with pytest.raises(ValueError, match="JSON list"):
        parse_tests({"tests": json.dumps({"stdin": "", "stdout": ""})})
    with pytest.raises(ValueError):
        parse_tests({"tests": "not json"})
    with pytest.raises(ValueError, match="no tests"):
        parse_tests({"tests": "[]"})
    with pytest.raises(ValueError, match="scoring='best'"):
        make_code_reward(scoring="best")  # type: ignore[arg-type]
