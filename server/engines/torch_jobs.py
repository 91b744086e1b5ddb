"""What the torch engine's two sides hand each other: a request's `Handle` (its tokens' queue on the asyncio
side, its row's state on the decode thread), a `ScoreJob` and a weight or adapter `Update`, each answered
through a future. The lock, the queues of these and the rules of who touches what are the engine's
(torch_engine.py); this is their vocabulary only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .contract import EngineRequest, SamplingParams, ScoreRequest

Tensor = torch.Tensor


class EngineClosed(RuntimeError):
    """The engine was closed while the request was in flight."""


@dataclass(eq=False)  # identity semantics: handles live in sets
class Handle:
    """One request's state, shared by the asyncio side (queue) and the decode thread (everything else)."""

    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    generator: torch.Generator
    cached: int = 0  # this row's real tokens in the KV cache
    next_token: int = -1  # sampled, not yet in the cache: the next decode step's input
    generated: int = 0
    done: bool = False  # counted out of num_active; set under the engine's lock

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def version(self, engine_version: int) -> int:  # with an adapter: its version, whatever updates come
        return engine_version if self.request.adapter is None else self.request.adapter.version


@dataclass(eq=False)  # identity semantics: jobs live in sets
class ScoreJob:
    """One Score request: every completion scored on the decode thread in one go (one policy version)."""

    request: ScoreRequest
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class Update:
    version: int
    tensors: dict[str, Tensor]
    # instead: an adapter added or removed (version -1), or a delta written in place, between two steps
    call: Callable[[], None] | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
