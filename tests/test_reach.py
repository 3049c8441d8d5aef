"""Where a node is reached (controller/common/reach.py) and which interface its ranks use
(optimus/runtime/network.py, the job's `network` section and site profiles): a node that
advertises loopback while another runs on another host is refused in one line, by its agent at
registration and by the controller, whichever learns first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from controller.common import reach
from controller.control.controller import Controller
from controller.control.settings import settings_for
from controller.store.store import Store
from optimus.config import ConfigError, load_job
from optimus.runtime.network import apply_network, collective_env, interface_env
from tests.cluster import relay, wait_for, write_job

# --- the address -------------------------------------------------------------------------------


def test_loopback_names_the_address_a_host_resolves_to():
    assert reach.loopback("127.0.1.1") == "127.0.1.1"  # Debian's own-hostname entry
    assert reach.loopback("::1") == "::1"
    assert reach.loopback("localhost") in ("127.0.0.1", "::1")
    assert reach.loopback("10.231.0.11") == ""
    assert reach.loopback("no-such-host.invalid") == ""  # unresolvable: not judged loopback


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="a network namespace of its own needs root and unshare")
def test_machine_differs_exactly_across_network_namespaces():
    here = reach.machine()
    assert here == reach.machine()
    code = "from controller.common import reach; print(reach.machine())"
    same = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()
    other = subprocess.run(["unshare", "--net", sys.executable, "-c", code],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert same == here
    boot, netns = other.split("/")
    assert boot == here.split("/")[0] and netns != here.split("/")[1]


def test_interface_address_of_loopback_and_a_missing_interface():
    assert reach.interface_address("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match=r"nope0 is no interface of this host; .*\blo\b"):
        reach.interface_address("nope0")


def test_isolated_only_when_another_node_runs_on_another_machine():
    bad = {"host": "node0", "loopback": "127.0.1.1", "machine": "boot-a/1"}
    good = {"host": "10.0.0.2", "loopback": "", "machine": "boot-b/1"}
    twin = {"host": "node1", "loopback": "127.0.1.1", "machine": "boot-a/1"}
    why = reach.isolated("node0", bad, {"node0": bad, "node1": good})
    assert why.startswith("node node0 advertises host 'node0', which resolves to 127.0.1.1 "
                          "(loopback) on its machine, while node1 runs on another")
    assert "--host ADDR" in why and "OPTIMUS_HOST" in why and "--interface" in why
    assert reach.isolated("node1", good, {"node0": bad, "node1": good}) is None
    # one machine of simulated nodes (`optimus run`): loopback reaches them all
    assert reach.isolated("node0", bad, {"node0": bad, "node1": twin}) is None
    # an agent that says no machine (older) is not judged, nor judged against
    assert reach.isolated("node0", {**bad, "machine": None}, {"node1": good}) is None
    assert reach.isolated("node0", bad, {"node0": bad, "node1": {"host": "x"}}) is None
    # what an agent wrote is untrusted: a loopback that is no string is not acted on
    assert reach.isolated("node0", {**bad, "loopback": ["127.0.0.1"]}, {"node1": good}) is None


# --- the refusal, by the agent and by the controller --------------------------------------------


def _foreign_node(store: Store, name: str = "node1") -> None:
    """A node registered from another machine (its record as its agent would write it)."""
    agent = Store(store.url, store.job)
    agent.own.speak_as(name)
    agent.own.register_node(name, {"host": "10.231.0.12", "loopback": "", "machine": "elsewhere/7",
                               "health": "ok", "devices": 1, "snapshot_addr": ""})
    relay(store)


def test_an_agent_advertising_loopback_is_refused_at_registration(redis_server, procs, tmp_path):
    store = Store(redis_server.url, "reach")
    _foreign_node(store)
    p = procs.start("agent0", "agent", "--job", "reach", "--node", "node0", "--redis",
                    redis_server.url, "--interval", "0.25", "--host", "127.0.1.1")
    assert p.wait(timeout=60) == 2
    out = procs.log("agent0").strip().splitlines()
    refusal = [line for line in out if "advertises host '127.0.1.1'" in line]
    assert len(refusal) == 1 and "Traceback" not in procs.log("agent0"), out[-10:]
    assert "while node1 runs on another" in refusal[0] and "--host ADDR" in refusal[0]
    relay(store)
    (event,) = [e for _, e in store.events(count=1000) if e["kind"] == "node_refused"]
    assert event["node"] == "node0" and "127.0.1.1" in event["message"]
    assert store.agent_status(["node0"])["node0"]["state"] == "gone"


def test_the_controller_refuses_an_isolated_node_and_tells_its_agent(redis_server, procs,
                                                                      tmp_path):
    """Registered first (or under ACLs, which let an agent read no other node's record), the
    loopback node is found by the controller: never planned on, one event, and its agent told
    (it leaves with the controller's line)."""
    run = tmp_path / "run"
    job_path = write_job(tmp_path / "job.yaml", run, name="reach", steps=5)
    p = procs.start("agent0", "agent", "--job", "reach", "--node", "node0", "--redis",
                    redis_server.url, "--interval", "0.25", "--host", "127.0.1.1")
    store = Store(redis_server.url, "reach")
    wait_for(lambda: relay(store) is not None and "node0" in store.nodes(), 60,
             "node0's registration")
    assert p.poll() is None  # alone, nothing says it is unreachable yet
    _foreign_node(store)
    job = load_job(job_path)
    controller = Controller(store, job, settings_for(job, str(job_path), [], 2, 1),
                            ident="test-controller")
    try:
        controller.tick()
        obs = controller.observe()
        assert not obs.nodes["node0"].healthy
        assert obs.nodes["node0"].health.startswith("node node0 advertises host '127.0.1.1'")
        assert obs.nodes["node1"].healthy
        controller.tick()  # said once, not every tick
    finally:
        controller.release()
    refused = [e for _, e in store.events(count=1000) if e["kind"] == "node_refused"]
    assert [e["node"] for e in refused] == ["node0"]
    assert store.plan() is None or "node0" not in store.plan()["nodes"]
    assert p.wait(timeout=60) == 2
    assert "advertises host '127.0.1.1'" in procs.log("agent0")


def test_a_refusal_command_moves_no_agent_whose_address_is_not_loopback(redis_server, procs):
    """The command says only why; the agent acts on its own fact (its address is loopback)."""
    store = Store(redis_server.url, "reach")
    p = procs.start("agent0", "agent", "--job", "reach", "--node", "node0", "--redis",
                    redis_server.url, "--interval", "0.25", "--host", "10.231.0.11")
    wait_for(lambda: relay(store) is not None and "node0" in store.nodes(), 60,
             "node0's registration")
    store.push_command("node0", {"kind": "refused", "why": "a forged refusal"})
    wait_for(lambda: store.r.llen(store.k("commands:node0")) == 0, 30, "the command taken")
    time.sleep(1.0)  # a tick or more after it was taken
    assert p.poll() is None
    assert json.loads(store.r.hget(store.k("nodes"), "node0"))["loopback"] == ""


# --- the ranks' interface -------------------------------------------------------------------------


def test_one_interface_named_for_every_collective_library():
    assert interface_env("hsn0") == {"GLOO_SOCKET_IFNAME": "hsn0", "NCCL_SOCKET_IFNAME": "=hsn0",
                                     "CCL_KVS_IFACE": "hsn0", "FI_TCP_IFACE": "hsn0"}
    # what the rank's environment says already wins: a node knows its own hardware
    got = collective_env("hsn0", {"FI_CXI_OFLOW_BUF_SIZE": "8388608"},
                         {"GLOO_SOCKET_IFNAME": "ib0"})
    assert got == {"NCCL_SOCKET_IFNAME": "=hsn0", "CCL_KVS_IFACE": "hsn0",
                   "FI_TCP_IFACE": "hsn0", "FI_CXI_OFLOW_BUF_SIZE": "8388608"}


def _job(tmp_path, **extra) -> object:
    path = tmp_path / "jobs" / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"name": "net", **extra}))
    return path


def test_the_job_names_the_interface_and_the_rank_sets_it(tmp_path):
    job = load_job(_job(tmp_path, network={"interface": "eth1", "env": {"NCCL_IB_TIMEOUT": "22"}}))
    environ = {"PATH": "/bin", "NCCL_SOCKET_IFNAME": "=ib0"}
    added = apply_network(job.network, environ)
    assert environ["GLOO_SOCKET_IFNAME"] == "eth1" and environ["NCCL_SOCKET_IFNAME"] == "=ib0"
    assert environ["NCCL_IB_TIMEOUT"] == "22" and "NCCL_SOCKET_IFNAME" not in added
    assert apply_network(load_job(_job(tmp_path)).network, environ) == {}


@pytest.mark.parametrize("network, said", [
    ({"interface": "eth0; rm -rf"}, "is not an interface name"),
    ({"interface": "a-very-long-interface"}, "is not an interface name"),
    ({"env": {"MASTER_ADDR": "10.0.0.1"}}, "'MASTER_ADDR' is reserved"),
    ({"env": {"REDIS_URL": "redis://x"}}, "'REDIS_URL' is reserved"),
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "'LD_PRELOAD' is reserved"),
    ({"env": {"lower": "1"}}, "is not an environment variable name"),
])
def test_a_bad_network_section_is_refused_in_one_line(tmp_path, network, said):
    with pytest.raises(ConfigError, match=said) as e:
        load_job(_job(tmp_path, network=network))
    assert "Traceback" not in str(e.value)


def test_a_site_profile_is_the_default_of_the_jobs_network(tmp_path):
    sites = tmp_path / "jobs" / "sites"
    sites.mkdir(parents=True)
    (sites / "lab.yaml").write_text(yaml.safe_dump({
        "description": "a lab", "network": {"interface": "hsn0",
                                            "env": {"FI_A": "1", "FI_B": "2"}}}))
    job = load_job(_job(tmp_path, site="lab", network={"env": {"FI_B": "3"}}))
    assert job.network.interface == "hsn0" and job.network.env == {"FI_A": "1", "FI_B": "3"}
    job = load_job(_job(tmp_path, site="lab", network={"interface": "ib0"}))
    assert job.network.interface == "ib0" and job.network.env == {"FI_A": "1", "FI_B": "2"}
    with pytest.raises(ConfigError, match=r"no site profile 'other'.*name one of lab"):
        load_job(_job(tmp_path, site="other"))
    (sites / "bad.yaml").write_text(yaml.safe_dump({"network": {}, "optim": {"lr": 1.0}}))
    with pytest.raises(ConfigError, match="a site profile is a mapping of description and "
                                          "network, not optim"):
        load_job(_job(tmp_path, site="bad"))
    with pytest.raises(ConfigError, match="site"):
        load_job(_job(tmp_path, site="../etc"))


def test_the_shipped_site_profiles_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "jobs"
    names = sorted(p.stem for p in (root / "sites").glob("*.yaml"))
    assert names == ["aurora", "nvidia-slurm", "supermuc-ng"]
    for name in names:
        raw = yaml.safe_load((root / "tiny-gpt.yaml").read_text())
        path = root / f"_site_check_{name}.yaml"
        try:
            path.write_text(yaml.safe_dump({**raw, "site": name}))
            job = load_job(path)
        finally:
            path.unlink()
        assert job.network.interface and job.site == name
