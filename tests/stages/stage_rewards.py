"""Small reward functions for the stage's tests (not the shipped verifiers): a cheap rule, and the ways a
reward function goes wrong — raises, hangs (sync and async), returns NaN or garbage."""

from __future__ import annotations

import asyncio
import os
import time

from maskroll.rewards.types import RewardInput, RewardResult


def count_a(inp: RewardInput) -> RewardResult:
    """The fraction of 'a' in the completion text; with the record's metadata in the reason."""
    text = inp.completion
    return RewardResult(text.count("a") / max(1, len(text)), "count_a", f"{len(text)} chars {inp.metadata}")


def length(inp: RewardInput) -> float:
    return float(len(inp.completion_ids))


async def async_length(inp: RewardInput) -> float:
    await asyncio.sleep(0)
    return float(len(inp.completion_ids))


def by_metadata(inp: RewardInput):
    """What the record's metadata "mode" says: a number, or one of the failures."""
    mode = inp.metadata.get("mode", "ok")
    if mode == "raise":
        raise RuntimeError("the verifier broke")
    if mode == "hang":
        time.sleep(float(os.environ.get("STAGE_HANG_S", "3")))
        return 1.0
    if mode == "nan":
        return float("nan")
    if mode == "garbage":
        return "yes"
    if mode == "none":
        return None
    if mode == "bool":
        return True
    return float(len(inp.completion_ids))


async def async_hang(inp: RewardInput) -> float:
    if inp.metadata.get("mode") == "hang":
        await asyncio.sleep(3600)
    return 2.0


def slow(inp: RewardInput) -> float:
    """Takes a while, so a worker can be killed while records are being scored."""
    time.sleep(float(os.environ.get("STAGE_SLOW_S", "0.2")))
    return float(len(inp.completion_ids))
