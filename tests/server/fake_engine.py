"""A scripted Engine for fast servicer tests (STYLE.md §13: never the only test of a path).

Its tokens and logprobs are a pure function of (seed, token index), so a test can predict every byte
the server must stream. It records what the servicer asked for and which requests were aborted.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from maskroll.server.engines.contract import (
    AdapterRef,
    Engine,
    EngineLimits,
    EngineOutput,
    EngineRequest,
    LoraWeights,
)


def scripted_token(seed: int, j: int, vocab: int) -> int:
    return (seed * 7 + j * 3 + 1) % vocab


def scripted_output(request: EngineRequest, j: int, version: int, vocab: int) -> EngineOutput:
    """Token j of a request: rank 1 + j % 3, top-K ids counting up from the token, logprobs that are
    not round numbers (so a float32 transport error would show)."""
    seed = request.params.seed or 0
    k = request.params.logprobs_k
    token = scripted_token(seed, j, vocab)
    lp = np.float32(-(j + 1) / 7.0)
    return EngineOutput(
        token_ids=np.array([token], np.int32),
        sampled_logprobs=np.array([lp], np.float32),
        sampled_ranks=np.array([1 + j % 3], np.int32),
        topk_ids=((token + np.arange(k, dtype=np.int32)) % vocab)[None],  # [1, K]
        topk_logprobs=(lp - np.arange(k, dtype=np.float32) / 3.0)[None],  # [1, K], descending
        policy_version=version,
    )


class FakeEngine(Engine):
    name = "fake"
    version = "0.0"
    model_id = "fake-model"

    def __init__(
        self,
        *,
        vocab_size: int = 50,
        max_model_len: int = 256,
        max_logprobs: int = 20,
        token_delay_s: float = 0.0,
        max_lora_rank: int = 0,
    ) -> None:
        self._limits = EngineLimits(
            vocab_size=vocab_size, max_model_len=max_model_len, max_logprobs=max_logprobs
        )
        self.token_delay_s = token_delay_s
        self._version = 0
        self.started = self.closed = False
        self.requests: list[EngineRequest] = []
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.fail_at: int | None = None  # raise RuntimeError before token `fail_at`
        self.refuse: str | None = None  # raise ValueError(refuse) before the first token
        self.end_without_finish = False  # end the stream after max_tokens with no finish_reason
        self.update_delay_s = 0.0  # how long update_weights takes
        # LoRA: resident adapters by id; the table's calls in order ("add <name>", "remove <name>")
        self._max_lora_rank = max_lora_rank
        self.adapters: dict[int, tuple[AdapterRef, LoraWeights]] = {}
        self.adapter_calls: list[str] = []
        self.refuse_adapter: str | None = None  # raise ValueError(refuse_adapter) from add_adapter

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_lora_rank(self) -> int:
        return self._max_lora_rank

    async def add_adapter(self, ref: AdapterRef, weights: LoraWeights) -> None:
        if self._max_lora_rank <= 0:
            raise NotImplementedError("the fake engine was made without max_lora_rank")
        if self.refuse_adapter is not None:
            raise ValueError(self.refuse_adapter)
        if ref.id in self.adapters:
            raise RuntimeError(f"adapter id {ref.id} is resident already")
        self.adapters[ref.id] = (ref, weights)
        self.adapter_calls.append(f"add {ref.name}")

    async def remove_adapter(self, ref: AdapterRef) -> None:
        del self.adapters[ref.id]  # KeyError: the table removed an adapter it never added
        self.adapter_calls.append(f"remove {ref.name}")

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def generate(self, request: EngineRequest):
        if self.refuse is not None:
            raise ValueError(self.refuse)
        if request.adapter is not None and request.adapter.id not in self.adapters:
            raise RuntimeError(f"adapter {request.adapter.name} (id {request.adapter.id}) is not resident")
        self.requests.append(request)
        self.active.add(request.request_id)
        finished = False
        try:
            p = request.params
            for j in range(p.max_tokens):
                await asyncio.sleep(self.token_delay_s)
                if self.fail_at is not None and j == self.fail_at:
                    raise RuntimeError("scripted engine failure")
                # an adapter request is sampled by its adapter's version from first token to last
                version = self._version if request.adapter is None else request.adapter.version
                out = scripted_output(request, j, version, self._limits.vocab_size)
                if int(out.token_ids[0]) in p.stop_token_ids:
                    out.finish_reason = "stop"
                elif j == p.max_tokens - 1 and not self.end_without_finish:
                    out.finish_reason = "length"
                yield out
                if out.finish_reason:
                    break
            finished = True
        finally:
            self.active.discard(request.request_id)
            if not finished:
                self.aborted.append(request.request_id)

    async def update_weights(self, version: int, checkpoint_dir: Path) -> int:
        await asyncio.sleep(self.update_delay_s)
        if (Path(checkpoint_dir) / "corrupt").exists():
            raise ValueError(f"scripted bad checkpoint {checkpoint_dir}")
        self._version = version
        return len(self.active)
