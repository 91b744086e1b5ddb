"""deploy/k8s rendered (kubectl kustomize, or kustomize_lite without kubectl) and validated offline:
core resources with kubernetes-validate --strict, the KEDA and cert-manager resources with JSON schemas
of their documented fields in schemas/ (a resource of any other kind without a schema fails), then the
cross-resource facts the deployment relies on: TLS end to end, no secret on a command line, bounded
scratch volumes, metrics reachable from the monitoring namespace only."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path, PurePosixPath

import jsonschema
import kubernetes_validate
import pytest
from deploy_files import (
    COMPOSED,
    KUSTOMIZATIONS,
    SCHEMAS,
    container_env,
    expand_k8s,
    find,
    healthcheck,
    last,
    one,
    pod_spec,
    rendered,
    secret_values,
)
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from maskroll.server.app import ABORT_GRACE_S, STOP_GRACE_S

# The oldest Kubernetes minor the manifests promise (native sidecar-free, policy/v1, autoscaling/v2)
# and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30", latest_version())
CUSTOM_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "keda-scaledobject.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): SCHEMAS / "keda-triggerauthentication.json",
    ("cert-manager.io/v1", "Certificate"): SCHEMAS / "cert-manager.json",
    ("cert-manager.io/v1", "Issuer"): SCHEMAS / "cert-manager.json",
}
OVERLAYS = ("cpu", "gpu")
REPLICA = {"app.kubernetes.io/name": "maskroll", "app.kubernetes.io/component": "replica"}
REDIS = {"app.kubernetes.io/name": "maskroll", "app.kubernetes.io/component": "redis"}
TRAINER = {"app.kubernetes.io/name": "maskroll", "app.kubernetes.io/component": "trainer"}
FIELD_REFS = {"metadata.name": "maskroll-replica-abc12", "status.podIP": "10.0.0.7"}  # the downward API


def custom_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    schema = json.loads(CUSTOM_SCHEMAS[(api_version, kind)].read_text())
    return jsonschema.Draft202012Validator(schema)


def problems(resource: dict, version: str) -> list[str]:
    """Validation errors of one resource; a kind with no schema at all is an error too."""
    key = (resource["apiVersion"], resource["kind"])
    if key in CUSTOM_SCHEMAS:
        return [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in custom_validator(*key).iter_errors(resource)
        ]
    try:
        kubernetes_validate.validate(resource, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    except SchemaNotFoundError as e:
        return [f"no schema: {e.message}"]
    return []


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_rendered_resource_validates(name, version):
    resources = rendered(name)
    assert resources
    errors = {f"{r['kind']}/{r['metadata']['name']}": problems(r, version) for r in resources}
    assert {k: v for k, v in errors.items() if v} == {}


def test_kubernetes_validate_cli_warns_only_about_the_custom_resources(tmp_path):
    """The command line of the issue, on every rendered kustomization: exit 0, and its one kind of
    warning ('no schema') only for the KEDA and cert-manager kinds, which the test above checks instead."""
    import yaml

    files = []
    for name in KUSTOMIZATIONS:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(rendered(name)))
        files.append(str(path))
    cli = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", latest_version()]
    out = subprocess.run([*cli, *files], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    warnings = [line for line in out.stdout.splitlines() if line.startswith("WARN")]
    custom = [f"kind {kind} with api version {api}" for api, kind in CUSTOM_SCHEMAS]
    assert warnings and all(any(c in w for c in custom) for w in warnings), warnings
    assert "ERROR" not in out.stdout


def test_validation_is_strict():
    deployment = one(rendered("gpu"), "Deployment", "maskroll-replica")
    pod_spec(deployment)["containers"][0]["livenesProbe"] = {}
    assert any("livenesProbe" in p for p in problems(deployment, latest_version()))
    scaled = one(rendered("gpu"), "ScaledObject")
    metadata = scaled["spec"]["triggers"][0]["metadata"]
    # With a consumer group, KEDA measures pending entries and ignores streamLength: refused.
    assert problems(scaled, latest_version()) == []
    metadata["consumerGroup"] = "replicas"
    assert problems(scaled, latest_version())
    del metadata["consumerGroup"]
    metadata["streamLength"] = 16  # KEDA metadata values are strings
    assert problems(scaled, latest_version())
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert problems(unknown, latest_version())[0].startswith("no schema")


# ---- cross-resource facts ----------------------------------------------------------------------------


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) applied to a label set."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if (op == "In" and value not in expr["values"]) or (op == "NotIn" and value in expr["values"]):
            return False
        if (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


def template_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def workloads(resources: list[dict]) -> list[dict]:
    return [r for r in resources if r["kind"] in ("Deployment", "StatefulSet", "Job", "Pod")]


def replica_container(resources: list[dict]) -> dict:
    return pod_spec(one(resources, "Deployment", "maskroll-replica"))["containers"][0]


def config(resources: list[dict]) -> dict[str, str]:
    return one(resources, "ConfigMap", "maskroll-config")["data"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_grace_period_covers_prestop_and_drain(name):
    resources = rendered(name)
    spec = pod_spec(one(resources, "Deployment", "maskroll-replica"))
    pre_stop = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = float(config(resources)["MASKROLL_DRAIN_TIMEOUT_S"])
    needed = float(pre_stop[1]) + drain + ABORT_GRACE_S + STOP_GRACE_S
    assert spec["terminationGracePeriodSeconds"] > needed


@pytest.mark.parametrize("name", OVERLAYS)
def test_probes_run_the_image_health_command(name):
    container = replica_container(rendered(name))
    _, health_argv = healthcheck()
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["exec"]["command"] == health_argv
    # Liveness must survive the drain (NOT_SERVING): --live accepts any answer.
    assert container["livenessProbe"]["exec"]["command"] == [*health_argv, "--live"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "large models load for minutes"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["timeoutSeconds"] >= 5


@pytest.mark.parametrize("name", OVERLAYS)
def test_ports_services_and_metrics_annotations_agree_with_the_config(name):
    resources = rendered(name)
    cfg = config(resources)
    deployment = one(resources, "Deployment", "maskroll-replica")
    ports = {p["name"]: p["containerPort"] for p in replica_container(resources)["ports"]}
    assert ports == {"grpc": int(cfg["MASKROLL_PORT"]), "metrics": int(cfg["MASKROLL_METRICS_PORT"])}
    service = one(resources, "Service", "maskroll-replica")
    assert selects({"matchLabels": service["spec"]["selector"]}, template_labels(deployment))
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    pod = deployment["spec"]["template"]["metadata"]
    assert pod["annotations"]["prometheus.io/port"] == cfg["MASKROLL_METRICS_PORT"]
    # each replica is scraped once, as a pod: an annotated Service would be a second scrape of it
    assert not any(k.startswith("prometheus.io/") for k in service["metadata"].get("annotations", {}))
    assert cfg["MASKROLL_HOST"] == "0.0.0.0"


@pytest.mark.parametrize("name", [*OVERLAYS, "trainer", "tools", *COMPOSED])
def test_every_referenced_secret_configmap_and_claim_exists(name):
    resources = rendered(name)
    if name.startswith(("trainer", "tools")):  # they run next to an overlay's ConfigMap, Secret and volume
        resources += [
            r for r in rendered("base") if r["kind"] in ("ConfigMap", "Secret", "PersistentVolumeClaim")
        ]
    # A Certificate's Secret is created by cert-manager, with these keys.
    issued = {c["spec"]["secretName"] for c in find(rendered("base") + resources, "Certificate")}
    for workload in workloads(resources):
        spec = pod_spec(workload)
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                one(resources, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
            if "secret" in volume:
                assert volume["secret"]["secretName"] in issued, volume
                keys = {i["key"] for i in volume["secret"].get("items", [])}
                assert keys <= {"tls.crt", "tls.key", "ca.crt"}
        containers = spec["containers"] + spec.get("initContainers", [])
        mounts = {m["name"] for c in containers for m in c.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in spec.get("volumes", [])} | claims
        for container in spec["containers"]:
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    one(resources, "ConfigMap", source["configMapRef"]["name"])
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    secret = one(resources, "Secret", ref["name"])
                    assert ref["key"] in secret_values(secret), f"{ref} is not in the Secret"


def gib(quantity: str) -> float:
    """A Kubernetes storage quantity ('64Gi', '500Mi', '1T') in GiB."""
    units = {
        "Ki": 2**-20,
        "Mi": 2**-10,
        "Gi": 1,
        "Ti": 2**10,
        "M": 1e6 / 2**30,
        "G": 1e9 / 2**30,
        "T": 1e12 / 2**30,
    }
    number = quantity.rstrip("KMGTi")
    return float(number) * units[quantity[len(number) :]]


def claims(resources: list[dict]) -> list[dict]:
    """Every PersistentVolumeClaim: the resources and the StatefulSets' volumeClaimTemplates."""
    templates = [t for w in workloads(resources) for t in w["spec"].get("volumeClaimTemplates", [])]
    return find(resources, "PersistentVolumeClaim") + templates


def volume(spec: dict, name: str) -> dict:
    (found,) = [v for v in spec["volumes"] if v["name"] == name]
    return found


@pytest.mark.parametrize("name", [*OVERLAYS, "trainer", "tools"])
def test_no_read_write_many_volume_without_the_shared_weights_component(name):
    """The stream transport needs no shared writable volume: replicas read the model from a ReadOnlyMany
    claim and receive pushed weights into an emptyDir of their own, twice the model's size (vLLM keeps
    the serving version's file and receives the next beside it)."""
    resources = rendered(name)
    modes = {c["metadata"]["name"]: c["spec"]["accessModes"] for c in claims(resources)}
    assert not [n for n, m in modes.items() if "ReadWriteMany" in m], modes
    base = rendered("base")
    assert {c["metadata"]["name"]: c["spec"]["accessModes"] for c in claims(base)} == {
        "maskroll-model": ["ReadOnlyMany"],
        "data": ["ReadWriteOnce"],  # Redis's AOF
    }
    if name not in OVERLAYS:
        return
    model_gib = gib(
        one(base, "PersistentVolumeClaim", "maskroll-model")["spec"]["resources"]["requests"]["storage"]
    )
    spec = pod_spec(one(resources, "Deployment", "maskroll-replica"))
    assert "initContainers" not in spec
    cfg = config(resources)
    assert "MASKROLL_WEIGHTS_ROOT" not in cfg, "no weights root: a checkpoint directory is refused"
    mounts = {m["mountPath"]: m for m in replica_container(resources)["volumeMounts"]}
    model_mount = mounts[str(PurePosixPath(cfg["MASKROLL_MODEL"]).parent)]
    assert model_mount["readOnly"]
    model = volume(spec, model_mount["name"])["persistentVolumeClaim"]
    assert model == {"claimName": "maskroll-model", "readOnly": True}
    spool_mount = mounts[cfg["MASKROLL_WEIGHTS_SPOOL"]]
    assert not spool_mount.get("readOnly")
    spool = volume(spec, spool_mount["name"])
    assert set(spool) == {"name", "emptyDir"} and "medium" not in spool["emptyDir"], "on the node's disk"
    assert gib(spool["emptyDir"]["sizeLimit"]) >= 2 * model_gib == 128


@pytest.mark.parametrize("name", ["gpu", "trainer"])
def test_shared_weights_component_adds_one_rwx_volume_and_the_directory_transport(name):
    """The opt-in directory transport: the component adds the ReadWriteMany claim, mounts it read-only
    at the replicas' weights root and read-write at the trainer's --weights-dir, switches the trainer to
    `--weight-transport directory`, and changes nothing else."""
    plain, shared = rendered(name), rendered(f"{name}+shared-weights")
    pvc = one(shared, "PersistentVolumeClaim", "maskroll-weights")
    assert (
        pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        and gib(pvc["spec"]["resources"]["requests"]["storage"]) == 200
    )
    workload = one(plain, "Deployment" if name == "gpu" else "Job")
    assert pvc["metadata"]["namespace"] == workload["metadata"]["namespace"] == "maskroll"
    rest = [r for r in shared if r is not pvc]
    if name == "gpu":
        cfg = config(rest)
        assert cfg.pop("MASKROLL_WEIGHTS_ROOT") == "/weights"
        deployment = one(rest, "Deployment", "maskroll-replica")
        spec = pod_spec(deployment)
        mount = spec["containers"][0]["volumeMounts"].pop()
        assert mount == {"name": "weights", "mountPath": "/weights", "readOnly": True}
        assert spec["volumes"].pop() == {
            "name": "weights",
            "persistentVolumeClaim": {"claimName": "maskroll-weights", "readOnly": True},
        }
        assert cfg["MASKROLL_WEIGHTS_SPOOL"] == "/spool", "pushes still work: the spool stays"
    else:
        job = one(rest, "Job", "maskroll-trainer")
        (container,) = pod_spec(job)["containers"]
        flags = dict(zip(container["args"][2::2], container["args"][3::2], strict=True))
        assert flags["--weight-transport"] == "directory" and flags["--weights-dir"] == "/weights"
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == flags["--weights-dir"]]
        assert not mount.get("readOnly")
        claim = volume(pod_spec(job), mount["name"])["persistentVolumeClaim"]
        assert claim == {"claimName": "maskroll-weights"}
        claim["claimName"] = "maskroll-trainer"
        container["args"][container["args"].index("directory")] = "stream"
    key = lambda r: (r["kind"], r["metadata"]["name"])  # noqa: E731
    assert sorted(rest, key=key) == sorted(plain, key=key), "the component changed something else"


@pytest.mark.parametrize("name", OVERLAYS)
def test_everything_lands_in_the_namespace_it_creates(name):
    resources = rendered(name)
    namespace = one(resources, "Namespace")["metadata"]["name"]
    assert {r["metadata"].get("namespace") for r in resources if r["kind"] != "Namespace"} == {namespace}
    for extra in ("trainer", "tools"):
        assert {r["metadata"]["namespace"] for r in rendered(extra)} == {namespace}


def test_secret_placeholders_are_marked():
    secret = one(rendered("base"), "Secret", "maskroll-secrets")
    assert secret["metadata"]["annotations"]["maskroll.io/placeholder"].startswith("true")
    assert all(v.startswith("REPLACE-ME") for v in secret_values(secret).values())


@pytest.mark.parametrize("name", OVERLAYS)
def test_replica_environment_composes_the_redis_url_and_advertised_address(name):
    resources = rendered(name)
    cfg = config(resources)
    env = container_env(resources, replica_container(resources), FIELD_REFS)
    password = secret_values(one(resources, "Secret", "maskroll-secrets"))["redis-password"]
    ca = cfg["MASKROLL_HEALTHCHECK_TLS_CA"]
    assert env["MASKROLL_REDIS_URL"] == f"rediss://:{password}@{cfg['REDIS_ADDRESS']}/0?ssl_ca_certs={ca}"
    assert env["MASKROLL_ADVERTISE_ADDRESS"] == (
        f"maskroll-replica-abc12.{cfg['REPLICA_DNS_DOMAIN']}:{cfg['MASKROLL_PORT']}"
    )
    assert env["MASKROLL_REPLICA_ID"] == "maskroll-replica-abc12"
    assert env["MASKROLL_PULL"] == "true"
    assert "$(" not in "".join(env.values()), "an unexpanded $(VAR): referenced before it is defined"


@pytest.mark.parametrize("name", OVERLAYS)
def test_scaledobject_scales_the_deployment_on_the_prompt_stream_length(name):
    resources = rendered(name)
    cfg = config(resources)
    scaled = one(resources, "ScaledObject")
    deployment = one(resources, "Deployment", "maskroll-replica")
    target = scaled["spec"]["scaleTargetRef"]
    assert target == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "maskroll-replica",
        "envSourceContainerName": replica_container(resources)["name"],
    }
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "redis-streams"
    assert meta["stream"] == f"maskroll:{cfg['MASKROLL_NAMESPACE']}:prompts"
    assert "consumerGroup" not in meta and int(meta["streamLength"]) >= int(cfg["MASKROLL_PULL_CONCURRENCY"])
    # KEDA reads these variables from the scale target's container.
    env = container_env(resources, replica_container(resources), FIELD_REFS)
    password = secret_values(one(resources, "Secret", "maskroll-secrets"))["redis-password"]
    assert env[meta["passwordFromEnv"]] == password
    # ...and dials the address from its own namespace: it must name the Redis Service's namespace.
    host, port = env[meta["addressFromEnv"]].rsplit(":", 1)
    redis_service = one(resources, "Service", "redis")
    assert host.split(".")[:3] == ["redis", redis_service["metadata"]["namespace"], "svc"]
    assert int(port) == redis_service["spec"]["ports"][0]["port"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_networkpolicies_admit_only_trainers_and_replicas(name):
    resources = rendered(name)
    trainer_labels = template_labels(one(rendered("trainer"), "Job"))
    replica_labels = template_labels(one(resources, "Deployment", "maskroll-replica"))
    redis_labels = template_labels(one(resources, "StatefulSet", "redis"))
    assert selects({"matchLabels": TRAINER}, trainer_labels)
    stranger = {"app.kubernetes.io/name": "something-else"}
    policies = find(resources, "NetworkPolicy")

    def admitted(policy: dict, labels: dict, port: int) -> bool:
        """Whether a pod with `labels` in the same namespace may reach `port` of the selected pods."""
        for rule in policy["spec"]["ingress"]:
            if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
                continue
            peers = rule.get("from")
            same_namespace = [p for p in peers or [] if "namespaceSelector" not in p]
            if not peers or any(selects(p["podSelector"], labels) for p in same_namespace):
                return True
        return False

    redis_policy = [p for p in policies if selects(p["spec"]["podSelector"], redis_labels)]
    grpc_policy = [p for p in policies if selects(p["spec"]["podSelector"], replica_labels)]
    assert len(redis_policy) == len(grpc_policy) == 1
    (redis_policy,), (grpc_policy,) = redis_policy, grpc_policy
    assert not selects(redis_policy["spec"]["podSelector"], replica_labels)
    for policy, port in ((redis_policy, 6379), (grpc_policy, int(config(resources)["MASKROLL_PORT"]))):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert admitted(policy, trainer_labels, port) and admitted(policy, replica_labels, port)
        assert not admitted(policy, stranger, port) and not admitted(policy, redis_labels, port)
    # Metrics: from the monitoring namespace only, not from any pod of this namespace.
    metrics = int(config(resources)["MASKROLL_METRICS_PORT"])
    for labels in (stranger, trainer_labels, redis_labels):
        assert not admitted(grpc_policy, labels, metrics)
    (rule,) = [r for r in grpc_policy["spec"]["ingress"] if metrics in [p["port"] for p in r["ports"]]]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]


@pytest.mark.parametrize("name", OVERLAYS)
def test_pdb_and_services_select_their_pods(name):
    resources = rendered(name)
    replica_labels = template_labels(one(resources, "Deployment", "maskroll-replica"))
    redis = one(resources, "StatefulSet", "redis")
    assert selects(one(resources, "PodDisruptionBudget")["spec"]["selector"], replica_labels)
    assert selects({"matchLabels": one(resources, "Service", "redis")["spec"]["selector"]}, REDIS)
    assert selects(redis["spec"]["selector"], template_labels(redis))
    assert redis["spec"]["serviceName"] == "redis"
    assert selects({"matchLabels": REPLICA}, replica_labels)


@pytest.mark.parametrize("name", [*OVERLAYS, "trainer", "tools"])
def test_every_pod_runs_non_root_without_privileges(name):
    uid = int(last("USER").split(":")[0])
    for workload in workloads(rendered(name)):
        spec = pod_spec(workload)
        ctx = spec["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0
        assert ctx["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False
        if workload["metadata"]["name"] != "redis":
            assert ctx["runAsUser"] == uid, "the image's USER"
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["readOnlyRootFilesystem"] is True


def redis_script(container: dict) -> tuple[list[str], str]:
    """(redis-server's argv, the configuration it reads on stdin) from the container's `sh -c` script."""
    assert container["command"][:2] == ["sh", "-c"] and "args" not in container
    script = container["command"][2]
    head, _, rest = script.partition("<<EOF\n")
    stdin, _, _ = rest.partition("\nEOF")
    argv = shlex.split(head.replace("\\\n", " "))
    assert argv[0] == "exec" and argv[-1] == "-", "configuration from stdin: `-` last (or first)"
    return argv[1:-1], stdin


def test_redis_keeps_an_append_only_file_on_a_persistent_volume():
    resources = rendered("base")
    redis = one(resources, "StatefulSet", "redis")
    (container,) = pod_spec(redis)["containers"]
    argv, stdin = redis_script(container)
    opt = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1, 2)}
    assert argv[0] == "redis-server"
    assert opt["--appendonly"] == "yes" and opt["--maxmemory-policy"] == "noeviction"
    # The password reaches Redis on stdin (expanded by the shell), never in its argv.
    assert stdin == "requirepass $REDIS_PASSWORD" and "--requirepass" not in opt
    env = container_env(resources, container, {})
    secret = secret_values(one(resources, "Secret", "maskroll-secrets"))
    assert env["REDIS_PASSWORD"] == env["REDISCLI_AUTH"] == secret["redis-password"]
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == opt["--dir"]


def test_redis_script_runs_with_the_password_off_its_command_line(tmp_path):
    """The manifest's own script under a local sh and redis-server (TLS flags dropped: the local build
    has no TLS; the options and the stdin configuration are the manifest's): clients need the
    password, and the server's argv never holds it."""
    import redis as redis_py

    from maskroll.local.redis_server import find_redis_server, free_port

    (container,) = pod_spec(one(rendered("base"), "StatefulSet", "redis"))["containers"]
    argv, _ = redis_script(container)
    port = free_port()
    keep = {k: v for k, v in zip(argv[1::2], argv[2::2], strict=True) if not k.startswith("--tls")}
    keep.update({"--port": str(port), "--dir": str(tmp_path), "--maxmemory": "64mb"})
    flags = " ".join(f"{k} {shlex.quote(v)}" for k, v in keep.items())
    script = container["command"][2]
    local = f"exec {find_redis_server()} {flags} - <<EOF\n" + script.partition("<<EOF\n")[2]
    password = "pw-" + "x" * 20
    proc = subprocess.Popen(["sh", "-c", local], env={"REDIS_PASSWORD": password, "PATH": "/usr/bin:/bin"})
    try:
        client = redis_py.Redis(port=port, password=password, socket_timeout=2)
        deadline = time.monotonic() + 15
        while True:
            try:
                assert client.ping()
                break
            except redis_py.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port, password="wrong", socket_timeout=2).ping()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # exec: the shell became redis-server
        assert password.encode() not in cmdline
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("name", OVERLAYS)
def test_redis_and_the_replicas_speak_tls_with_cert_manager_certificates(name):
    resources = rendered(name)
    cfg = config(resources)
    namespace = one(resources, "Namespace")["metadata"]["name"]
    certs = {c["spec"]["secretName"]: c["spec"] for c in find(resources, "Certificate")}
    issuers = {(c["issuerRef"]["name"], c["issuerRef"]["kind"]) for c in certs.values()}
    (ca_issuer,) = [i for i in find(rendered("tls-ca"), "Issuer") if "ca" in i["spec"]]
    assert issuers == {(ca_issuer["metadata"]["name"], "Issuer")}, "deploy/k8s/tls-ca provides the issuer"

    def volume_of(spec: dict, container: dict, path: str) -> dict:
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mount.get("readOnly")
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        return volume

    def covers(pattern: str, host: str) -> bool:
        return pattern == host or (pattern.startswith("*.") and host.split(".", 1)[1] == pattern[2:])

    # Redis: TLS port only, its certificate mounted, its address and the probes' loopback in the names.
    redis = one(resources, "StatefulSet", "redis")
    spec = pod_spec(redis)
    (container,) = spec["containers"]
    argv, _ = redis_script(container)
    opt = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert opt["--port"] == "0" and opt["--tls-port"] == "6379"
    redis_secret = volume_of(spec, container, opt["--tls-cert-file"])["secret"]["secretName"]
    assert volume_of(spec, container, opt["--tls-key-file"])["secret"]["secretName"] == redis_secret
    host = cfg["REDIS_ADDRESS"].rsplit(":", 1)[0]
    assert any(covers(n, host) for n in certs[redis_secret]["dnsNames"])
    assert "127.0.0.1" in certs[redis_secret]["ipAddresses"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "--tls --cacert" in container[probe]["exec"]["command"][-1]
    # Replicas: serve TLS with their certificate, verify Redis, and are dialled by a covered name.
    deployment = one(resources, "Deployment", "maskroll-replica")
    spec = pod_spec(deployment)
    replica = replica_container(resources)
    env = container_env(resources, replica, FIELD_REFS)
    secret = volume_of(spec, replica, env["MASKROLL_TLS_CERT"])["secret"]["secretName"]
    assert volume_of(spec, replica, env["MASKROLL_TLS_KEY"])["secret"]["secretName"] == secret
    assert volume_of(spec, replica, env["MASKROLL_HEALTHCHECK_TLS_CA"])["secret"]["secretName"] == secret
    advertised = env["MASKROLL_ADVERTISE_ADDRESS"].rsplit(":", 1)[0]
    assert any(covers(n, advertised) for n in certs[secret]["dnsNames"]), advertised
    assert "127.0.0.1" in certs[secret]["ipAddresses"], "the exec health probes dial loopback"
    pods = one(resources, "Service", spec["subdomain"])
    assert pods["spec"]["clusterIP"] == "None" and selects({"matchLabels": pods["spec"]["selector"]}, REPLICA)
    assert cfg["REPLICA_DNS_DOMAIN"] == f"{spec['subdomain']}.{namespace}.svc.cluster.local"
    assert env["MASKROLL_REDIS_URL"].startswith("rediss://")
    assert env["MASKROLL_REDIS_URL"].endswith(f"?ssl_ca_certs={env['MASKROLL_HEALTHCHECK_TLS_CA']}")
    # KEDA verifies Redis with the same CA.
    (trigger,) = one(resources, "ScaledObject")["spec"]["triggers"]
    assert trigger["metadata"]["enableTLS"] == "true"
    auth = one(resources, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "ca", "name": redis_secret, "key": "ca.crt"}]


@pytest.mark.parametrize("name", [*OVERLAYS, "trainer", "tools"])
def test_no_secret_on_any_command_line(name):
    """Arguments are visible to every process on the node (`ps`); secrets travel in the environment."""
    resources = rendered(name)
    base = rendered("base")
    secrets = set(secret_values(one(base, "Secret", "maskroll-secrets")).values())
    # trainer and tools run next to an overlay's ConfigMap and Secret
    shared = [r for r in base if r["kind"] in ("ConfigMap", "Secret")] if name in ("trainer", "tools") else []
    context = resources + shared
    for workload in workloads(resources):
        for container in pod_spec(workload)["containers"]:
            env = container_env(context, container, FIELD_REFS)
            argv = [expand_k8s(a, env) for a in container.get("command", []) + container.get("args", [])]
            assert not any(s in a for s in secrets for a in argv), (workload["metadata"]["name"], argv)


@pytest.mark.parametrize("name", [*OVERLAYS, "trainer", "tools", *COMPOSED])
def test_every_scratch_volume_is_bounded(name):
    for workload in workloads(rendered(name)):
        for volume in pod_spec(workload).get("volumes", []):
            if "emptyDir" in volume:
                assert volume["emptyDir"].get("sizeLimit"), (workload["metadata"]["name"], volume["name"])


def test_overlays_differ_in_image_and_accelerator():
    images = {}
    for name in OVERLAYS:
        resources = rendered(name)
        container = replica_container(resources)
        images[name] = container["image"]
        assert config(resources)["MASKROLL_ENGINE"] == "vllm"
        gpus = {k: v for k, v in container["resources"].get("limits", {}).items() if k == "nvidia.com/gpu"}
        spec = pod_spec(one(resources, "Deployment", "maskroll-replica"))
        if name == "gpu":
            assert gpus == {"nvidia.com/gpu": "1"}
            assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
            assert spec["nodeSelector"] and spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        else:
            assert gpus == {} and "nodeSelector" not in spec
            assert container["resources"]["requests"]["cpu"] == container["resources"]["limits"]["cpu"]
    assert len(set(images.values())) == len(OVERLAYS), images
    assert replica_container(rendered("base"))["image"] == "maskroll"  # only overlays name the image
    assert all(":" in image and not image.endswith(":latest") for image in images.values())


def test_trainer_job_matches_the_replicas_namespace_weights_and_labels():
    job = one(rendered("trainer"), "Job")
    base = rendered("base")
    replica = replica_container(base)
    (container,) = pod_spec(job)["containers"]
    argv = container["command"] + container["args"]
    assert argv[:3] == ["maskroll", "demo", "--no-spawn"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert "--redis-url" not in flags, "the demo reads MASKROLL_REDIS_URL: no password on the command line"
    env = container_env(base, container, {})
    replica_env = container_env(base, replica, FIELD_REFS)
    assert env["MASKROLL_REDIS_URL"] == replica_env["MASKROLL_REDIS_URL"]
    # It verifies the replicas (and Redis) with the CA of the replicas' certificate.
    ca = env["MASKROLL_HEALTHCHECK_TLS_CA"]
    (tls_mount,) = [m for m in container["volumeMounts"] if ca.startswith(m["mountPath"] + "/")]
    (tls,) = [v for v in pod_spec(job)["volumes"] if v["name"] == tls_mount["name"]]
    assert tls["secret"]["secretName"] == "maskroll-replica-tls"
    assert tls["secret"]["items"] == [{"key": "ca.crt", "path": ca.rsplit("/", 1)[1]}]
    assert expand_k8s(flags["--namespace"], env) == replica_env["MASKROLL_NAMESPACE"]
    assert expand_k8s(flags["--model"], env) == replica_env["MASKROLL_MODEL"]
    assert flags["--out"].startswith("/tmp/"), "the root filesystem is read-only; /tmp is an emptyDir"
    # Weights go over gRPC; the trainer's own copy (to resume from) is on a claim only it mounts.
    assert flags["--weight-transport"] == "stream"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    own = volume(pod_spec(job), mounts[flags["--weights-dir"]]["name"])["persistentVolumeClaim"]
    assert own == {"claimName": "maskroll-trainer"} and not mounts[flags["--weights-dir"]].get("readOnly")
    assert one(rendered("trainer"), "PersistentVolumeClaim", "maskroll-trainer")["spec"]["accessModes"] == [
        "ReadWriteOnce"
    ]
    replica_claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod_spec(one(base, "Deployment", "maskroll-replica"))["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert replica_claims == {"maskroll-model"}
    # The learner starts from the model the replicas serve: the same claim, read-only, at the same path.
    model_mount = mounts[str(PurePosixPath(replica_env["MASKROLL_MODEL"]).parent)]
    assert model_mount["readOnly"]
    model = volume(pod_spec(job), model_mount["name"])["persistentVolumeClaim"]
    assert model == {"claimName": "maskroll-model", "readOnly": True}
    assert "/tmp" in mounts
    assert job["metadata"]["namespace"] == one(base, "Deployment")["metadata"]["namespace"]
    assert selects({"matchLabels": TRAINER}, template_labels(job))
    assert container["image"].split(":")[0] == replica_container(rendered("gpu"))["image"].split(":")[0]
