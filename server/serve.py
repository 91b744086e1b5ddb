"""`maskroll serve`: parse and validate the configuration, then (and only then) import the server.

A bad flag or environment variable exits 2 with a message naming the field, in milliseconds: nothing
heavy (grpc, torch, vllm) is imported until the configuration is valid. Every log line of the process
goes through `RedactingFilter`: a Redis URL's password in a message or a traceback is replaced by ***.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from .config import ConfigError, load_config


class RedactingFilter(logging.Filter):
    """Redacts URL credentials from a record's message and traceback (formatted here, once), whichever
    library logged it: redis-py and grpc put URLs in their exception texts."""

    def filter(self, record: logging.LogRecord) -> bool:
        from maskroll.proto.redaction import redact

        record.msg, record.args = redact(record.getMessage()), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install_redaction() -> None:
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())


def _exit_during_startup(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"maskroll serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_redaction()
    # Until the server installs its drain handler, SIGTERM must still end the process: as PID 1 in a
    # container, a signal without a handler is ignored and the engine's start-up would run to the end.
    signal.signal(signal.SIGTERM, _exit_during_startup)
    from maskroll.proto.redaction import redact
    from maskroll.proto.redis_conn import QueueUnavailable

    from .app import BindError, serve

    try:
        return asyncio.run(serve(config))
    except (BindError, QueueUnavailable) as exc:  # a port taken, Redis out of reach: said, not a traceback
        print(f"maskroll serve: {redact(str(exc))}", file=sys.stderr)
        return 1
