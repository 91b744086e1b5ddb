"""The maths verifier: pull the final answer out of a completion and compare it with the job's reference
symbolically (math-verify on sympy).

Owns answer extraction (`extract_answer`), the equivalence check with its time limit (`equivalent`) and the
reward function (`math_reward`, reference in `metadata["answer"]`). Knows nothing about how records are
read or published; only this module imports math_verify.

Time limits. math_verify's own timeouts use `signal.alarm`, which works only in the main thread (elsewhere
math_verify raises ValueError), has whole-second resolution and applies per parse and per comparison, not to
a whole check. So we turn them off and put one `setitimer` alarm around the whole check instead, in two
places:
- in the main thread: in process;
- in any other thread (the reward stage runs sync reward functions in worker threads): in a helper process
  owned by that thread (`python -m maskroll.rewards.maths`, JSON lines on its stdin / stdout) whose main
  thread runs the same check under the same alarm. The calling thread waits for its answer with a deadline
  a little past the alarm; a helper stuck in C code (where no Python signal handler runs) is killed and
  replaced on the next call. The helper costs one interpreter with sympy (~1 s to start, once per thread).
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Literal

from .types import RewardInput, RewardResult

ANSWER_KEY = "answer"  # metadata key of the reference answer (LaTeX or plain: "\\frac{1}{2}", "0.5", "[0,1)")
DEFAULT_TIMEOUT_S = 5.0
_HELPER_GRACE_S = 2.0  # past the alarm, before a helper that does not answer is killed

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*(.+?)(?:\.(?:\s|$)|\n|$)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")

How = Literal["boxed", "answer is", "last number"]


@dataclass(frozen=True)
class Extracted:
    """A final answer found in a completion and which rule found it."""

    text: str
    how: How


def _boxed_contents(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (nested braces matched), or None (none, or unclosed)."""
    found = None
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found = text[start:i]
                    break
    return found


def _strip_delimiters(text: str) -> str:
    text = text.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
            text = text[len(left) : len(text) - len(right)].strip()
    return text.rstrip(".").strip()


def extract_answer(completion: str) -> Extracted | None:
    """The final answer of a completion: the last `\\boxed{...}`, else the last "the answer is X", else the
    last number; None if there is none of these."""
    boxed = _boxed_contents(completion)
    if boxed is not None and boxed.strip():
        return Extracted(boxed.strip(), "boxed")
    stated = _ANSWER_IS.findall(completion)
    if stated and _strip_delimiters(stated[-1]):
        return Extracted(_strip_delimiters(stated[-1]), "answer is")
    numbers = _NUMBER.findall(completion)
    if numbers:
        return Extracted(numbers[-1].replace(",", ""), "last number")
    return None


def _reference(answer: str) -> str:
    boxed = _boxed_contents(answer)
    return _strip_delimiters(boxed if boxed is not None else answer)


class _Alarm(BaseException):
    """The check's time is up. A BaseException: math_verify catches Exception around parse and verify."""


def _check(pred: str, gold: str, timeout_s: float) -> bool:
    """parse + verify under one SIGALRM timer; main thread only. Raises _Alarm when the time is up."""
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # Shim (math-verify 0.9.0): with its own timeouts off, math_verify logs "Timeout is disabled ... you
    # must provide the logic for timeout interuption yourself" once per module; we do (the alarm below).
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True

    def parse(text: str) -> list:
        # LaTeX first ("\frac{1}{\sqrt{2}}" has no delimiters of its own), then plain expressions ("10%")
        return math_verify.parse(f"${text}$", parsing_timeout=None) or math_verify.parse(
            text, parsing_timeout=None
        )

    def on_alarm(signum, frame):
        raise _Alarm

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        gold_parsed, pred_parsed = parse(gold), parse(pred)
        return bool(
            gold_parsed and pred_parsed and math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None)
        )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Helper:
    """One helper process for one thread (see module docstring)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "maskroll.rewards.maths"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def check(self, pred: str, gold: str, timeout_s: float) -> bool | None:
        """True / False, or None if the check ran out of time (the helper is then gone)."""
        self.proc.stdin.write(json.dumps({"pred": pred, "gold": gold, "timeout_s": timeout_s}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s + _HELPER_GRACE_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            return None
        answer = json.loads(line)
        return answer["equal"]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()

    def __del__(self) -> None:  # the owning thread ended (its thread-local went away): end the helper too
        if self.proc.returncode is None:
            self.close()

    def alive(self) -> bool:
        return self.proc.poll() is None


_helpers = threading.local()


def equivalent(pred: str, gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool | None:
    """Whether `pred` and `gold` (LaTeX or plain) are the same mathematical object, per math_verify:
    True / False, or None when the check took longer than `timeout_s`. Safe in any thread."""
    if threading.current_thread() is threading.main_thread():
        try:
            return _check(pred, gold, timeout_s)
        except _Alarm:
            return None
    helper = getattr(_helpers, "helper", None)
    if helper is None or not helper.alive():
        helper = _helpers.helper = _Helper()
    return helper.check(pred, gold, timeout_s)


def math_reward(inp: RewardInput, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> RewardResult:
    """1.0 if the completion's final answer equals `inp.metadata["answer"]`, else 0.0; the reason says what
    was extracted (and how) and what it was compared with. A job without an "answer" is an error (KeyError):
    the stage must not invent a reward for it."""
    if ANSWER_KEY not in inp.metadata:
        raise KeyError(
            f"math_reward needs metadata[{ANSWER_KEY!r}] (the reference answer); got {sorted(inp.metadata)}"
        )
    gold = _reference(inp.metadata[ANSWER_KEY])
    found = extract_answer(inp.completion)
    if found is None:
        return RewardResult(
            0.0, "math", f"no answer found (no \\boxed{{}}, 'answer is' or number); expected {gold!r}"
        )
    equal = equivalent(found.text, gold, timeout_s=timeout_s)
    verdict = {True: "equal", False: "not equal", None: f"undecided after {timeout_s:g}s"}[equal]
    return RewardResult(
        1.0 if equal else 0.0, "math", f"{found.how} {found.text!r} vs expected {gold!r}: {verdict}"
    )


def _serve() -> None:
    """The helper process: one JSON request per line on stdin, one answer per line on stdout."""
    for line in sys.stdin:
        request = json.loads(line)
        try:
            equal = _check(request["pred"], request["gold"], request["timeout_s"])
        except _Alarm:
            equal = None
        sys.stdout.write(json.dumps({"equal": equal}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        _serve()
