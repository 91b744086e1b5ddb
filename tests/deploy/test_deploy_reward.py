"""deploy/k8s/reward (the reward stage's Deployment and KEDA ScaledObject) against the base it runs next
to: its command is `maskroll reward` with flags the command accepts, it scales on the finished stream
the replicas fill (XLEN: no consumerGroup), it reaches Redis (NetworkPolicy) with the URL composed from
the ConfigMap and Secret, no secret on its command line, non-root, bounded scratch."""

from __future__ import annotations

from deploy_files import container_env, expand_k8s, one, pod_spec, rendered, secret_values

from maskroll.app.reward import parse
from maskroll.proto.streams import StreamKeys

REWARD = {"app.kubernetes.io/name": "maskroll", "app.kubernetes.io/component": "reward"}
FIELD_REFS = {"metadata.name": "maskroll-reward-abc12", "status.podIP": "10.0.0.8"}


def _context() -> tuple[list[dict], dict, dict]:
    resources = list(rendered("reward"))
    base = rendered("base")
    shared = [r for r in base if r["kind"] in ("ConfigMap", "Secret", "PersistentVolumeClaim")]
    deployment = one(resources, "Deployment", "maskroll-reward")
    container = pod_spec(deployment)["containers"][0]
    env = container_env(resources + shared, container, FIELD_REFS)
    return resources + shared, deployment, env


def test_the_command_is_maskroll_reward_with_valid_flags_and_no_secret():
    resources, deployment, env = _context()
    container = pod_spec(deployment)["containers"][0]
    assert deployment["spec"]["template"]["metadata"]["labels"] == REWARD
    argv = [expand_k8s(a, env) for a in container["command"] + container["args"]]
    assert argv[:2] == ["maskroll", "reward"]
    # the flags parse into a valid config, with the Redis URL from the environment (never an argument)
    import os

    saved = os.environ.get("MASKROLL_REDIS_URL")
    os.environ["MASKROLL_REDIS_URL"] = env["MASKROLL_REDIS_URL"]
    try:
        cfg = parse(argv[2:])
    finally:
        if saved is None:
            os.environ.pop("MASKROLL_REDIS_URL")
        else:
            os.environ["MASKROLL_REDIS_URL"] = saved
    assert cfg.redis_url.startswith("rediss://:") and "ssl_ca_certs=/tls/ca.crt" in cfg.redis_url
    assert cfg.reward == "maskroll.recipes.digits:digit_reward_fn"
    password = secret_values(one(resources, "Secret", "maskroll-secrets"))["redis-password"]
    assert not any(password in a for a in argv)
    assert str(cfg.tokenizer) == env["MASKROLL_MODEL"]  # the model volume's tokenizer
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models"]["readOnly"] and mounts["/tls"]["readOnly"]
    spec = pod_spec(deployment)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
    assert all(v["emptyDir"]["sizeLimit"] for v in spec["volumes"] if "emptyDir" in v)
    # grace: the stage's drain after a reward call's timeout
    assert spec["terminationGracePeriodSeconds"] > cfg.timeout_s + 10


def test_keda_scales_the_workers_on_the_finished_stream():
    resources, deployment, env = _context()
    scaled = one(resources, "ScaledObject", "maskroll-reward")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scaled["spec"]["scaleTargetRef"]["envSourceContainerName"] == "reward"
    (trigger,) = scaled["spec"]["triggers"]
    meta = trigger["metadata"]
    assert meta["stream"] == StreamKeys(env["MASKROLL_NAMESPACE"]).part(0).finished
    assert "consumerGroup" not in meta and int(meta["streamLength"]) > 0  # XLEN: waiting + being scored
    assert meta["addressFromEnv"] in env and meta["passwordFromEnv"] in env
    one(rendered("base"), "TriggerAuthentication", trigger["authenticationRef"]["name"])


def test_the_redis_network_policy_admits_reward_workers():
    (policy,) = [
        p
        for p in rendered("cpu")
        if p["kind"] == "NetworkPolicy"
        and p["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "redis"
    ]
    (selector,) = [
        peer["podSelector"]
        for peer in policy["spec"]["ingress"][0]["from"]
        if "namespaceSelector" not in peer
    ]
    (expr,) = selector["matchExpressions"]
    assert "reward" in expr["values"]
    assert set(expr["values"]) == {"replica", "trainer", "reward", "teacher-stage"}  # deploy/k8s/teacher
