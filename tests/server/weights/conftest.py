"""Fixtures of the replica's end of the weight transports (PushWeights, the stream's receiving side,
joining a run): `weights_fixtures` (a module, shared with tests/weight_sync, the trainer's end) holds
them. tests/server holds grpc_fixtures (in-process servers) and vllm_fixtures (the session's vLLM
engine); this folder holds push_helpers (raw PushWeights calls)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):  # tests/server, then this folder first
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from weights_fixtures import (  # noqa: E402, F401  (fixtures)
    loop,
    model_dir,
    spool,
    tiny_model_dir,
    torch_replica,
    weights_root,
)
