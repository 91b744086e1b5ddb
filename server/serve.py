"""`maskroll serve`: parse and validate the configuration, then (and only then) import the server.

A bad flag or environment variable exits 2 with a message naming the field, in milliseconds: nothing
heavy (grpc, torch, vllm) is imported until the configuration is valid.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from .config import ConfigError, load_config


def _exit_during_startup(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"maskroll serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Until the server installs its drain handler, SIGTERM must still end the process: as PID 1 in a
    # container, a signal without a handler is ignored and the engine's start-up would run to the end.
    signal.signal(signal.SIGTERM, _exit_during_startup)
    from .app import BindError, serve

    try:
        return asyncio.run(serve(config))
    except BindError as exc:
        print(f"maskroll serve: {exc}", file=sys.stderr)
        return 1
