"""deploy/k8s/teacher (teacher replicas, the teacher stage's Deployment and its KEDA ScaledObject) against
the base it runs next to: the stage's command is `maskroll teacher` with flags the command accepts, naming
every teacher pod by the DNS name its certificate covers; KEDA scales it on the lag of the consumer group
the code reads through (TEACHER_GROUP); the teacher replicas serve the teacher model outside pull mode
with settings `maskroll serve` knows; the NetworkPolicies let the stage (and only it) reach the teachers,
and it reach Redis and the student replicas; no secret on a command line. (Every resource is also
validated offline with the others: test_deploy_k8s.py, KUSTOMIZATIONS["teacher"].)"""

from __future__ import annotations

import fnmatch
import os

from deploy_files import container_env, expand_k8s, one, pod_spec, rendered, secret_values

from maskroll.app.teacher import parse
from maskroll.proto.streams import TEACHER_GROUP, StreamKeys
from maskroll.server.config import config_fields

STAGE = {"app.kubernetes.io/name": "maskroll", "app.kubernetes.io/component": "teacher-stage"}
TEACHER = {"app.kubernetes.io/name": "maskroll", "app.kubernetes.io/component": "teacher"}
FIELD_REFS = {"metadata.name": "maskroll-teacher-0", "status.podIP": "10.0.0.9"}


def _context() -> tuple[list[dict], dict]:
    resources = list(rendered("teacher"))
    shared = [r for r in rendered("base") if r["kind"] in ("ConfigMap", "Secret", "PersistentVolumeClaim")]
    return resources + shared, one(resources, "Deployment", "maskroll-teacher-stage")


def _stage_config(env: dict, argv: list[str]):
    saved = {k: os.environ.get(k) for k in ("MASKROLL_REDIS_URL", "MASKROLL_AUTH_TOKEN")}
    os.environ.update({k: env[k] for k in saved})
    try:
        return parse(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_the_stage_is_maskroll_teacher_with_valid_flags_and_no_secret():
    resources, deployment = _context()
    container = pod_spec(deployment)["containers"][0]
    assert deployment["spec"]["template"]["metadata"]["labels"] == STAGE
    env = container_env(resources, container, FIELD_REFS)
    argv = [expand_k8s(a, env) for a in container["command"] + container["args"]]
    assert argv[:2] == ["maskroll", "teacher"]
    cfg = _stage_config(env, argv[2:])  # the Redis URL and the token from the environment, never a flag
    assert cfg.redis_url.startswith("rediss://:") and "ssl_ca_certs=/tls/ca.crt" in cfg.redis_url
    secrets = secret_values(one(resources, "Secret", "maskroll-secrets"))
    assert cfg.token == secrets["auth-token"]
    assert not any(s in a for s in secrets.values() for a in argv)
    assert str(cfg.tls_ca) == "/tls/ca.crt" and cfg.namespace == env["MASKROLL_NAMESPACE"]
    # every teacher pod of the StatefulSet, by the name its certificate covers, on its gRPC port
    teachers = one(resources, "StatefulSet", "maskroll-teacher")
    service = one(resources, "Service", "maskroll-teacher-pods")
    assert (
        teachers["spec"]["serviceName"] == service["metadata"]["name"]
        and service["spec"]["clusterIP"] == "None"
    )
    namespace = teachers["metadata"]["namespace"]
    domain = f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    port = service["spec"]["ports"][0]["port"]
    assert cfg.teachers == tuple(
        f"maskroll-teacher-{i}.{domain}:{port}" for i in range(teachers["spec"]["replicas"])
    )
    (pattern,) = one(resources, "Certificate", "maskroll-teacher-tls")["spec"]["dnsNames"]
    assert all(fnmatch.fnmatch(a.rsplit(":", 1)[0], pattern) for a in cfg.teachers)
    # K_teacher within what the teachers serve
    teacher_env = container_env(resources, pod_spec(teachers)["containers"][0], FIELD_REFS)
    assert cfg.teacher_k <= int(teacher_env["MASKROLL_MAX_LOGPROBS"])
    spec = pod_spec(deployment)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
    assert all(v["emptyDir"]["sizeLimit"] for v in spec["volumes"] if "emptyDir" in v)
    assert spec["terminationGracePeriodSeconds"] > cfg.timeout_s + 10  # the drain after a call's timeout
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/tls"]["readOnly"]


def test_the_teacher_replicas_serve_the_teacher_model_outside_pull_mode():
    resources, _ = _context()
    teachers = one(resources, "StatefulSet", "maskroll-teacher")
    assert teachers["spec"]["template"]["metadata"]["labels"] == TEACHER
    container = pod_spec(teachers)["containers"][0]
    env = container_env(resources, container, FIELD_REFS)
    assert env["MASKROLL_PULL"] == "false" and "MASKROLL_REDIS_URL" not in env  # no prompt jobs, no Redis
    assert env["MASKROLL_MODEL"] == "/models/teacher" and env["MASKROLL_REPLICA_ID"] == "maskroll-teacher-0"
    # every MASKROLL_* variable is a `maskroll serve` setting (a misspelt one would be ignored)
    used = {k[len("MASKROLL_") :].lower() for k in env if k.startswith("MASKROLL_")}
    assert used - set(config_fields()) <= {"healthcheck_tls_ca", "weights_spool"}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(teachers)["volumes"]}
    assert volumes[mounts["/tls"]]["secret"]["secretName"] == "maskroll-teacher-tls"
    assert volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"] == "maskroll-model"
    assert env["MASKROLL_TLS_CERT"].startswith("/tls/")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == int(env["MASKROLL_PORT"]) == 50051


def test_keda_scales_the_stage_on_its_consumer_groups_lag():
    resources, deployment = _context()
    scaled = one(resources, "ScaledObject", "maskroll-teacher-stage")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    container = pod_spec(deployment)["containers"][0]
    assert scaled["spec"]["scaleTargetRef"]["envSourceContainerName"] == container["name"]
    env = container_env(resources, container, FIELD_REFS)
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "redis-streams"
    assert meta["stream"] == StreamKeys(env["MASKROLL_NAMESPACE"]).part(0).finished
    assert meta["consumerGroup"] == TEACHER_GROUP == "teachers"
    assert int(meta["lagCount"]) > 0 and "pendingEntriesCount" not in meta and "streamLength" not in meta
    assert meta["addressFromEnv"] in env and meta["passwordFromEnv"] in env
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    one(rendered("base"), "TriggerAuthentication", trigger["authenticationRef"]["name"])


def _admitted(policy: dict, labels: dict, port: int) -> bool:
    def selects(selector: dict, labels: dict) -> bool:
        if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
            return False
        return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))

    for rule in policy["spec"]["ingress"]:
        if port not in [p["port"] for p in rule.get("ports", [])]:
            continue
        if any("namespaceSelector" not in p and selects(p["podSelector"], labels) for p in rule["from"]):
            return True
    return False


def test_network_policies_let_the_stage_reach_teachers_students_and_redis():
    (teacher_policy,) = [p for p in rendered("teacher") if p["kind"] == "NetworkPolicy"]
    assert teacher_policy["spec"]["podSelector"]["matchLabels"] == TEACHER
    stranger = {"app.kubernetes.io/name": "maskroll", "app.kubernetes.io/component": "trainer"}
    assert _admitted(teacher_policy, STAGE, 50051) and not _admitted(teacher_policy, stranger, 50051)
    assert not _admitted(teacher_policy, STAGE, 9400)  # metrics: the monitoring namespace only
    base = [p for p in rendered("cpu") if p["kind"] == "NetworkPolicy"]
    component = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p for p in base}
    assert _admitted(component["redis"], STAGE, 6379)  # its records
    assert _admitted(component["replica"], STAGE, 50051)  # the student's GetInfo at start-up
    assert not _admitted(component["replica"], TEACHER, 50051) and not _admitted(
        component["redis"], TEACHER, 6379
    )


def test_every_pod_runs_non_root_with_bounded_scratch_and_existing_references():
    resources, _ = _context()
    issued = {
        c["spec"]["secretName"] for c in rendered("base") + rendered("teacher") if c["kind"] == "Certificate"
    }
    for workload in [r for r in resources if r["kind"] in ("Deployment", "StatefulSet")]:
        spec = pod_spec(workload)
        ctx = spec["securityContext"]
        assert (
            ctx["runAsNonRoot"] is True
            and ctx["runAsUser"] == 10001
            and spec["automountServiceAccountToken"] is False
        )
        assert ctx["seccompProfile"]["type"] == "RuntimeDefault"
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["readOnlyRootFilesystem"] is True
            mounts = {m["name"] for m in container["volumeMounts"]}
            assert mounts <= {v["name"] for v in spec["volumes"]}
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secret_values(one(resources, "Secret", ref["name"]))
        for volume in spec["volumes"]:
            if "emptyDir" in volume:
                assert volume["emptyDir"]["sizeLimit"], (workload["metadata"]["name"], volume["name"])
            if "secret" in volume:
                assert volume["secret"]["secretName"] in issued
            if "persistentVolumeClaim" in volume:
                one(resources, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
