"""What grpc.aio itself costs a server, with no maskroll code: CPU per call and per message.

A grpc.aio server with one server-streaming method that sends M pre-serialised messages of B bytes
(`asyncio.sleep(gap)` before each, as a replica's chunks come apart in time) answers R concurrent calls
from a client in a child process (plain grpc.aio, bytes in and out), N rounds. The server's CPU time
over the rounds, less that of the same sleeps without gRPC, divided by the calls, is the cost of a call
carrying M messages; two values of M separate the per-call part from the per-message part:

    per message = (cpu(M2) - cpu(M1)) / (M2 - M1)        per call = cpu(M1) - M1 · per message

This is the floor under `bench/server.py`'s "gRPC layer" figure: why a request per call and a message
per chunk cost what they did, and why GenerateStream puts a client's requests on one call and several
chunks in a message (issue 28).

    python bench/grpc_floor.py                 # R = 16, M = 1 and 8, B = 4000, 5 rounds, 3 reps
    python bench/grpc_floor.py --reps 5 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import common

SERVICE, METHOD = "floor.Floor", "Stream"


def identity(b: bytes) -> bytes:
    return b


async def serve(args: argparse.Namespace, messages: int) -> dict:
    """One measurement: server CPU per call (µs) for calls of `messages` messages, the sleeps excluded."""
    import grpc

    payload = os.urandom(args.bytes)

    async def stream(request, context):
        for _ in range(messages):
            await asyncio.sleep(args.gap_ms / 1e3)
            yield payload

    handler = grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=identity, response_serializer=identity
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:

        async def bare() -> None:
            for _ in range(messages):
                await asyncio.sleep(args.gap_ms / 1e3)

        cpu0 = time.process_time()
        for _ in range(args.rounds):
            await asyncio.gather(*[bare() for _ in range(args.calls)])
        sleeps = time.process_time() - cpu0
        cmd = [sys.executable, __file__, "--client", f"127.0.0.1:{port}", "--messages", str(messages), "0"]
        cmd += ["--calls", str(args.calls), "--rounds", str(args.rounds)]
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if (await asyncio.to_thread(child.stdout.readline)).strip() != "ready":
            raise RuntimeError("the floor client did not start")
        cpu0 = time.process_time()
        child.stdin.write("go\n")
        child.stdin.flush()
        if (await asyncio.to_thread(child.stdout.readline)).strip() != "done":
            raise RuntimeError("the floor client did not finish")
        cpu = time.process_time() - cpu0
        child.wait()
    finally:
        await server.stop(0)
    calls = args.rounds * args.calls
    return {"messages": messages, "us_per_call": 1e6 * (cpu - sleeps) / calls}


async def client(address: str, calls: int, rounds: int, messages: int) -> None:
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        method = channel.unary_stream(
            f"/{SERVICE}/{METHOD}", request_serializer=identity, response_deserializer=identity
        )

        async def one() -> int:
            return len([m async for m in method(b"")])

        await one()  # connected before the clock starts
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        for _ in range(rounds):
            got = await asyncio.gather(*[one() for _ in range(calls)])
            assert got == [messages] * calls, got
        print("done", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=16, help="concurrent calls R")
    p.add_argument("--messages", type=int, nargs=2, default=(1, 8), metavar=("M1", "M2"))
    p.add_argument("--bytes", type=int, default=4000, help="bytes per message B (~a 20-token chunk at K=20)")
    p.add_argument("--gap-ms", type=float, default=10.0, help="sleep before each message")
    p.add_argument("--rounds", type=int, default=5)
    common.add_reps(p, 3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--client", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        asyncio.run(client(args.client, args.calls, args.rounds, args.messages[0]))
        return 0

    load_start = common.load_1m()
    m1, m2 = args.messages
    per_message, per_call = [], []
    for _ in range(args.reps):
        a = asyncio.run(serve(args, m1))["us_per_call"]
        b = asyncio.run(serve(args, m2))["us_per_call"]
        per_message.append((b - a) / (m2 - m1))
        per_call.append(a - m1 * per_message[-1])
    out = {
        "calls": args.calls,
        "messages": [m1, m2],
        "bytes": args.bytes,
        "reps": args.reps,
        "server_us_per_message": {k: round(v, 1) for k, v in common.spread(per_message).items()},
        "server_us_per_call": {k: round(v, 1) for k, v in common.spread(per_call).items()},
        "load_average_1m": [load_start, common.load_1m()],
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"grpc.aio server CPU: per call {common.fmt_spread(out['server_us_per_call'])} µs, per message "
            f"{common.fmt_spread(out['server_us_per_message'])} µs ({args.calls} concurrent calls, "
            f"{args.bytes}-byte messages, {args.reps} reps; 1-min load {load_start} -> {common.load_1m()})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
