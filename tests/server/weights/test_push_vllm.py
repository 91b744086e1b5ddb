"""PushWeights on the vLLM CPU engine (the session's shared one): pushed weights generate exactly what
the same weights loaded from a directory generate; the engine receives into its spool (its workers read
files) and keeps the file of the weights it serves. The engine's weights are restored afterwards."""

from __future__ import annotations

import numpy as np
import pytest
from grpc_fixtures import replica, server_config
from push_helpers import call, info, messages, push, state_dict
from vllm_fixtures import server_loop, vllm_engine, vllm_env  # noqa: F401  (fixtures)

from maskroll.client import SamplingOptions

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [256, 84, 104, 101]
OPTS = SamplingOptions(max_tokens=12, logprobs_k=5, seed=7, ignore_eos=True)


def test_a_push_to_vllm_generates_exactly_what_the_directory_load_generates(
    server_loop,  # noqa: F811
    vllm_engine,  # noqa: F811
    model_dir,
    weights_root,
    spool,
):
    cfg = server_config(model_dir, engine="vllm", weights_root=weights_root)
    with replica(server_loop, cfg, vllm_engine) as r:
        addr = r.address
        v = info(addr).policy_version + 1
        try:
            call(addr, lambda c: c.update_weights(v, str(weights_root / "v1")))
            from_dir = call(addr, lambda c: c.generate_record(PROMPT, OPTS))
            assert (
                push(addr, messages(state_dict(weights_root / "v2"), v + 1, chunk_bytes=1 << 16)).version
                == v + 1
            )
            other = call(addr, lambda c: c.generate_record(PROMPT, OPTS))
            assert other.completion_ids.tolist() != from_dir.completion_ids.tolist()
            assert (
                push(addr, messages(state_dict(weights_root / "v1"), v + 2, chunk_bytes=1 << 16)).version
                == v + 2
            )
            pushed = call(addr, lambda c: c.generate_record(PROMPT, OPTS))
            assert pushed.policy_version_first == v + 2
            assert pushed.completion_ids.tolist() == from_dir.completion_ids.tolist()
            np.testing.assert_allclose(pushed.sampled_logprobs, from_dir.sampled_logprobs, rtol=0, atol=1e-6)
            # vLLM restores the served weights from their file after a failed update: the push it
            # serves stays in the spool (only that one), until another update succeeds
            assert [d.name.split("-")[1] for d in spool.iterdir()] == [f"v{v + 2}"]
            bad = messages(state_dict(weights_root / "v2"), v + 3)
            bad[3].data.data = bytes(len(bad[3].data.data))  # zeroed chunk: checksum mismatch
            err = push(addr, bad)
            assert "CRC-32" in err.message and info(addr).policy_version == v + 2
            assert [d.name.split("-")[1] for d in spool.iterdir()] == [f"v{v + 2}"]  # the refused one went
        finally:  # the shared engine goes back to the model's own weights
            push(addr, messages(state_dict(model_dir), info(addr).policy_version + 1, chunk_bytes=1 << 16))
