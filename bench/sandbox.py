"""What the shipped verifiers cost, in one process:

    sandbox      wall time of one `maskroll.rewards.sandbox.run('print("hi")')`: bwrap's namespaces and
                 mounts, the system python's start-up and exit, our supervision (median / min / max over
                 --runs runs after 3 warm-up runs);
    math         scored records/s of `math_reward` on a cycle of equivalent / non-equivalent answers
                 (fractions, decimals, LaTeX, sets, intervals), called from the main thread (in process)
                 and from --threads worker threads (each thread has its helper process; started before
                 the clock);
    code         scored records/s of `code_reward` on a two-test stdin/stdout job (each record = two
                 sandbox runs), sequentially and from --threads threads.

Run: `.venv/bin/python bench/sandbox.py [--runs 50] [--records 200] [--threads 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import common


def math_cases(i: int) -> list[tuple[str, str]]:
    """Eight (completion, reference) pairs, distinct for each i (no parse cache helps), five of them equal."""
    return [
        (rf"so \boxed{{\frac{{{i}}}{{{i + 1}}}}}", f"{i}/{i + 1}"),
        (f"The answer is {i}.25.", rf"\frac{{{4 * i + 1}}}{{4}}"),
        (rf"\boxed{{\{{{i}, {i + 2}, {i + 1}\}}}}", rf"\{{{i},{i + 1},{i + 2}\}}"),
        (rf"\boxed{{[{i}, {i + 1})}}", f"[{i},{i + 1})"),
        (rf"\boxed{{{i}(x+1)}}", f"{i}x+{i}"),
        (r"\boxed{0.33}", rf"\frac{{{i}}}{{{3 * i + 1}}}"),
        (f"I got {i} in the end", f"{i + 1}"),
        (rf"\boxed{{\frac{{\sqrt{{2}}}}{{{i + 2}}}}}", rf"\frac{{1}}{{{i + 2}\sqrt{{2}}}}"),
    ]


CODE_COMPLETION = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CODE_TESTS = json.dumps([{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "10 -4\n", "stdout": "6\n"}])


def _inp(completion: str, **metadata: str):
    import numpy as np

    from maskroll.rewards.types import RewardInput

    zeros = np.zeros(1, np.int32)
    return RewardInput(
        prompt="q", completion=completion, prompt_ids=zeros, completion_ids=zeros, metadata=metadata
    )


def _rate(fn, inputs: list, threads: int) -> float:
    start = time.perf_counter()
    if threads <= 1:
        for inp in inputs:
            fn(inp)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, inputs))
    return len(inputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=50, help="timed sandbox runs")
    parser.add_argument("--records", type=int, default=200, help="records scored per rate measurement")
    parser.add_argument("--threads", type=int, default=2, help="worker threads for the threaded rates")
    args = parser.parse_args()

    from maskroll.rewards.code import code_reward
    from maskroll.rewards.maths import math_reward
    from maskroll.rewards.sandbox import run

    print(f"machine: {common.cpu_model()}, {os.cpu_count()} CPUs, euid {os.geteuid()}")
    for _ in range(3):
        run('print("hi")')
    times = []
    for _ in range(args.runs):
        result = run('print("hi")')
        assert result.ok and result.stdout == "hi\n", result
        times.append(result.duration_s * 1000)
    s = common.spread(times)
    print(f"sandbox run('print(\"hi\")'), {args.runs} runs: ", end="")
    print(f"median {s['median']:.1f} ms, min {s['min']:.1f}, max {s['max']:.1f}")

    math_inputs = [_inp(c, answer=a) for i in range(args.records // 8) for c, a in math_cases(i + 2)]
    warm = [_inp(c, answer=a) for c, a in math_cases(10**6)]
    for inp in warm:  # imports sympy / math_verify, builds the LaTeX parser
        math_reward(inp)
    rate = _rate(math_reward, math_inputs, 1)
    print(f"math_reward, main thread: {rate:.0f} records/s ({len(math_inputs)} records)")
    with ThreadPoolExecutor(args.threads) as pool:  # start and warm the helper processes before the clock
        list(pool.map(math_reward, warm * args.threads))
        threaded_inputs = [
            _inp(c, answer=a) for i in range(args.records // 8) for c, a in math_cases(i + 10**4)
        ]
        start = time.perf_counter()
        list(pool.map(math_reward, threaded_inputs))
        rate = len(math_inputs) / (time.perf_counter() - start)
    print(f"math_reward, {args.threads} threads (helper processes): {rate:.0f} records/s")

    code_inputs = [_inp(CODE_COMPLETION, tests=CODE_TESTS)] * max(1, args.records // 4)
    assert code_reward(code_inputs[0]).reward == 1.0
    rate = _rate(code_reward, code_inputs, 1)
    print(f"code_reward (2 tests = 2 sandbox runs a record), sequential: {rate:.1f} records/s")
    rate = _rate(code_reward, code_inputs, args.threads)
    print(f"code_reward, {args.threads} threads: {rate:.1f} records/s ({len(code_inputs)} records)")


if __name__ == "__main__":
    main()
