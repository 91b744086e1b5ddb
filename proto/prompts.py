"""The prompt rule, in one place: what a prompt must be before any engine sees it.

The SDK checks it when a job is submitted (no vocabulary known there: shape and type only), the
replica's validation before any engine call (InvalidArgument), and each engine's own guard (ValueError)
— all with these words. Pure numpy; knows nothing of transports.
"""

from __future__ import annotations

import numpy as np


def prompt_problem(
    prompt: np.ndarray,  # integer [P]
    *,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    name: str = "prompt_token_ids",
) -> str | None:
    """The first thing wrong with `prompt`, as a sentence naming `name`; None if it is a valid prompt.
    Without `vocab_size` / `max_model_len` those limits are not checked (the SDK does not know them)."""
    if prompt.size == 0:
        return f"{name} is empty; a prompt needs at least one token"
    if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
        return f"{name} must be a 1-D array of token ids, got {prompt.dtype} {prompt.shape}"
    if vocab_size is not None:
        bad = np.flatnonzero((prompt < 0) | (prompt >= vocab_size))
        if bad.size:
            i = int(bad[0])
            return (
                f"{name}[{i}] = {int(prompt[i])} is outside the vocabulary [0, {vocab_size})"
                f" ({bad.size} such ids)"
            )
    elif (prompt < 0).any():
        i = int(np.flatnonzero(prompt < 0)[0])
        return f"{name}[{i}] = {int(prompt[i])} is not a token id (negative)"
    if max_model_len is not None and prompt.size >= max_model_len:
        return (
            f"{name} has {prompt.size} tokens; the model's context (max_model_len "
            f"{max_model_len}) leaves no room for a completion"
        )
    return None
