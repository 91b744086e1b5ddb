"""The GRPO recipe under torchrun: one JSON file says what to train, every rank reads it.

    torchrun --nproc-per-node 8 --max-restarts 3 -m maskroll.recipes.grpo_launch --config run.json

`write_config` writes the file (GRPOConfig with its MaskConfig, `grpo.train`'s arguments, the task by
name, where rank 0 writes its summary); `main` is what each rank runs: `grpo.train` with those
arguments, resuming the run (`run="resume"`) when torchrun has restarted the ranks
(TORCHELASTIC_RESTART_COUNT > 0) after one of them died. `train_ranks` starts N local ranks
(launch.run_ranks) and returns rank 0's summary: `grpo.train`'s signature plus `ranks`, for the demo.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from maskroll.trainer_adapter.config import MaskConfig

from .config import GRPOConfig, LoraConfig
from .launch import exit_rank, run_ranks

TASKS = ("digits", "arithmetic")  # train(task=...) by name: a task object does not cross processes
PATHS = ("model_dir", "weights_root", "final_dir")  # train() arguments that are paths


def write_config(path: Path, cfg: GRPOConfig, *, result: Path, task: str = "digits", **train: Any) -> Path:
    """The run file: `cfg`, `grpo.train`'s keyword arguments (`train`: redis_url, namespace, model_dir,
    weights_root, …; JSON values and paths), the task by name, and `result` (rank 0's summary)."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}; expected one of {TASKS}")
    train = {k: str(v) if isinstance(v, Path) else v for k, v in train.items()}
    body = {"grpo": asdict(cfg), "train": train, "task": task, "result": str(result)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2))
    return path


def read_config(path: Path) -> tuple[GRPOConfig, dict, str, Path]:
    body = json.loads(Path(path).read_text())
    grpo = dict(body["grpo"])
    cfg = GRPOConfig(
        **{**grpo, "mask": MaskConfig(**grpo["mask"]), "lora": LoraConfig(**grpo.get("lora", {}))}
    )
    train = {k: Path(v) if k in PATHS and v is not None else v for k, v in body["train"].items()}
    return cfg, train, body["task"], Path(body["result"])


def main(argv: list[str] | None = None, *, step_hook: Callable[..., None] | None = None) -> int:
    """One rank: train as the config file says; rank 0 writes the summary to its `result` path. step_hook:
    grpo.train's (a test's fault injection runs this main from its own script)."""
    p = argparse.ArgumentParser(prog="maskroll.recipes.grpo_launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True, help="the run file (write_config)")
    a = p.parse_args(argv)
    cfg, train, task_name, result = read_config(a.config)
    from . import grpo

    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts > 0:  # torchrun restarted the ranks after one died: continue the same run
        train["run"] = "resume"
        if os.environ.get("RANK", "0") == "0":
            print(f"  restart {restarts}: resuming the run", flush=True)
    task = None
    if task_name == "arithmetic":
        from . import arithmetic

        task = arithmetic.QueueTask(train["model_dir"])
    # steps_total: the run is cfg.steps versions long, however many restarts it took
    summary = grpo.train(cfg, task=task, step_hook=step_hook, steps_total=True, **train)
    if summary is not None:  # rank 0
        summary["restarts"] = restarts
        tmp = result.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, result)
    return 0


def train_ranks(
    cfg: GRPOConfig,
    *,
    ranks: int,
    log: Path,
    task: str = "digits",
    max_restarts: int = 0,
    target: str = __name__,
    env: dict[str, str] | None = None,
    **train: Any,
) -> dict:
    """`grpo.train(cfg, **train)` on `ranks` local processes (torchrun, gloo on CPU); rank 0's summary.
    The run file and the summary go beside `log`. max_restarts: torchrun's elastic restarts (each
    resumes the run). target: what each rank runs, this module or a script calling `main` (a test's
    step hook); env: added to the ranks' environment."""
    result = log.with_name("trainer-summary.json")
    result.unlink(missing_ok=True)
    config = write_config(log.with_name("trainer-run.json"), cfg, result=result, task=task, **train)
    run_ranks(ranks, target, ["--config", config], log=log, max_restarts=max_restarts, env=env)
    return json.loads(result.read_text())


if __name__ == "__main__":
    exit_rank(main())  # launch.exit_rank says why a rank does not return through the interpreter's exit
