"""The maths verifier: extraction rules, a table of (non-)equivalent answers through math_verify, the time
limit in the main thread and in worker threads (where math_verify's own signal-based timeout cannot run)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from maskroll.rewards import maths
from maskroll.rewards.maths import Extracted, equivalent, extract_answer, math_reward
from maskroll.rewards.types import RewardInput, RewardResult


def _inp(completion: str, **metadata: str) -> RewardInput:
    return RewardInput(
        prompt="q",
        completion=completion,
        prompt_ids=np.zeros(1, np.int32),
        completion_ids=np.zeros(1, np.int32),
        metadata=metadata,
    )


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (r"so \boxed{\frac{1}{2}}", Extracted(r"\frac{1}{2}", "boxed")),
        (r"\boxed{\frac{\sqrt{3}}{2}} and more text", Extracted(r"\frac{\sqrt{3}}{2}", "boxed")),
        (r"first \boxed{1}, finally \boxed{ {2}^{3} }", Extracted("{2}^{3}", "boxed")),
        (r"$\boxed{\{1, 2\}}$", Extracted(r"\{1, 2\}", "boxed")),
        (r"\fbox{7}", Extracted("7", "boxed")),
        ("The answer is 42.", Extracted("42", "answer is")),
        ("so the answer is: $-3.5$.\nDone", Extracted("-3.5", "answer is")),
        ("answer is 0.5.", Extracted("0.5", "answer is")),
        ("I got 3 apples and then 1,234 pears", Extracted("1234", "last number")),
        ("maybe -7/8 or so", Extracted("-7/8", "last number")),
        (r"unclosed \boxed{12 so 5", Extracted("5", "last number")),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(completion: str, expected: Extracted | None) -> None:
    assert extract_answer(completion) == expected


EQUIVALENT = [
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{\dfrac{2}{4}}", "1/2"),
    ("The answer is 3/4.", "0.75"),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{-4}", "-4"),
    ("the answer is -4.", r"\boxed{-4}"),
    ("answer is 42.", "42"),
    ("The total is 42", "42.0"),
    (r"\boxed{\{3, 2, 1\}}", r"\{1,2,3\}"),
    (r"\boxed{[0, 1)}", "[0,1)"),
    (r"\boxed{2(x+1)}", "2x+2"),
    (r"\boxed{x = 2}", "2"),
    (r"\boxed{\pi}", "3.14159265"),
    (r"so $\boxed{10\%}$", "0.1"),
    (r"\boxed{1,000}", "1000"),
]
NOT_EQUIVALENT = [
    (r"\boxed{0.33}", r"\frac{1}{3}"),
    (r"\boxed{4}", "-4"),
    (r"\boxed{(0, 1)}", "[0,1]"),
    (r"\boxed{\{1, 2\}}", r"\{1,2,3\}"),
    (r"\boxed{2x+1}", "2x+2"),
    ("The answer is 41.", "42"),
    (r"\boxed{\frac{1}{2}} but actually the answer is 3", "3"),  # \boxed wins
]


@pytest.mark.parametrize(("completion", "reference"), EQUIVALENT)
def test_equivalent_answers_score_one(completion: str, reference: str) -> None:
    result = math_reward(_inp(completion, answer=reference))
    assert (result.reward, result.verifier) == (1.0, "math"), result.reason
    assert result.reason.endswith(": equal")


@pytest.mark.parametrize(("completion", "reference"), NOT_EQUIVALENT)
def test_different_answers_score_zero(completion: str, reference: str) -> None:
    result = math_reward(_inp(completion, answer=reference))
    assert result.reward == 0.0, result.reason
    assert result.reason.endswith(": not equal")


def test_reason_names_what_was_compared() -> None:
    result = math_reward(_inp(r"thus \boxed{\frac{3}{4}}", answer="0.75"))
    assert result == RewardResult(1.0, "math", r"boxed '\\frac{3}{4}' vs expected '0.75': equal")


def test_missing_answer_scores_zero_with_reason() -> None:
    result = math_reward(_inp("I cannot solve this.", answer="7"))
    assert result.reward == 0.0
    assert result.reason.startswith("no answer found") and "'7'" in result.reason


def test_missing_reference_is_an_error() -> None:
    with pytest.raises(KeyError, match="metadata\\['answer'\\]"):
        math_reward(_inp(r"\boxed{1}", tests="[]"))


def test_slow_check_times_out_in_the_main_thread() -> None:
    assert threading.current_thread() is threading.main_thread()
    start = time.monotonic()
    assert equivalent("9^{9^{8}}", "9^{9^{9}}", timeout_s=1.0) is None
    assert time.monotonic() - start < 3
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL  # the handler was restored
    assert equivalent("0.5", r"\frac{1}{2}") is True
    result = math_reward(_inp(r"\boxed{9^{9^{8}}}", answer="9^{9^{9}}"), timeout_s=1.0)
    assert result.reward == 0.0 and result.reason.endswith("undecided after 1s")


@pytest.mark.slow
def test_worker_threads_score_and_time_out() -> None:
    cases = [(c, r, 1.0) for c, r in EQUIVALENT[:6]] + [(c, r, 0.0) for c, r in NOT_EQUIVALENT[:4]]
    with ThreadPoolExecutor(2) as pool:
        rewards = list(pool.map(lambda case: math_reward(_inp(case[0], answer=case[1])).reward, cases))
        assert rewards == [expected for _, _, expected in cases]
        start = time.monotonic()
        slow = pool.submit(equivalent, "9^{9^{8}}", "9^{9^{9}}", timeout_s=1.0).result()
        assert slow is None
        assert time.monotonic() - start < 3 + maths._HELPER_GRACE_S
        helpers = pool.map(lambda _: getattr(maths._helpers, "helper", None), range(8))
        pids = {helper.proc.pid for helper in helpers if helper is not None}
        assert pids
    gc.collect()
    for pid in pids:  # the threads ended, and their helpers with them
        assert not os.path.exists(f"/proc/{pid}"), pid


@pytest.mark.slow
def test_a_helper_that_stops_answering_is_replaced() -> None:
    with ThreadPoolExecutor(1) as pool:  # one thread, so one helper
        assert pool.submit(equivalent, "1/2", "0.5").result() is True
        stuck = pool.submit(lambda: maths._helpers.helper.proc).result()
        os.kill(stuck.pid, signal.SIGSTOP)  # as if stuck in C code, where no alarm handler runs
        start = time.monotonic()
        assert pool.submit(equivalent, "1/2", "0.5", timeout_s=0.5).result() is None
        assert 0.5 + maths._HELPER_GRACE_S <= time.monotonic() - start < 0.5 + maths._HELPER_GRACE_S + 2
        assert stuck.poll() is not None  # killed and reaped
        assert pool.submit(equivalent, "1/2", "0.5").result() is True  # a fresh helper
        fresh = pool.submit(lambda: maths._helpers.helper.proc).result()
        assert fresh.pid != stuck.pid
