"""`maskroll healthcheck`: one grpc.health.v1 Check against a replica; exit 0 if SERVING, else 1.

This is what the container image's HEALTHCHECK and the Kubernetes exec probes run (kubelet's native gRPC
probes cannot speak TLS). It runs every few seconds in every replica, so it imports only grpc and the
health stubs and prints one line. Knows nothing of the server beyond the standard health protocol and
the `maskroll serve` environment variables it takes its defaults from (MASKROLL_HOST, MASKROLL_PORT,
MASKROLL_TLS_CERT): a bare `maskroll healthcheck` inside a replica's container checks that replica.

Readiness vs liveness: a draining replica answers NOT_SERVING while its in-flight rollouts finish.
That must take it out of load balancing (readiness: exit 1) but must not get it killed (liveness:
`--live` exits 0 for any answer, 1 only when nothing answers in time).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

DEFAULT_PORT = "50051"
_IPV4_ANY, _IPV6_ANY = {"", "0.0.0.0"}, {"::", "[::]"}


def default_address(env: Mapping[str, str] = os.environ) -> str:
    """Where the replica in this container listens: MASKROLL_HOST / MASKROLL_PORT as `maskroll serve`
    reads them, with a wildcard bind address replaced by loopback."""
    host = env.get("MASKROLL_HOST", "").strip()
    if host in _IPV4_ANY:
        host = "127.0.0.1"
    elif host in _IPV6_ANY:
        host = "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = env.get("MASKROLL_PORT", "").strip() or DEFAULT_PORT
    return f"{host}:{port}"


def default_tls_ca(env: Mapping[str, str] = os.environ) -> str | None:
    """MASKROLL_HEALTHCHECK_TLS_CA, else the server's own certificate (MASKROLL_TLS_CERT): right for a
    self-signed certificate; a CA-issued one needs the CA in MASKROLL_HEALTHCHECK_TLS_CA."""
    return env.get("MASKROLL_HEALTHCHECK_TLS_CA") or env.get("MASKROLL_TLS_CERT") or None


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="maskroll healthcheck",
        description="Check a replica through the standard gRPC health service. Exit 0 if it is SERVING "
        "(with --live: if it answers at all), 1 otherwise.",
    )
    p.add_argument(
        "--address",
        default=default_address(),
        help="host:port of the replica [default: 127.0.0.1:$MASKROLL_PORT, or :50051; now %(default)s]",
    )
    p.add_argument("--service", default="", help="service name to check [default: '' = the whole server]")
    p.add_argument(
        "--tls-ca",
        type=Path,
        default=default_tls_ca(),
        help="PEM roots to verify the server with; given = TLS "
        "[default: $MASKROLL_HEALTHCHECK_TLS_CA, else $MASKROLL_TLS_CERT, else plaintext]",
    )
    p.add_argument(
        "--tls-server-name",
        default=os.environ.get("MASKROLL_HEALTHCHECK_TLS_SERVER_NAME") or None,
        help="name the server certificate must carry, when it differs from the address's host "
        "[default: $MASKROLL_HEALTHCHECK_TLS_SERVER_NAME]",
    )
    p.add_argument("--plaintext", action="store_true", help="never use TLS, whatever the environment says")
    p.add_argument("--timeout", type=_positive, default=3.0, help="seconds to wait for the answer [3]")
    p.add_argument(
        "--live",
        action="store_true",
        help="liveness: exit 0 for any answer (NOT_SERVING while draining included)",
    )
    return p


def check(
    address: str,
    *,
    service: str = "",
    tls_ca: Path | None = None,
    tls_server_name: str | None = None,
    timeout: float = 3.0,
) -> tuple[bool, str]:
    """(answered, status): answered is False when no health response came back, and status is then the
    gRPC code name and details; otherwise the serving status name (SERVING, NOT_SERVING, ...)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options: list[tuple[str, object]] = []
    if tls_ca is not None:
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        creds = grpc.ssl_channel_credentials(root_certificates=tls_ca.read_bytes())
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    with channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:  # the boundary: every failure becomes "unhealthy" with its reason
            details = " ".join((exc.details() or "").split())  # one line, whatever grpc put in it
            return False, f"{exc.code().name}: {details}"
    return True, health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    tls_ca = None if args.plaintext else args.tls_ca
    if tls_ca is not None and not tls_ca.is_file():
        print(f"maskroll healthcheck: TLS roots {str(tls_ca)!r} is not a file", file=sys.stderr)
        return 1
    answered, status = check(
        args.address,
        service=args.service,
        tls_ca=tls_ca,
        tls_server_name=args.tls_server_name,
        timeout=args.timeout,
    )
    mode = "tls" if tls_ca is not None else "plaintext"
    line = f"maskroll healthcheck: {args.address} ({mode}) {status if answered else 'failed: ' + status}"
    healthy = answered and (args.live or status == "SERVING")
    print(line, file=sys.stdout if healthy else sys.stderr, flush=True)
    return 0 if healthy else 1
