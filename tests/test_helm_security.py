"""The chart's trust boundaries (docs/security.md#kubernetes), rendered by the real `helm`.

Every container runs locked down (non-root unless the agents are let run as root for a
device, no privilege escalation, no capabilities, a read-only root filesystem, the runtime's
seccomp profile), with volumes where the code writes; NetworkPolicies let only this release's
agents reach the agents (snapshot links, rendezvous, collectives) and only the configured
scrapers reach /metrics; the agents' snapshot key comes from a Secret of its own, which the
controllers never see. Nothing here talks to a cluster: `lookup` (the key kept across an
upgrade) returns nothing under `helm template`, so that half is not exercised here.
"""

from __future__ import annotations

import base64
import json

import pytest
from test_helm_chart import (
    AGENT0,
    CHART,
    CUSTOM,
    HELM,
    KUBERNETES,
    NAMESPACE,
    RELEASE,
    helm,
    pod_labels,
    render,
    selects,
)
from test_helm_chart import one as chart_one

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (`make helm`, or "
                                "$HELM naming the binary)")

PODS = ("Deployment", "Job", "StatefulSet")  # the controllers, the agents, Redis


def one(objects: list[dict], kind: str, suffix: str = "") -> dict:
    """As test_helm_chart's, and the Job is the first agent's: the agents' Jobs differ in their
    name and index only (test_helm_chart.test_one_agent_per_node_nodes_plus_spares)."""
    return chart_one(objects, kind, suffix or (AGENT0 if kind == "Job" else ""))


ROOT_AGENTS = {"agents": {"runAsNonRoot": False, "supplementalGroups": [109]},
               "security": {"runAsUser": 4242, "runAsGroup": 4242, "fsGroup": 4343}}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
MONITORING_NS = {"kubernetes.io/metadata.name": "monitoring"}
RELEASE_NS = {"kubernetes.io/metadata.name": NAMESPACE}


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    return render(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    return render(tmp_path_factory.mktemp("custom"), CUSTOM)


def pod(objects: list[dict], kind: str) -> dict:
    return one(objects, kind)["spec"]["template"]["spec"]


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def effective(spec: dict, c: dict, key: str):
    """A security setting as the kubelet applies it: the container's, else the pod's."""
    return c.get("securityContext", {}).get(key, spec.get("securityContext", {}).get(key))


def env_of(c: dict) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def main(objects: list[dict], kind: str) -> dict:
    return pod(objects, kind)["containers"][0]


def valid(objects: list[dict]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e .[dev]")
    for obj in objects:
        if obj["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)


# --- securityContext -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["default", "custom"])
def test_every_container_runs_locked_down(which, request):
    objects = request.getfixturevalue(which)
    seen = set()
    for kind in PODS:
        spec = pod(objects, kind)
        assert not spec.get("hostPID") and not spec.get("hostIPC")
        assert spec["securityContext"]["runAsUser"] > 0
        for c in containers(spec):
            seen.add((kind, c["name"]))
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (kind, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (kind, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (kind, c["name"])
            assert not sc.get("privileged")
            assert effective(spec, c, "runAsNonRoot") is True, (kind, c["name"])
            assert effective(spec, c, "seccompProfile") == {"type": "RuntimeDefault"}
    assert seen == {("Deployment", "wait-for-redis"), ("Deployment", "controller"),
                    ("Job", "wait-for-redis"), ("Job", "agent"), ("StatefulSet", "redis")}
    for kind in ("Deployment", "Job"):  # the image's user is the chart's, not root
        security = pod(objects, kind)["securityContext"]
        assert (security["runAsUser"], security["runAsGroup"], security["fsGroup"]) == (
            1000, 1000, 1000)
        assert security["fsGroupChangePolicy"] == "OnRootMismatch"  # no chown of checkpoints


@pytest.mark.parametrize("which", ["default", "custom"])
def test_what_the_code_writes_is_a_volume_and_the_rest_is_read_only(which, request):
    objects = request.getfixturevalue(which)
    shared = CUSTOM["shared"]["mountPath"] if which == "custom" else "/optimus"
    for kind, writable in (("Deployment", {"/tmp", shared}),
                           ("Job", {"/tmp", shared, "/dev/shm"})):
        spec, c = pod(objects, kind), main(objects, kind)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert {p for p, m in mounts.items() if not m.get("readOnly")} == writable
        # the agent's sockets and its ranks' control files (tempfile.gettempdir()), caches
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]] and "TMPDIR" not in env_of(c)
        assert env_of(c)["HOME"]["value"] == "/tmp"
        assert "persistentVolumeClaim" in volumes[mounts[shared]["name"]]
        assert c["workingDir"] == shared
    shm = {v["name"]: v for v in pod(objects, "Job")["volumes"]}["shm"]  # in-memory snapshots
    assert shm["emptyDir"]["medium"] == "Memory"


def test_agents_may_run_as_root_for_a_device_and_stay_locked_down(tmp_path):
    objects = render(tmp_path, ROOT_AGENTS)
    valid(objects)
    spec = pod(objects, "Job")
    assert spec["securityContext"]["runAsNonRoot"] is False
    assert "runAsUser" not in spec["securityContext"]  # the image's user
    assert spec["securityContext"]["supplementalGroups"] == [109]
    assert spec["securityContext"]["fsGroup"] == 4343
    for c in containers(spec):
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is False
        assert (sc["allowPrivilegeEscalation"], sc["readOnlyRootFilesystem"]) == (False, True)
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert effective(spec, c, "seccompProfile") == {"type": "RuntimeDefault"}
    controllers = pod(objects, "Deployment")  # the controllers never need root
    assert controllers["securityContext"]["runAsNonRoot"] is True
    assert controllers["securityContext"]["runAsUser"] == 4242
    assert all(effective(controllers, c, "runAsNonRoot") is True
               for c in containers(controllers))


@pytest.mark.parametrize("values, error", [
    ({"security": {"runAsUser": 0, "runAsGroup": 0, "fsGroup": 0}}, "at '/security/runAsUser'"),
    ({"agents": {"runAsNonRoot": "no"}}, "at '/agents/runAsNonRoot'"),
    ({"agents": {"snapshotSecret": "short"}}, "at '/agents/snapshotSecret'"),
    ({"networkPolicy": {"metricsFrom": [{}]}}, "at '/networkPolicy/metricsFrom/0'"),
])
def test_unsafe_values_are_refused_by_the_schema(tmp_path, values, error):
    done = helm("template", RELEASE, str(CHART), values=values, tmp=tmp_path)
    assert done.returncode != 0 and error in done.stderr, done.stderr


# --- NetworkPolicies -------------------------------------------------------------------------


def admits(peer: dict, labels: dict, namespace: dict) -> bool:
    """Whether one `from` peer admits a pod with `labels` in a namespace with `namespace`
    labels (the policy's own namespace is NAMESPACE)."""
    if "ipBlock" in peer:
        return False
    ns = peer.get("namespaceSelector")
    in_ns = selects(ns, namespace) if ns is not None else namespace == RELEASE_NS
    return in_ns and selects(peer.get("podSelector", {}), labels)


def reaches(objects: list[dict], target: str, labels: dict, namespace: dict,
            port: int) -> bool:
    """Whether a pod may open `port` on the pods of kind `target`: each policy that selects
    them (at least one does) must have a rule admitting the peer on that port."""
    target_labels = pod_labels(one(objects, target))
    policies = [o["spec"] for o in objects if o["kind"] == "NetworkPolicy"
                and selects(o["spec"]["podSelector"], target_labels)]
    assert policies and all("Ingress" in p["policyTypes"] for p in policies)
    return any(any(admits(peer, labels, namespace) for peer in rule.get("from", []))
               and ("ports" not in rule or {"protocol": "TCP", "port": port} in rule["ports"])
               for p in policies for rule in p.get("ingress", []))


@pytest.mark.parametrize("which", ["default", "custom"])
def test_agents_are_reached_by_this_releases_agents_only(which, request):
    objects = request.getfixturevalue(which)
    agent, controller = pod_labels(one(objects, "Job")), pod_labels(one(objects, "Deployment"))
    other_release = {**agent, "app.kubernetes.io/instance": "other"}
    # The controllers reach the snapshot server's port alone, to learn whether a silent
    # agent's pod still answers (controller/common/probe.py); the agent listens there.
    snapshot = 9311 if which == "custom" else 7790
    assert reaches(objects, "Job", controller, RELEASE_NS, snapshot)
    env = {e["name"]: e.get("value") for e in main(objects, "Job")["env"]}
    assert env["OPTIMUS_SNAPSHOT_PORT"] == str(snapshot)
    assert not reaches(objects, "Job", controller, RELEASE_NS, snapshot + 1)
    assert not reaches(objects, "Job", pod_labels(one(objects, "StatefulSet")), RELEASE_NS,
                       snapshot)
    assert not reaches(objects, "Job", other_release, RELEASE_NS, snapshot)
    # Ports are picked at run time (the rendezvous, gloo/NCCL): any port, agents only.
    for port in (20000, 34567, 61000):
        assert reaches(objects, "Job", agent, RELEASE_NS, port)
        assert not reaches(objects, "Job", controller, RELEASE_NS, port)
        assert not reaches(objects, "Job", pod_labels(one(objects, "StatefulSet")), RELEASE_NS,
                           port)
        assert not reaches(objects, "Job", other_release, RELEASE_NS, port)
        assert not reaches(objects, "Job", {"app": "anything"}, RELEASE_NS, port)
        assert not reaches(objects, "Job", agent, {"kubernetes.io/metadata.name": "x"}, port)
        assert not reaches(objects, "Job", PROMETHEUS, MONITORING_NS, port)


@pytest.mark.parametrize("which", ["default", "custom"])
def test_metrics_are_reached_by_the_monitoring_pods_only(which, request):
    objects = request.getfixturevalue(which)
    port = main(objects, "Deployment")["ports"][0]["containerPort"]
    assert port == (9800 if which == "custom" else 9780)
    assert reaches(objects, "Deployment", PROMETHEUS, MONITORING_NS, port)
    assert not reaches(objects, "Deployment", PROMETHEUS, MONITORING_NS, port + 1)
    assert not reaches(objects, "Deployment", PROMETHEUS, RELEASE_NS, port)
    assert not reaches(objects, "Deployment", {"app": "anything"}, MONITORING_NS, port)
    for kind in PODS:  # no pod of the release: agents hold the agent password, not metrics
        assert not reaches(objects, "Deployment", pod_labels(one(objects, kind)), RELEASE_NS,
                           port)


def test_the_scrapers_are_a_value_and_none_means_nobody(tmp_path):
    vmagent = {"app": "vmagent"}
    objects = render(tmp_path, {"networkPolicy": {"metricsFrom": [
        {"podSelector": {"matchLabels": vmagent}}]}})
    valid(objects)
    assert reaches(objects, "Deployment", vmagent, RELEASE_NS, 9780)
    assert not reaches(objects, "Deployment", PROMETHEUS, MONITORING_NS, 9780)
    objects = render(tmp_path, {"networkPolicy": {"metricsFrom": []}})
    valid(objects)
    policy = one(objects, "NetworkPolicy", "-controller")["spec"]
    assert policy["ingress"] == [] and policy["policyTypes"] == ["Ingress"]  # not: everyone
    for labels, namespace in ((PROMETHEUS, MONITORING_NS), (vmagent, RELEASE_NS)):
        assert not reaches(objects, "Deployment", labels, namespace, 9780)
    objects = render(tmp_path, {"networkPolicy": {"enabled": False}})
    assert not [o for o in objects if o["kind"] == "NetworkPolicy"]


# --- the agents' snapshot key ----------------------------------------------------------------


def snapshot_key(objects: list[dict]) -> tuple[dict, str]:
    """The agents' reference to their key, and the key the Secret it names holds."""
    ref = env_of(main(objects, "Job"))["OPTIMUS_SNAPSHOT_SECRET"]
    assert set(ref) == {"name", "valueFrom"}  # no literal value in the pod spec
    key_ref = ref["valueFrom"]["secretKeyRef"]
    (secret,) = [o for o in objects
                 if o["kind"] == "Secret" and o["metadata"]["name"] == key_ref["name"]]
    return key_ref, base64.b64decode(secret["data"][key_ref["key"]]).decode()


@pytest.mark.parametrize("which", ["default", "custom"])
def test_agents_get_the_snapshot_key_from_a_secret_and_nobody_else_does(which, request):
    objects = request.getfixturevalue(which)
    key_ref, key = snapshot_key(objects)
    assert len(key) >= 32
    assert key_ref["name"] != one(objects, "Secret", "-redis-auth")["metadata"]["name"]
    for obj in objects:  # the key itself is nowhere else, in clear or base64
        if obj["kind"] != "Secret":
            text = json.dumps(obj)
            assert key not in text and base64.b64encode(key.encode()).decode() not in text
    for kind in ("Deployment", "StatefulSet"):
        spec = json.dumps(one(objects, kind))
        assert key_ref["name"] not in spec and "OPTIMUS_SNAPSHOT_SECRET" not in spec


def test_the_snapshot_key_is_random_per_release_or_given(tmp_path):
    first, second = (snapshot_key(render(tmp_path))[1] for _ in range(2))
    assert first != second and len(first) == 64 and first.isalnum()
    given = "k" * 20 + "-0123456789abcdef"
    assert snapshot_key(render(tmp_path, {"agents": {"snapshotSecret": given}}))[1] == given


def test_the_key_the_chart_hands_over_is_the_key_the_agents_use(default, monkeypatch):
    from controller.node.snapshots import job_secret  # what the agent calls

    _, key = snapshot_key(default)
    monkeypatch.setenv("REDIS_URL", f"redis://optimus-agent:pw@{RELEASE}-optimus-redis:6379/0")
    monkeypatch.delenv("OPTIMUS_SNAPSHOT_SECRET_FILE", raising=False)
    monkeypatch.setenv("OPTIMUS_SNAPSHOT_SECRET", key)
    given = job_secret()
    assert given  # long enough to be a key: the agent serves and sends with it
    # One character changed (a random key starts with "x" one time in 62: CI, once).
    monkeypatch.setenv("OPTIMUS_SNAPSHOT_SECRET", ("y" if key[0] == "x" else "x") + key[1:])
    assert job_secret() != given  # the key decides, not the URL or the job
