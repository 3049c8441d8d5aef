"""The Helm chart (charts/optimus), rendered by the real `helm` (`make helm` installs it).

Every rendered object is validated against the Kubernetes schemas of KUBERNETES
(kubernetes-validate, strict: unknown fields fail); the Prometheus Operator's objects have no
schema there and are checked field by field below. Nothing here talks to a cluster.
"""

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "optimus"
KUBERNETES = "1.33.0"
RELEASE, NAMESPACE = "gpt", "training"


def _helm() -> str | None:
    beside = Path(sys.executable).parent / "helm"  # where `make helm` puts it
    return os.environ.get("HELM") or shutil.which("helm") or (str(beside) if beside.exists()
                                                              else None)


HELM = _helm()
pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (`make helm`, or "
                                "$HELM naming the binary)")

# Every optional part on, and every count away from its default.
CUSTOM = {
    "image": {"repository": "registry.example/optimus", "tag": "2026.1"},
    "job": {"nodes": 4, "spares": 2, "ranksPerNode": 8, "set": ["optim.steps=500"],
            "file": (ROOT / "jobs" / "gpt-1.3b.yaml").read_text()},
    "agents": {"accelerator": {"resource": "gpu.intel.com/i915", "count": 8},
               "hostNetwork": True, "env": [{"name": "ZE_FLAT_DEVICE_HIERARCHY", "value": "FLAT"}],
               "nodeSelector": {"pool": "gpu"}, "snapshotPort": 9311},
    "redis": {"passwords": {"controller": "c-secret", "operator": "o-secret"}},
    "shared": {"existingClaim": "lustre-scratch", "mountPath": "/lustre/optimus"},
    "networkPolicy": {"extraFrom": [{"ipBlock": {"cidr": "10.0.0.0/16"}}]},
    "monitoring": {"port": 9800,
                   "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                   "prometheusRule": {"enabled": True},
                   "dashboard": {"namespace": "grafana"}},
}


def helm(*args: str, values: dict | None = None, tmp: Path | None = None):
    cmd = [HELM, *args]
    if values is not None:
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def render(tmp: Path, values: dict | None = None) -> list[dict]:
    done = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                "--kube-version", KUBERNETES, values=values, tmp=tmp)
    assert done.returncode == 0, done.stderr
    return [o for o in yaml.safe_load_all(done.stdout) if o]


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    return render(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    return render(tmp_path_factory.mktemp("custom"), CUSTOM)


def one(objects: list[dict], kind: str, suffix: str = "") -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, (kind, suffix, [o["metadata"]["name"] for o in found])
    return found[0]


def agent_jobs(objects: list[dict]) -> list[dict]:
    """The agents' Jobs, in index order."""
    jobs = [o for o in objects if o["kind"] == "Job"]
    return sorted(jobs, key=lambda o: int(o["metadata"]["labels"]["optimus.dev/agent-index"]))


AGENT0 = "-agents-0"  # one(objects, "Job", AGENT0): the first agent's Job


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and In/NotIn/Exists) applied to labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, vals = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in vals,
              "NotIn": labels.get(key) not in vals,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod_labels(obj: dict) -> dict:
    return obj["spec"]["template"]["metadata"]["labels"]


def container(obj: dict) -> dict:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def env(c: dict) -> dict:
    return {e["name"]: e for e in c["env"]}


def secret_data(objects: list[dict]) -> dict[str, str]:
    secret = one(objects, "Secret", "-redis-auth")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_lint(tmp_path):
    for values in (None, CUSTOM):
        done = helm("lint", "--strict", str(CHART), values=values, tmp=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "0 chart(s) failed" in done.stdout


def test_every_object_matches_the_kubernetes_schemas(default, custom):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e .[dev]")

    for objects in (default, custom):
        for obj in objects:
            if obj["apiVersion"] == "monitoring.coreos.com/v1":
                continue  # a CRD: no schema offline; test_monitoring checks its fields
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    kinds = sorted(o["kind"] for o in custom)
    agents = CUSTOM["job"]["nodes"] + CUSTOM["job"]["spares"]
    assert kinds == sorted(["ConfigMap"] * 3 + ["NetworkPolicy"] * 3 + ["Secret"] * (2 + agents)
                           + ["Job"] * agents + [
                            "Deployment", "PodDisruptionBudget", "PrometheusRule",
                            "Service", "Service", "Service", "ServiceAccount", "ServiceMonitor",
                            "StatefulSet"])
    # the default creates the shared volume itself (the custom values name an existing one)
    pvc = one(default, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("values, error", [
    ({"job": {"nodes": 0}}, "at '/job/nodes': minimum: got 0, want 1"),
    ({"job": {"nodes": "two"}}, "at '/job/nodes': got string, want integer"),
    ({"job": {"spares": -1}}, "at '/job/spares': minimum"),
    ({"job": {"file": "seed: 1\n"}}, "at '/job/file'"),
    ({"agents": {"replicas": 3}}, "additional properties 'replicas' not allowed"),
    ({"agents": {"hostNetwork": "yes"}}, "at '/agents/hostNetwork': got string, want boolean"),
    ({"redis": {"passwords": {"operator": "p@ss/word"}}}, "at '/redis/passwords/operator'"),
    ({"redis": {"passwords": {"agent": "shared"}}}, "additional properties 'agent' not allowed"),
    ({"monitoring": {"port": 70000}}, "at '/monitoring/port': maximum"),
    ({"nodes": 4}, "additional properties 'nodes' not allowed"),
])
def test_bad_values_are_refused_by_the_schema(tmp_path, values, error):
    done = helm("template", RELEASE, str(CHART), values=values, tmp=tmp_path)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert error in done.stderr, done.stderr


def test_more_agents_than_one_secret_holds_users_for_are_refused_in_one_line(tmp_path):
    done = helm("template", RELEASE, str(CHART), values={"job": {"nodes": 2000}}, tmp=tmp_path)
    assert done.returncode != 0
    assert ("job.nodes + job.spares = 2001 agents: their Redis users (" in done.stderr
            and "do not fit the 1 MiB of one Secret" in done.stderr), done.stderr


@pytest.mark.parametrize("which", ["default", "custom"])
def test_one_agent_per_node_nodes_plus_spares(which, request):
    objects = request.getfixturevalue(which)
    values = CUSTOM["job"] if which == "custom" else {"nodes": 2, "spares": 1}
    jobs = agent_jobs(objects)
    assert len(jobs) == values["nodes"] + values["spares"]
    job_file = yaml.safe_load(one(objects, "ConfigMap", "-job")["data"]["job.yaml"])
    service = one(objects, "Service", "-agents")
    assert service["spec"]["clusterIP"] == "None"
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    referred: dict[str, str] = {}  # Secret -> the one Job whose pods refer to it
    for i, job in enumerate(jobs):
        name = f"{RELEASE}-optimus-agents-{i}"
        spec, pod = job["spec"], job["spec"]["template"]["spec"]
        assert job["metadata"]["name"] == name and "completionMode" not in spec
        assert spec["completions"] == spec["parallelism"] == 1
        assert spec["backoffLimit"] == 3
        (term,) = pod["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        for other in jobs:  # repels every agent...
            assert selects(term["labelSelector"], pod_labels(other))
        for other in ("Deployment", "StatefulSet"):  # ...and no other pod of the job
            assert not selects(term["labelSelector"], pod_labels(one(objects, other)))
        agent = container(job)
        assert agent["command"] == ["optimus", "agent"]
        args = agent["args"]
        assert args[args.index("--job") + 1] == job_file["name"]
        assert args[args.index("--node") + 1] == name  # the name its Redis user is made for
        assert env(agent)["REDIS_URL"]["value"] == (
            f"redis://optimus-node-{name}:$(REDIS_PASSWORD)@{RELEASE}-optimus-redis:6379/0")
        ref = env(agent)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": name, "key": "password"} and name in secrets
        for secret in secrets:  # no other Secret holding a Redis password is in its spec
            if secret != f"{RELEASE}-optimus-snapshot" and secret in json.dumps(job):
                assert referred.setdefault(secret, name) == name, (secret, name)
        # rendezvous: its hostname is its name, in the headless Service that selects it
        assert pod["hostname"] == name and pod["subdomain"] == service["metadata"]["name"]
        assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(job))
    assert referred == {f"{RELEASE}-optimus-agents-{i}": f"{RELEASE}-optimus-agents-{i}"
                        for i in range(len(jobs))}
    # the agents differ in their name and index only
    def generic(i: int) -> str:
        return (json.dumps(jobs[i]).replace(f"{RELEASE}-optimus-agents-{i}", "NAME")
                .replace(f'"optimus.dev/agent-index": "{i}"', "INDEX"))
    assert all(generic(i) == generic(0) for i in range(len(jobs)))


def test_agents_accelerators_and_host_network(default, custom):
    pod = one(custom, "Job", AGENT0)["spec"]["template"]["spec"]
    assert container(one(custom, "Job", AGENT0))["resources"]["limits"] == {
        "gpu.intel.com/i915": 8}
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert env(container(one(custom, "Job", AGENT0)))["ZE_FLAT_DEVICE_HIERARCHY"]["value"] == (
        "FLAT")
    pod = one(default, "Job", AGENT0)["spec"]["template"]["spec"]
    assert "limits" not in container(one(default, "Job", AGENT0))["resources"]  # CPU only
    assert "hostNetwork" not in pod
    assert pod["dnsConfig"]["searches"] == [
        f"{RELEASE}-optimus-agents.{NAMESPACE}.svc.cluster.local"]


def test_controllers_leader_and_standby(custom):
    deployment = one(custom, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    ctl = container(deployment)
    args = ctl["args"]
    assert args[0] == "/etc/optimus/job.yaml"
    assert args[args.index("--nodes") + 1] == "4"
    assert args[args.index("--ranks-per-node") + 1] == "8"
    assert args[args.index("--metrics-port") + 1] == "9800"
    assert args[args.index("--set") + 1] == "optim.steps=500"
    names = [e["name"] for e in ctl["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL")  # $(...) expands in order
    assert env(ctl)["REDIS_URL"]["value"] == (
        f"redis://optimus-controller:$(REDIS_PASSWORD)@{RELEASE}-optimus-redis:6379/0")
    assert ctl["ports"] == [{"name": "metrics", "containerPort": 9800}]
    # the job file and the shared volume at the same paths for controllers and agents
    for obj in (deployment, one(custom, "Job", AGENT0)):
        volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
        assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "lustre-scratch"
        mounts = {m["name"]: m["mountPath"] for m in container(obj)["volumeMounts"]}
        assert mounts["shared"] == container(obj)["workingDir"] == "/lustre/optimus"
        assert mounts["job"] == "/etc/optimus"
        (wait,) = obj["spec"]["template"]["spec"]["initContainers"]  # Redis up before them
        assert f"(\"{RELEASE}-optimus-redis\", 6379)" in wait["command"][-1]
    pdb = one(custom, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert selects(pdb["spec"]["selector"], pod_labels(deployment))


def _acl_rules(text: str) -> dict[str, list[str]]:
    """Each user's rules, its password (>clear or #sha256) left out."""
    users = {}
    for line in text.splitlines():
        if line.startswith("user "):
            _, name, *rules = line.split()
            users[name] = [r for r in rules if not r.startswith((">", "#"))]
    return users


@pytest.mark.parametrize("which", ["default", "custom"])
def test_redis_users_are_the_acl_files_and_none_is_unauthenticated(which, request):
    from controller.store.acl import file_lines

    objects = request.getfixturevalue(which)
    data = secret_data(objects)
    acl = data["users.acl"]
    job = yaml.safe_load(one(objects, "ConfigMap", "-job")["data"]["job.yaml"])["name"]
    agents = [f"{RELEASE}-optimus-agents-{i}" for i in range(len(agent_jobs(objects)))]
    site = _acl_rules((ROOT / "deploy" / "redis-users.acl").read_text())
    del site["optimus-agent"]  # no shared agent user: one per agent
    assert _acl_rules(acl) == {**site, **_acl_rules("\n".join(file_lines(job, agents)))}
    (default,) = [line for line in acl.splitlines() if line.startswith("user default ")]
    assert default.startswith("user default off resetpass ")  # nobody logs in as it
    assert "nopass" not in acl
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    passwords = {f"optimus-{u}": data[f"{u}-password"] for u in ("controller", "operator")}
    passwords |= {f"optimus-node-{a}": base64.b64decode(secrets[a]["data"]["password"]).decode()
                  for a in agents}
    for user, password in passwords.items():
        (line,) = [x for x in acl.splitlines() if x.startswith(f"user {user} ")]
        (hashed,) = [r for r in line.split() if r.startswith("#")]
        assert len(password) >= 8 and hashed[1:] == hashlib.sha256(password.encode()).hexdigest()
        assert ">" + password not in acl  # never in clear
    assert len(set(passwords.values())) == len(passwords)  # one password each
    assert set(data) == {"controller-password", "operator-password", "users.acl"}
    if which == "custom":
        assert data["operator-password"] == "o-secret"
    # the server reads that file: redis.conf names it where the Secret is mounted
    conf = one(objects, "ConfigMap", "-redis")["data"]["redis.conf"].splitlines()
    assert "appendonly yes" in conf
    redis = one(objects, "StatefulSet")
    mounts = {m["name"]: m["mountPath"] for m in container(redis)["volumeMounts"]}
    volumes = {v["name"]: v for v in redis["spec"]["template"]["spec"]["volumes"]}
    (item,) = volumes["acl"]["secret"]["items"]
    assert f"aclfile {mounts['acl']}/{item['path']}" in conf and item["key"] == "users.acl"
    assert container(redis)["command"] == ["redis-server", mounts["config"]]
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data" and mounts["data"] == "/data"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_a_real_redis_with_the_rendered_acl_refuses_anonymous_clients(custom, tmp_path):
    import redis

    data = secret_data(custom)
    (tmp_path / "users.acl").write_text(data["users.acl"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = one(custom, "ConfigMap", "-redis")["data"]["redis.conf"]
    conf = conf.replace("port 6379", f"port {port}").replace("dir /data", f"dir {tmp_path}")
    conf = conf.replace("aclfile /etc/redis/acl/users.acl", f"aclfile {tmp_path}/users.acl")
    (tmp_path / "redis.conf").write_text(conf + "bind 127.0.0.1\nsave \"\"\n")
    server = subprocess.Popen(["redis-server", str(tmp_path / "redis.conf")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        anonymous = redis.Redis(port=port, socket_timeout=5)
        for _ in range(100):
            try:
                anonymous.ping()
                pytest.fail("an unauthenticated PING was answered")
            except redis.AuthenticationError:
                break  # NOAUTH: up, and refusing
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not start")
        job = yaml.safe_load(CUSTOM["job"]["file"])["name"]
        secrets = {o["metadata"]["name"]: o for o in custom if o["kind"] == "Secret"}

        def agent(i: int):
            name = f"{RELEASE}-optimus-agents-{i}"
            password = base64.b64decode(secrets[name]["data"]["password"]).decode()
            return name, redis.Redis(port=port, username=f"optimus-node-{name}",
                                     password=password, socket_timeout=5)
        (me, mine), (other, _) = agent(0), agent(1)
        mine.set(f"optimus:{{{job}}}:node:{me}:row", "1")  # its node's own keys
        mine.lpop(f"optimus:{{{job}}}:commands:{me}")
        for write in (lambda: mine.set(f"optimus:{{{job}}}:node:{other}:row", "1"),
                      lambda: mine.lpop(f"optimus:{{{job}}}:commands:{other}"),
                      lambda: mine.rpush(f"optimus:{{{job}}}:commands:{other}", "kill_node"),
                      lambda: mine.set(f"optimus:{{{job}}}:plan", "x"),  # read-only to agents
                      lambda: mine.zadd(f"optimus:{{{job}}}:beats", {me: 1})):  # relayed
            with pytest.raises(redis.exceptions.NoPermissionError):
                write()
        with pytest.raises(redis.AuthenticationError):  # one agent's password is not another's
            redis.Redis(port=port, username=f"optimus-node-{other}",
                        password=mine.connection_pool.connection_kwargs["password"]).ping()
        ctl = redis.Redis(port=port, username="optimus-controller",
                          password=data["controller-password"], socket_timeout=5)
        ctl.set("optimus:tiny-gpt:plan", "x")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="optimus-controller", password="wrong").ping()
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.parametrize("which", ["default", "custom"])
def test_only_the_jobs_pods_reach_redis(which, request):
    objects = request.getfixturevalue(which)
    policy = one(objects, "NetworkPolicy", "-redis")["spec"]
    redis_pods = pod_labels(one(objects, "StatefulSet"))
    assert selects(policy["podSelector"], redis_pods) and policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    pods = [peer["podSelector"] for peer in rule["from"] if "podSelector" in peer]
    (selector,) = pods
    assert not any("namespaceSelector" in peer for peer in rule["from"])  # this namespace only
    allowed = lambda labels: selects(selector, labels)  # noqa: E731
    assert allowed(pod_labels(one(objects, "Deployment")))
    assert all(allowed(pod_labels(job)) for job in agent_jobs(objects))
    other_release = {**pod_labels(one(objects, "Job", AGENT0)),
                     "app.kubernetes.io/instance": "other"}
    assert not allowed(other_release) and not allowed({"app": "anything"})
    assert not allowed(redis_pods)  # nor any other pod of this release
    extra = [peer for peer in rule["from"] if "podSelector" not in peer]
    assert extra == ([{"ipBlock": {"cidr": "10.0.0.0/16"}}] if which == "custom" else [])


def test_monitoring(default, custom):
    repo_dashboard = (ROOT / "monitoring" / "grafana" / "dashboards" / "optimus.json").read_text()
    assert (CHART / "files" / "optimus.json").read_text() == repo_dashboard
    for objects in (default, custom):
        dashboard = one(objects, "ConfigMap", "-dashboard")
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert dashboard["data"]["optimus.json"] == repo_dashboard
        json.loads(dashboard["data"]["optimus.json"])
    assert one(custom, "ConfigMap", "-dashboard")["metadata"]["namespace"] == "grafana"
    # the exporter: one endpoint per controller pod, on the port the controllers serve
    for objects, port in ((default, 9780), (custom, 9800)):
        service = one(objects, "Service", "-metrics")
        assert selects({"matchLabels": service["spec"]["selector"]},
                       pod_labels(one(objects, "Deployment")))
        assert service["spec"]["ports"] == [{"name": "metrics", "port": port,
                                             "targetPort": "metrics"}]
    assert not [o for o in default if o["apiVersion"] == "monitoring.coreos.com/v1"]
    monitor = one(custom, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "interval": "15s"}]
    service = one(custom, "Service", "-metrics")
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    rules = yaml.safe_load((ROOT / "monitoring" / "prometheus" / "alerts.yml").read_text())
    assert (CHART / "files" / "alerts.yml").read_text() == (
        ROOT / "monitoring" / "prometheus" / "alerts.yml").read_text()
    assert one(custom, "PrometheusRule")["spec"] == rules
