"""`maskroll analyze`: the direction analysis computes its numbers, reproducibly, and they make sense.

The thresholds are the mathematical facts of docs/math.md §4, not typed-in results: P̂ with the
proportional estimator is the exact first-order change of the bucketed D, so for an infinitesimal step
it must agree with the realised ΔD(topk_kl) on every token that moves; the exact full-vocabulary P
likewise with ΔD(full KL); and the ratio rule, blind to the rest of the distribution, must be wrong
on the set where it disagrees with the predictive rule.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from maskroll.trainer_adapter.analyze import AnalyzeConfig, format_report, run

SMALL = AnalyzeConfig(states=768, vocab=4096, k=20, chunk=256, seed=3)


@pytest.fixture(scope="module")
def small() -> dict:
    return run(SMALL)


def test_predictive_rules_match_realised_change(small: dict) -> None:
    topk, full = small["scores"]["topk"], small["scores"]["full"]
    assert topk["proportional"]["agree_all"] >= 0.999
    assert full["exact"]["agree_all"] >= 0.999
    # aggregated over-weights the tail: it may miss a few tokens but is still far better than chance
    assert topk["aggregated"]["agree_all"] >= 0.98


def test_ratio_rule_is_wrong_where_it_disagrees(small: dict) -> None:
    sets = small["states"]
    assert 0.0 < sets["disagreement_frac_far"] < 0.3
    ratio = small["scores"]["topk"]["ratio"]
    assert ratio["agree_disagreement"] <= 0.05
    assert small["scores"]["topk"]["proportional"]["agree_disagreement"] >= 0.95
    assert ratio["agree_all"] < small["scores"]["topk"]["proportional"]["agree_all"]
    # the ratio rule keeps far tokens whose step increases D; the predictive rule (almost) never does
    assert ratio["unsafe_keep"] > small["scores"]["topk"]["proportional"]["unsafe_keep"]


def test_states_are_llm_like(small: dict) -> None:
    st = small["states"]
    assert 0.9 < st["top_k_mass_mean"] < 0.999
    assert 0.05 < st["far_frac"] < 0.8
    assert st["mean_topk_kl"] <= st["mean_full_kl"] + 1e-12  # bucketed KL is a lower bound


def test_seeded_and_reproducible(small: dict) -> None:
    again = run(SMALL)
    assert again["scores"] == small["scores"]
    other = run(AnalyzeConfig(**{**SMALL.__dict__, "seed": 4}))
    assert other["scores"] != small["scores"]


def test_report_lists_every_rule(small: dict) -> None:
    text = format_report(small)
    for name in ("ratio rule", "exact full P", "aggregated", "uniform", "proportional", "unsafe", "wrong"):
        assert name in text


def test_cli_json() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "maskroll.app.cli",
            "analyze",
            "--states",
            "256",
            "--vocab",
            "2048",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.stdout)
    assert data["config"]["states"] == 256 and data["config"]["vocab"] == 2048
    assert set(data["scores"]["topk"]) == {"ratio", "exact", "aggregated", "uniform", "proportional"}


def test_cli_rejects_bad_arguments_and_unknown_commands() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "maskroll.app.cli", "analyze", "--k", "0"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "k >= 1" in bad.stderr
    unknown = subprocess.run(
        [sys.executable, "-m", "maskroll.app.cli", "nope"], capture_output=True, text=True
    )
    assert unknown.returncode == 2 and "unknown command" in unknown.stderr
