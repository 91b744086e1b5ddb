"""The `maskroll` command: one entry point, subcommands imported only when chosen.

This is the one module that spans components (it dispatches to the trainer adapter's analysis as well
as to the server), so it imports nothing heavy at module level: `maskroll --help` stays instant and a
trainer-only install can still run `maskroll analyze`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

# subcommand -> (help line, "module:function" taking argv and returning an exit code)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "analyze": (
        "direction analysis of the trust-region masks on synthetic LLM-like states",
        "maskroll.trainer_adapter.analyze:main",
    ),
    "dead-letters": (
        "list a namespace's dead letters (id, reason, age); --drop deletes those listed",
        "maskroll.app.status:dead_letters_main",
    ),
    "demo": (
        "asynchronous RL end to end: Redis, two replicas, a trainer with predictive masks (a few minutes)",
        "maskroll.app.demo:main",
    ),
    "export-model": (
        "a run's saved version as a Hugging Face model (--merge: LoRA adapter merged) or a PEFT adapter",
        "maskroll.app.export:main",
    ),
    "healthcheck": (
        "ask a replica's gRPC health service; exit 0 if SERVING (container and Kubernetes probes)",
        "maskroll.server.healthcheck:main",
    ),
    "init-model": (
        "write a seeded tiny Llama model with a byte-level tokenizer, or SmolLM2-135M (--from smollm2)",
        "maskroll.app.model_init:main",
    ),
    "redis": (
        "a Redis on 127.0.0.1 for trying maskroll on one machine (prints its URL; Ctrl-C stops it)",
        "maskroll.local.redis_server:main",
    ),
    "reward": (
        "the reward stage: score a namespace's finished records with MODULE:FUNCTION, publish them scored",
        "maskroll.app.reward:main",
    ),
    "teacher": (
        "the teacher stage: score a namespace's finished records on teacher replicas, attach their top-K",
        "maskroll.app.teacher:main",
    ),
    "serve": (
        "serve rollouts over gRPC and HTTP/OpenAI (vLLM or the torch reference engine)",
        "maskroll.server.serve:main",
    ),
    "status": (
        "a namespace at a glance: run, live replicas, backlog per partition, dead letters by reason",
        "maskroll.app.status:main",
    ),
}


def _load(target: str) -> Callable[[list[str]], int]:
    module, _, func = target.partition(":")
    mod = __import__(module, fromlist=[func])
    return getattr(mod, func)


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (help_, _) in SUBCOMMANDS.items())
    return (
        f"usage: maskroll <command> [options]\n\ncommands:\n{rows}\n\n"
        "`maskroll <command> --help` for options."
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"maskroll: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return int(_load(SUBCOMMANDS[name][1])(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
