"""The session proxy as deployed (issue 27): compose.sessions.yaml (+ compose.sessions-tls.yaml) and the
Kubernetes component deploy/k8s/components/sessions, checked offline. Each runs deploy/proxy/Caddyfile
with its own environment; here the real `caddy adapt` (the `proxy` extra's binary, the one tests/http
runs) turns that environment into Caddy's JSON, and the test asserts what the routing relies on: sticky
by X-Maskroll-Session with least-connections as fallback, /readyz health checks, upstreams that are the
replicas' HTTP ports, TLS verified by a name the replicas' certificate covers. The component's resources
are validated with the others (deploy_files.COMPOSED, "gpu+sessions")."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
from deploy_files import (
    COMPOSE,
    COMPOSE_SESSIONS,
    COMPOSE_SESSIONS_TLS,
    COMPOSE_TLS,
    ENV_EXAMPLE,
    PROXY,
    compose_variables,
    find,
    load_compose,
    load_env_file,
    merge_compose,
    one,
    pod_spec,
    rendered,
)

from maskroll.local.proxy import find_caddy

SESSION_HEADER = "X-Maskroll-Session"
SNIPPETS = ("Caddyfile", "empty.caddy", "site-tls.caddy", "upstream-k8s.caddy")


def adapt(env: dict[str, str]) -> tuple[dict, dict]:
    """Caddy's JSON for deploy/proxy/Caddyfile under `env` (paths under /etc/caddy read from deploy/proxy):
    the one server and its reverse_proxy handler."""
    local = {k: str(PROXY / Path(v).name) if v.startswith("/etc/caddy/") else v for k, v in env.items()}
    # Only what the container sets: none of this machine's MASKROLL_* may leak into the file.
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MASKROLL_")}
    out = subprocess.run(
        [find_caddy(), "adapt", "--config", str(PROXY / "Caddyfile"), "--adapter", "caddyfile"],
        env={**clean, **local},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (server,) = json.loads(out.stdout)["apps"]["http"]["servers"].values()
    (route,) = server["routes"]
    (handler,) = route["handle"]
    assert handler["handler"] == "reverse_proxy"
    return server, handler


def assert_session_routing(handler: dict) -> None:
    lb = handler["load_balancing"]
    assert lb["selection_policy"] == {
        "policy": "header",
        "field": SESSION_HEADER,
        "fallback": {"policy": "least_conn"},
    }
    assert lb["retries"] >= 1  # a refused connection (a dead replica) goes to the next replica
    active, passive = handler["health_checks"]["active"], handler["health_checks"]["passive"]
    assert active["uri"] == "/readyz" and active["fails"] == 1
    assert passive["max_fails"] == 1 and passive["fail_duration"] > 0
    assert handler["flush_interval"] == -1  # SSE streams are not buffered


# ---- compose -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return load_env_file(ENV_EXAMPLE)


def merged(env: dict[str, str], *paths: Path) -> dict:
    doc = load_compose(COMPOSE, env)
    for p in paths:
        doc = merge_compose(doc, load_compose(p, env))
    return doc


def test_every_variable_is_documented_in_env_example(env):
    documented = set(env) | set(re.findall(r"^#\s*([A-Z_][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), re.M))
    used = set().union(*(compose_variables(p.read_text()) for p in (COMPOSE_SESSIONS, COMPOSE_SESSIONS_TLS)))
    assert used - documented == set() and "MASKROLL_PROXY_PORT" in used


def proxy_env(svc: dict) -> dict[str, str]:
    mounts = dict(v.split(":")[:2][::-1] for v in svc["volumes"])
    assert (COMPOSE_SESSIONS.parent / mounts["/etc/caddy"]).resolve() == PROXY
    return {k: str(v) for k, v in svc["environment"].items()}


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_compose_puts_the_replicas_http_behind_the_proxy(env, tls):
    import importlib.resources

    files = [COMPOSE_TLS, COMPOSE_SESSIONS, COMPOSE_SESSIONS_TLS] if tls else [COMPOSE_SESSIONS]
    doc = merged(env, *files)
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendor.joinpath("compose-spec.json").read_text())
    errors = jsonschema.validators.validator_for(schema)(schema).iter_errors(doc)
    assert [e.message for e in errors] == []
    replicas = {n: s for n, s in doc["services"].items() if "MASKROLL_HTTP_PORT" in s.get("environment", {})}
    assert sorted(replicas) == ["replica-1", "replica-2"]
    proxy = doc["services"]["session-proxy"]
    assert set(proxy["depends_on"]) == set(replicas)
    assert all(p.startswith("127.0.0.1:") for p in proxy["ports"])
    assert proxy["deploy"]["resources"]["limits"]["memory"]
    server, handler = adapt(proxy_env(proxy))
    dials = [u["dial"] for u in handler["upstreams"]]
    assert dials == [f"{n}:{s['environment']['MASKROLL_HTTP_PORT']}" for n, s in replicas.items()]
    assert_session_routing(handler)
    assert server["listen"][0].endswith(":" + proxy["ports"][0].rsplit(":", 1)[1])
    if tls:
        # The replicas serve TLS on every port (compose.tls.yaml's certificate); the proxy verifies them
        # against the CA and serves TLS itself.
        for svc in replicas.values():
            assert svc["environment"]["MASKROLL_TLS_CERT"] == "/tls/server.crt"
        t = handler["transport"]["tls"]
        assert t["server_name"] in replicas
        assert any(v.endswith(":/tls:ro") for v in proxy["volumes"])
        assert server["tls_connection_policies"]
    else:
        assert "transport" not in handler and "tls_connection_policies" not in server


# ---- Kubernetes --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> list[dict]:
    return rendered("gpu+sessions")


def labels_of(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_k8s_proxy_config_is_deploy_proxy_byte_for_byte(k8s):
    data = one(k8s, "ConfigMap", "maskroll-session-proxy")["data"]
    for name in SNIPPETS:
        assert data[name] == (PROXY / name).read_text(), f"copy deploy/proxy/{name} into session-proxy.yaml"


def test_k8s_replicas_serve_http_ready_by_readyz(k8s):
    cfg = one(k8s, "ConfigMap", "maskroll-config")["data"]
    replica = one(k8s, "Deployment", "maskroll-replica")
    (container,) = pod_spec(replica)["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == int(cfg["MASKROLL_HTTP_PORT"])
    probe = container["readinessProbe"]["httpGet"]
    # TLS as for gRPC: the replicas serve https on the HTTP port too (MASKROLL_TLS_CERT in the config).
    assert probe == {"path": "/readyz", "port": "http", "scheme": "HTTPS"} and cfg["MASKROLL_TLS_CERT"]
    service = one(k8s, "Service", "maskroll-replica")
    assert "http" in [p["targetPort"] for p in service["spec"]["ports"]]
    # The proxy's view: ready pods only.
    pods = one(k8s, "Service", "maskroll-replica-http")
    assert pods["spec"]["clusterIP"] == "None" and not pods["spec"].get("publishNotReadyAddresses")
    assert selects(pods["spec"]["selector"], labels_of(replica))


def test_k8s_proxy_routes_sessions_to_the_ready_replicas_over_tls(k8s):
    proxy = one(k8s, "Deployment", "maskroll-session-proxy")
    spec = pod_spec(proxy)
    (container,) = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    server, handler = adapt(env)
    assert_session_routing(handler)
    assert "upstreams" not in handler  # every replica from DNS: KEDA's pods join and leave the ring
    dyn = handler["dynamic_upstreams"]
    ns = proxy["metadata"]["namespace"]
    assert dyn["source"] == "a" and dyn["name"] == f"maskroll-replica-http.{ns}.svc.cluster.local"
    cfg = one(k8s, "ConfigMap", "maskroll-config")["data"]
    assert dyn["port"] == cfg["MASKROLL_HTTP_PORT"]
    # TLS to the replicas by a name their certificate covers, against the CA in the proxy's secret.
    replica_cert = one(k8s, "Certificate", "maskroll-replica-tls")["spec"]
    assert handler["transport"]["tls"]["server_name"] in replica_cert["dnsNames"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/etc/caddy"]]["configMap"]["name"] == "maskroll-session-proxy"
    tls_secret = volumes[mounts["/tls"]]["secret"]["secretName"]
    proxy_cert = one(k8s, "Certificate", "maskroll-session-proxy-tls")["spec"]
    assert proxy_cert["secretName"] == tls_secret and proxy_cert["issuerRef"] == replica_cert["issuerRef"]
    # What agents dial is the proxy's TLS listener, by a name its certificate covers.
    service = one(k8s, "Service", "maskroll-sessions")
    assert selects(service["spec"]["selector"], labels_of(proxy))
    (port,) = service["spec"]["ports"]
    assert server["listen"] == [f"0.0.0.0:{port['port']}", f"[::]:{port['port']}"]
    assert f"maskroll-sessions.{ns}.svc" in proxy_cert["dnsNames"] and server["tls_connection_policies"]


def test_k8s_replicas_http_port_admits_only_the_proxy(k8s):
    replica_labels = labels_of(one(k8s, "Deployment", "maskroll-replica"))
    proxy_labels = labels_of(one(k8s, "Deployment", "maskroll-session-proxy"))
    trainer = {"app.kubernetes.io/name": "maskroll", "app.kubernetes.io/component": "trainer"}
    port = int(one(k8s, "ConfigMap", "maskroll-config")["data"]["MASKROLL_HTTP_PORT"])
    (policy,) = [p for p in find(k8s, "NetworkPolicy") if selects(p["spec"]["podSelector"]["matchLabels"],
                                                                 replica_labels)]  # fmt: skip

    def admitted(labels: dict) -> bool:
        for rule in policy["spec"]["ingress"]:
            if port not in [p["port"] for p in rule.get("ports", [])]:
                continue
            if any("podSelector" in peer and selects(peer["podSelector"].get("matchLabels", {}), labels)
                   and not peer["podSelector"].get("matchExpressions") for peer in rule["from"]):  # fmt: skip
                return True
        return False

    assert admitted(proxy_labels)
    assert not admitted(trainer) and not admitted(replica_labels)
