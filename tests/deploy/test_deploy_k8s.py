"""deploy/k8s rendered (kubectl kustomize, or kustomize_lite without kubectl) and validated offline:
core resources with kubernetes-validate --strict, the KEDA ScaledObject with the JSON schema of its
documented fields in schemas/ (a resource of any other kind without a schema fails), then the
cross-resource facts the deployment relies on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import PurePosixPath

import jsonschema
import kubernetes_validate
import pytest
from deploy_files import (
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
CUSTOM_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "keda-scaledobject.json"}
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


def test_kubernetes_validate_cli_warns_only_about_the_scaledobject(tmp_path):
    """The command line of the issue, on every rendered kustomization: exit 0, and its one kind of
    warning ('no schema') only for the KEDA ScaledObject, which the test above checks instead."""
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
    assert warnings and all("kind ScaledObject with api version keda.sh/v1alpha1" in w for w in warnings)
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
    for annotated in (deployment["spec"]["template"]["metadata"], service["metadata"]):
        assert annotated["annotations"]["prometheus.io/port"] == cfg["MASKROLL_METRICS_PORT"]
    assert cfg["MASKROLL_HOST"] == "0.0.0.0"


@pytest.mark.parametrize("name", [*OVERLAYS, "trainer", "tools"])
def test_every_referenced_secret_configmap_and_claim_exists(name):
    resources = rendered(name)
    if name in ("trainer", "tools"):  # they run next to an overlay's ConfigMap, Secret and volume
        resources += [
            r for r in rendered("base") if r["kind"] in ("ConfigMap", "Secret", "PersistentVolumeClaim")
        ]
    for workload in workloads(resources):
        spec = pod_spec(workload)
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                one(resources, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
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


@pytest.mark.parametrize("name", [*OVERLAYS, "trainer"])
def test_init_container_creates_the_shared_subpaths_with_the_main_image(name):
    for workload in workloads(rendered(name)):
        spec = pod_spec(workload)
        subpaths = {
            m["subPath"]
            for c in spec["containers"]
            for m in c.get("volumeMounts", [])
            if m["name"] == "shared"
        }
        if not subpaths:
            continue
        (init,) = spec["initContainers"]
        (mount,) = init["volumeMounts"]
        assert mount["name"] == "shared" and not mount.get("readOnly")
        created = init["command"][-1].removeprefix("mkdir -p ").split()
        assert {c.removeprefix(mount["mountPath"] + "/") for c in created} == subpaths
        assert init["image"] == spec["containers"][0]["image"]


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
    assert env["MASKROLL_REDIS_URL"] == f"redis://:{password}@{cfg['REDIS_ADDRESS']}/0"
    assert env["MASKROLL_ADVERTISE_ADDRESS"] == f"10.0.0.7:{cfg['MASKROLL_PORT']}"
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


def test_redis_keeps_an_append_only_file_on_a_persistent_volume():
    resources = rendered("base")
    redis = one(resources, "StatefulSet", "redis")
    (container,) = pod_spec(redis)["containers"]
    args = container["args"]
    opt = {args[i]: args[i + 1] for i in range(1, len(args) - 1, 2)}
    assert opt["--appendonly"] == "yes" and opt["--maxmemory-policy"] == "noeviction"
    assert opt["--requirepass"] == "$(REDIS_PASSWORD)"
    env = container_env(resources, container, {})
    secret = secret_values(one(resources, "Secret", "maskroll-secrets"))
    assert env["REDIS_PASSWORD"] == env["REDISCLI_AUTH"] == secret["redis-password"]
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {claim["metadata"]["name"]: opt["--dir"]}


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
    env = container_env(base, container, {})
    replica_env = container_env(base, replica, FIELD_REFS)
    assert expand_k8s(flags["--redis-url"], env) == replica_env["MASKROLL_REDIS_URL"]
    assert expand_k8s(flags["--namespace"], env) == replica_env["MASKROLL_NAMESPACE"]
    assert expand_k8s(flags["--model"], env) == replica_env["MASKROLL_MODEL"]
    assert flags["--out"].startswith("/tmp/"), "the root filesystem is read-only; /tmp is an emptyDir"
    root = replica_env["MASKROLL_WEIGHTS_ROOT"]
    assert flags["--weights-dir"] == root or flags["--weights-dir"].startswith(root.rstrip("/") + "/")
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    replica_mounts = {m["mountPath"]: m for m in replica["volumeMounts"]}
    assert mounts[root]["subPath"] == replica_mounts[root]["subPath"]
    assert not mounts[root].get("readOnly") and replica_mounts[root]["readOnly"]
    model_mount = str(PurePosixPath(replica_env["MASKROLL_MODEL"]).parent)
    assert mounts[model_mount]["subPath"] == replica_mounts[model_mount]["subPath"]
    assert "/tmp" in mounts
    assert job["metadata"]["namespace"] == one(base, "Deployment")["metadata"]["namespace"]
    assert selects({"matchLabels": TRAINER}, template_labels(job))
    assert container["image"].split(":")[0] == replica_container(rendered("gpu"))["image"].split(":")[0]
