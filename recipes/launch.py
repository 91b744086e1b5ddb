"""N local trainer ranks of a recipe as one `torchrun` (`python -m torch.distributed.run`) subprocess:
what `maskroll demo --trainer-ranks N` and the tests start. Standard library only.

`torchrun_command` is the command line; `run_ranks` runs it to the end, its output to a log file, and
raises `RanksFailed` with the log's tail when it fails. torchrun gives each rank its RANK, WORLD_SIZE,
LOCAL_RANK and a rendezvous on a free loopback port (`--standalone`); with `max_restarts`, a rank that
dies makes torchrun stop the others and start all of them again (TORCHELASTIC_RESTART_COUNT counts
the restarts), which a recipe answers by resuming its run. Only the torchrun process started here is
ever signalled (by PID); it stops its own ranks. A rank's entry point ends with `exit_rank`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path


def exit_rank(code: int) -> None:
    """End a trainer rank's process now: flush its output, then `os._exit(code)`, skipping the
    interpreter's shutdown. Why: with DDP or FSDP2, torch 2.13 keeps the gloo process group (its worker
    and TCP-loop threads) alive past `destroy_process_group` — the wrapped modules' internals still
    reference it — so it would be torn down during interpreter finalisation, where a thread of it can
    abort the process ("terminate called without an active exception", SIGABRT after a finished run; seen
    once in CI). The rank's work is done by then: results are written (atomically) and acked."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be written
            stream.flush()
    os._exit(code)


class RanksFailed(RuntimeError):
    """The ranks' torchrun exited non-zero (the message holds the end of its log)."""


def torchrun_command(
    ranks: int, module: str, args: Sequence[str] = (), *, max_restarts: int = 0
) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node <ranks> -m <module> <args>`;
    `module` may also be a script's path (ending in .py), run as a file."""
    if not (isinstance(ranks, int) and ranks >= 1):
        raise ValueError(f"ranks={ranks!r}; expected an int >= 1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += ["--max-restarts", str(max_restarts)]
    cmd += [module] if module.endswith(".py") else ["-m", module]
    return [*cmd, *map(str, args)]


def run_ranks(
    ranks: int,
    module: str,
    args: Sequence[str] = (),
    *,
    log: Path,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    echo: bool = True,
) -> None:
    """Run `module` on `ranks` local processes to the end; their output goes to `log` (and, with echo,
    to this process's stdout as it comes). Raises RanksFailed with the log's tail on a non-zero exit;
    on KeyboardInterrupt or after `timeout` s torchrun is stopped (SIGTERM, then SIGKILL)."""
    # one thread per rank: the ranks share this machine's cores with the replicas; a rank that crashes
    # in native code (SIGSEGV, SIGABRT) prints its Python stacks into the log
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(ranks, module, args, max_restarts=max_restarts)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            start_new_session=True,
        )
        # the output is read to its end below: a timer stops torchrun when the time is up
        watchdog = threading.Timer(timeout, _stop, (proc,)) if timeout is not None else None
        if watchdog is not None:
            watchdog.daemon = True
            watchdog.start()
        try:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                if echo:  # rank 0 is the rank that prints (recipes/grpo.py)
                    print(line, end="", flush=True)
            code = proc.wait()
        except BaseException:
            _stop(proc)
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
    if code != 0:
        tail = log.read_text()[-4000:]
        if timeout is not None and code in (-signal.SIGTERM, -signal.SIGKILL):
            tail = f"(stopped after the {timeout:g} s timeout)\n{tail}"
        raise RanksFailed(f"{ranks} trainer ranks of {module} exited with {code}; log {log}:\n{tail}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its ranks and waits for them
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
