"""The torch engine's batch: the sequences decoded together and their KV cache, left-padded to one length.

Row i of every layer's keys and values belongs to `rows[i]`; `mask` [B, S] marks each row's real
positions (0 = left padding). With that mask and position ids that count only a row's real tokens, one
batched forward gives each row the logits it would get alone (to float rounding). A request is prefilled
alone (no padding, so no fully-masked query rows) and merged in by `add`, left-padding whichever side is
shorter; `remove` takes finished or cancelled rows out and trims the padding columns no remaining row
needs. Tensor bookkeeping only, owned by the decode thread: what a row is, and what its tokens are, is
the engine's. Written against the transformers 5 cache API (`DynamicCache.layers[i].keys`); see `_kv`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _kv(cache) -> list[tuple[Tensor, Tensor]]:  # per layer ([B, H, S, D], [B, H, S, D])
    # transformers 5 keeps one DynamicLayer per decoder layer; 4.x had key_cache / value_cache lists.
    return [(layer.keys, layer.values) for layer in cache.layers]


class Batch:
    """The rows decoded by one forward and their KV cache (a DynamicCache, None when empty)."""

    def __init__(self, device: torch.device) -> None:
        self.rows: list[Any] = []  # batch order = KV cache row order
        self.cache = None  # DynamicCache over the rows, or None when empty
        self.mask: Tensor | None = None  # [B, S] long, 0 = left padding
        self._device = device

    def __len__(self) -> int:
        return len(self.rows)

    def clear(self) -> list[Any]:
        """Empty the batch; returns the rows it held."""
        rows, self.rows, self.cache, self.mask = self.rows, [], None, None
        return rows

    def add(self, row: Any, cache, length: int) -> None:
        """Merge `row`, prefilled alone into `cache` (its `length` positions, [1, H, length, D] per layer)."""
        from transformers import DynamicCache

        if self.cache is None:
            self.cache = cache
            self.mask = torch.ones(1, length, dtype=torch.long, device=self._device)
            self.rows = [row]
            return
        old_len = self.mask.shape[1]
        width = max(old_len, length)
        merged = [
            (
                torch.cat([F.pad(k0, (0, 0, width - old_len, 0)), F.pad(k1, (0, 0, width - length, 0))]),
                torch.cat([F.pad(v0, (0, 0, width - old_len, 0)), F.pad(v1, (0, 0, width - length, 0))]),
            )
            for (k0, v0), (k1, v1) in zip(_kv(self.cache), _kv(cache), strict=True)
        ]
        row_mask = torch.ones(1, length, dtype=torch.long, device=self._device)
        mask = torch.cat([F.pad(self.mask, (width - old_len, 0)), F.pad(row_mask, (width - length, 0))])
        # Assigned last: a merge that fails leaves the batch as it was (only the new row fails).
        self.cache, self.mask = DynamicCache(merged), mask
        self.rows.append(row)

    def step_mask(self) -> Tensor:  # [B, S + 1]
        """The mask of the next decode step, whose input adds one real position to every row; it becomes
        `mask` once that forward has run."""
        return torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)

    def remove(self, rows: set[Any]) -> None:
        """Take `rows` out of the batch (those not in it are ignored) and trim the left-padding columns
        that every remaining row has."""
        from transformers import DynamicCache

        keep = [i for i, r in enumerate(self.rows) if r not in rows]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.mask = None, None
            return
        index = torch.tensor(keep, device=self._device)
        mask = self.mask.index_select(0, index)  # [B', S]
        lead = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())  # padding columns common to every row
        self.mask = mask[:, lead:]
        self.cache = DynamicCache(
            [
                (k.index_select(0, index)[:, :, lead:], v.index_select(0, index)[:, :, lead:])
                for k, v in _kv(self.cache)
            ]
        )
