"""A pull-mode job is sampled with its own run's adapter, never another run's (server/pull/jobs.py): a job
of run R waits for R's adapter (a new run's version 0 may arrive after its first jobs) and is rejected if
it does not come — sampled with another run's adapter and labelled R, its records could pass R's
trainer's checks as R's own. The engine is tests/server's scripted FakeEngine behind a real AdapterTable."""

from __future__ import annotations

import asyncio

import lora_helpers as lh
import numpy as np
import pytest
import torch
from fake_engine import FakeEngine
from grpc_fixtures import server_config

from maskroll.proto.records import PromptJob, SamplingOptions
from maskroll.server.pull import jobs
from maskroll.server.pull.puller import JobRejected
from maskroll.server.weights.adapters import AdapterTable
from maskroll.server.weights.tensor_rules import Layout

FP = "wfp1:base"
BASE = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(12, 8)}


def _setup(tmp_path, lora_model_dir):
    engine = FakeEngine(max_lora_rank=8)
    table = AdapterTable(
        engine,
        base_fingerprint=FP,
        max_loras=4,
        versions_per_run=2,
        namespaces=("ns",),
        base_layouts=lambda: {k: Layout.of(v) for k, v in BASE.items()},
    )
    runner = jobs.JobRunner(engine, server_config(lora_model_dir, namespace="ns"), table, "ns")
    return table, runner


async def _push(table: AdapterTable, run: str, version: int) -> None:
    spec, tensors = lh.random_adapter(BASE, rank=4, alpha=8.0, target_modules=("q_proj",), seed=version,
                                      fingerprint=FP)  # fmt: skip
    await table.load(lh.adapter_manifest(spec, tensors, version, run, "ns"), dict(tensors))


def _job(run: str) -> PromptJob:
    return PromptJob(f"job-{run}", np.array([1, 2, 3], np.int32), SamplingOptions(max_tokens=3), run_id=run)


def test_a_job_waits_for_its_runs_adapter_and_names_it(tmp_path, lora_model_dir, monkeypatch) -> None:
    monkeypatch.setattr(jobs, "ADAPTER_WAIT_S", 10.0)

    async def main():
        table, runner = _setup(tmp_path, lora_model_dir)
        await _push(table, "old", 4)
        task = asyncio.create_task(runner(_job("new")))
        await asyncio.sleep(0.3)
        assert not task.done()  # the current adapter is run old's: the job of run new waits
        await _push(table, "new", 0)  # the new run's version 0
        records = await asyncio.wait_for(task, 10)
        assert {(r.run_id, r.adapter, r.policy_version_first) for r in records} == {("new", "ns/new/v0", 0)}

    asyncio.run(main())


def test_a_job_of_another_runs_adapter_is_rejected_after_the_wait(tmp_path, lora_model_dir, monkeypatch):
    monkeypatch.setattr(jobs, "ADAPTER_WAIT_S", 0.3)

    async def main():
        table, runner = _setup(tmp_path, lora_model_dir)
        await _push(table, "new", 2)
        with pytest.raises(
            JobRejected, match=r"job of run old: namespace 'ns' samples with run new's adapter"
        ):
            await runner(_job("old"))
        records = await runner(_job("new"))  # its own run's job runs at once
        assert {(r.run_id, r.adapter) for r in records} == {("new", "ns/new/v2")}

    asyncio.run(main())
