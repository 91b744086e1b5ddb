"""The client SDK: the synchronous facade against the real server, errors carrying status codes, and
the import boundary (the client never loads torch, vllm or transformers)."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_fixtures import server_loop, torch_engine, torch_server, wait_until  # noqa: F401

from maskroll.client import RecordAssembler, RolloutError, SamplingOptions, SyncRolloutClient

PROMPT = [256, 79, 107]


def test_sync_client_streams_records_info_and_health(torch_server):  # noqa: F811
    with SyncRolloutClient(torch_server.address) as c:
        chunks = list(c.generate(PROMPT, SamplingOptions(max_tokens=9, logprobs_k=3, n=2, seed=4)))
        records = c.generate_records(PROMPT, SamplingOptions(max_tokens=9, logprobs_k=3, n=2, seed=4))
        info, health = c.info(), c.health()
    assembler = RecordAssembler()
    streamed = {rec.sample_index: rec for ch in chunks if (rec := assembler.add(ch)) is not None}
    assert [r.sample_index for r in records] == [0, 1]
    for r in records:  # same seeds, same tokens: the two calls agree
        np.testing.assert_array_equal(r.completion_ids, streamed[r.sample_index].completion_ids)
        assert r.completion_ids.dtype == np.int32 and r.topk_logprobs.dtype == np.float32
    assert info.engine == "torch" and health == "SERVING"


def test_sync_client_break_cancels_the_call(torch_server, torch_engine):  # noqa: F811
    wait_until(lambda: torch_engine.num_active == 0, what="an idle engine")
    steps = torch_engine.decode_steps
    with SyncRolloutClient(torch_server.address) as c:
        stream = c.generate(PROMPT, SamplingOptions(max_tokens=900, ignore_eos=True))
        next(stream)
        stream.close()
        wait_until(lambda: torch_engine.num_active == 0, what="the engine to drop the cancelled row")
    assert torch_engine.decode_steps - steps < 300


def test_errors_carry_the_status_code(torch_server):  # noqa: F811
    with SyncRolloutClient(torch_server.address) as c:
        with pytest.raises(RolloutError) as err:
            c.generate_record(PROMPT, SamplingOptions(max_tokens=2, logprobs_k=50))
        with pytest.raises(RolloutError) as n_err:
            c.generate_record(PROMPT, SamplingOptions(max_tokens=2, n=2))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "options.logprobs_k" in err.value.message
    assert str(err.value).startswith("INVALID_ARGUMENT: ")
    assert n_err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "generate_records" in n_err.value.message


def test_unreachable_server_is_unavailable():
    with SyncRolloutClient("127.0.0.1:1", timeout=2) as c, pytest.raises(RolloutError) as err:
        c.info()
    assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_client_imports_no_torch_vllm_or_transformers():
    code = (
        "import sys, json\n"
        "import maskroll.client as c\n"
        "c.RolloutClient, c.SyncRolloutClient, c.RolloutError, c.ServerInfo\n"
        "import maskroll.client.rollout_client, maskroll.proto.wire\n"
        "print(json.dumps([m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == []


def test_records_without_grpc_loaded():
    code = (
        "import sys\n"
        "from maskroll.client import RolloutRecord, SamplingOptions\n"
        "print('grpc' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "name",
    ["__init__", "generate", "generate_records", "generate_record", "update_weights", "info", "health"],
)
def test_sync_client_has_the_async_signature_and_a_docstring(name):
    import inspect

    from maskroll.client import RolloutClient, SyncRolloutClient

    sync, async_ = getattr(SyncRolloutClient, name), getattr(RolloutClient, name)
    assert inspect.signature(sync).parameters == inspect.signature(async_).parameters, name
    assert sync.__doc__ and async_.__doc__
