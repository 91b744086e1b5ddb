"""MaskConfig: validation (ValueError) and resolved defaults."""

from __future__ import annotations

import dataclasses

import pytest

from maskroll.trainer_adapter import MaskConfig


@pytest.mark.parametrize(
    "kwargs",
    [
        {"method": "clip"},
        {"method": "PPO"},
        {"divergence": "full_kl"},
        {"divergence": "tv"},
        {"estimator": "exact"},
        {"delta": 0.1, "delta_low": 0.2},
        {"delta": 0.1, "delta_high": 0.05},
        {"delta": -0.01},
        {"delta_low": -1e-9},
        {"delta_high": -0.5},
        {"delta": float("nan")},
        {"delta_high": float("inf")},
        {"eps_low": -0.1},
        {"eps_high": -0.1},
        {"eps_low": 1.0},
        {"chunk_tokens": 0},
        {"chunk_tokens": -3},
    ],
)
def test_invalid_configs_raise(kwargs) -> None:
    with pytest.raises(ValueError):
        MaskConfig(**kwargs)


def test_defaults() -> None:
    cfg = MaskConfig()
    assert (cfg.method, cfg.divergence, cfg.estimator) == ("predictive", "topk_kl", "proportional")
    assert (cfg.delta_low, cfg.delta_high) == (0.05, 0.05)
    assert (cfg.eps_low, cfg.eps_high) == (0.2, 0.28)
    assert cfg.replay_truncation is False
    assert cfg.chunk_tokens == 1024


@pytest.mark.parametrize(
    ("divergence", "default"),
    [("binary_tv", 0.15), ("topk_tv", 0.15), ("binary_kl", 0.05), ("topk_kl", 0.05)],
)
def test_default_delta_per_divergence(divergence: str, default: float) -> None:
    cfg = MaskConfig(divergence=divergence)
    assert (cfg.delta_low, cfg.delta_high) == (default, default)
    # one side given: the other keeps the default
    cfg = MaskConfig(divergence=divergence, delta_low=0.3)
    assert (cfg.delta_low, cfg.delta_high) == (0.3, default)


def test_delta_sets_both_sides() -> None:
    cfg = MaskConfig(delta=0.07)
    assert (cfg.delta_low, cfg.delta_high) == (0.07, 0.07)
    # the same value twice is not a conflict
    cfg = MaskConfig(delta=0.07, delta_low=0.07)
    assert (cfg.delta_low, cfg.delta_high) == (0.07, 0.07)
    assert MaskConfig(delta=0.0).delta_high == 0.0


def test_frozen() -> None:
    cfg = MaskConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.delta_low = 0.5  # type: ignore[misc]
