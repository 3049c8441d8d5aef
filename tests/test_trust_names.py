"""Names from nodes (docs/security.md): a node name is a hostname, checked wherever one enters.

The attack: whoever holds the agent password writes a node named like a script line
("n9\\nhostname #") into the node records; the controller excludes it, journals it in
`controller.json`, and the next `optimus submit slurm` writes it raw into `#SBATCH --exclude=`,
where the second line runs as the job's user. Here that name is refused at every door: the
agent's --node, the records the controller reads from a real Redis, the journal, and both
schedulers' scripts.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml
from click.testing import CliRunner
from cluster import write_job

from controller.cli.main import main
from controller.control.controller import Controller
from controller.control.journal import read_journal
from controller.control.settings import settings_for
from controller.schedulers.slurm import known_bad
from controller.store.names import is_node_name
from controller.store.store import Store
from optimus.config import ConfigError, validate_job

SCRIPT_LINE = "n9\nhostname #"  # in #SBATCH --exclude=, its second line runs `hostname`
UNHEALTHY = "n8\nreboot #"


@pytest.mark.parametrize("name", [
    "n0", "node-1", "nid001234", "x1000c0s0b0n0", "gpu_07", "n1.cluster.example.org",
    "a" * 63, ".".join(["a" * 63] * 3 + ["a" * 61]),  # 253 in all
])
def test_hostnames_are_node_names(name):
    assert is_node_name(name)


@pytest.mark.parametrize("name", [
    "", "a b", SCRIPT_LINE, "n9\n", "n1;reboot", "$(id)", "n1,n2", "n[1-4]", "-n1", "n1.-x",
    "a..b", ".a", "a.", "a" * 64, ".".join(["a" * 63] * 3 + ["a" * 62]),  # 254
    "n1@7", "ranks:n1", "../n1", "[/x]", "$\\foo{$", "nœud", None, 7,
])
def test_anything_else_is_not(name):
    assert not is_node_name(name)


@pytest.mark.parametrize("name", ["a b", SCRIPT_LINE, "-x"])
def test_the_agent_refuses_a_node_name_that_is_no_hostname(name):
    out = CliRunner().invoke(main, ["agent", "--job", "j", "--node", name,
                                    "--redis", "redis://127.0.0.1:1/0"])
    assert out.exit_code == 2, out.output
    assert "Invalid value for '--node'" in out.output and "is not a node name" in out.output
    assert "Traceback" not in out.output


def test_the_store_refuses_to_register_a_node_name_that_is_no_hostname(redis_server):
    store = Store(redis_server.url, "j")
    with pytest.raises(ValueError, match="is not a node name"):
        store.own.register_node(SCRIPT_LINE, {"host": "h", "health": "ok"})
    assert store.r.hkeys(store.k("nodes")) == []


def _job(tmp_path, nodes: int = 2):
    raw = yaml.safe_load(write_job(tmp_path / "job.yaml", tmp_path / "run", name="j").read_text())
    config = validate_job(raw, world=nodes)
    return config, settings_for(config, str(tmp_path / "job.yaml"), [], nodes, 1)


def _forge(store: Store, name: str, health: str) -> None:
    """Names in the job-wide records, whoever wrote them (the controller's relay writes no
    such name: defence in depth)."""
    store.r.hset(store.k("nodes"), name, json.dumps({"host": "h", "health": health,
                                                     "health_detail": f"{name}/0: bad"}))
    (store.r.srem if health == "ok" else store.r.sadd)(store.k("unhealthy"), name)
    store.r.zadd(store.k("agents"), {name: time.time()})
    store.r.hset(store.k(f"node:{name}:status"), mapping={"state": "idle", "generation": "-1"})


def test_a_node_named_like_a_script_line_never_reaches_plan_exclusions_or_journal(
        redis_server, tmp_path):
    config, settings = _job(tmp_path)
    store = Store(redis_server.url, "j")
    for name in ("n0", "n1"):
        store.own.register_node(name, {"host": name, "health": "ok", "snapshot_addr": ""})
    _forge(store, SCRIPT_LINE, "ok")  # a healthy spare the plan could take
    _forge(store, UNHEALTHY, "failed")  # an unhealthy node the controller would exclude
    ctl = Controller(store, config, settings, ident="c")
    for _ in range(3):
        ctl.tick()
    plan = store.plan()
    assert plan is not None and plan["nodes"] == ["n0", "n1"]
    assert store.excluded() == {}
    journal = (tmp_path / "run" / "controller.json").read_text()
    assert "hostname" not in journal and "reboot" not in journal
    events = [e for _, e in store.events(count=1000)]
    refused = [e["message"] for e in events if e.get("kind") == "name_refused"]
    assert sorted(refused) == sorted(
        f"a node named {name!r} is ignored: not a node name (letters, digits, '-' and '_' in "
        "dot-separated labels of 1-63 characters, none starting with '-'; 253 characters in "
        "all); its records in Redis are skipped" for name in (SCRIPT_LINE, UNHEALTHY))
    assert not any("\n" in value for e in events for value in e.values())
    # Said once, however many ticks read it again.
    ctl.tick()
    assert len([e for _, e in store.events(count=1000) if e.get("kind") == "name_refused"]) == 2


def test_a_failed_exit_under_a_forged_name_blames_nobody_by_that_name(redis_server, tmp_path):
    config, settings = _job(tmp_path)
    store = Store(redis_server.url, "j")
    for name in ("n0", "n1"):
        store.own.register_node(name, {"host": name, "health": "ok", "snapshot_addr": ""})
    ctl = Controller(store, config, settings, ident="c")
    ctl.tick()
    gen = store.plan()["generation"]
    # n1's credentials write n1's own exits stream only; the record names another node.
    store.r.xadd(store.k("node:n1:exits"), {"json": json.dumps(
        {"version": 1, "node": SCRIPT_LINE, "rank": 1, "local_rank": 0, "generation": gen,
         "pid": 4242, "code": 1,
         "signal": None, "by_agent": False, "time": time.time(), "tail": "",
         "tail_age": None})})
    pipe = store.r.pipeline()
    store.own.put_row(pipe, "n1", exits=time.time_ns())  # as report_exit moves its token
    pipe.execute()
    for _ in range(3):
        ctl.tick()
    assert store.excluded() == {} and SCRIPT_LINE not in store.plan()["nodes"]
    assert store.exits() == [] and store.plan()["generation"] == gen
    refused = [e["message"] for _, e in store.events(count=1000)
               if e["kind"] == "relay_refused"]
    assert refused == [f"not relayed from node n1: an exit record: it names node "
                       f"{SCRIPT_LINE!r}"]
    assert "hostname" not in (tmp_path / "run" / "controller.json").read_text()


def _journal(tmp_path, excluded: dict, **more) -> None:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "controller.json").write_text(json.dumps({"excluded": excluded, **more}))


def test_reading_the_journal_back_refuses_a_name_that_is_no_hostname(tmp_path):
    _journal(tmp_path, {"n7": {"reason": "x"}}, plan={"nodes": ["n0", SCRIPT_LINE]})
    with pytest.raises(ConfigError) as refused:
        read_journal(tmp_path / "run" / "controller.json")
    message = str(refused.value)
    assert "\n" not in message and "names a node 'n9\\nhostname #'" in message
    assert message.startswith(f"{tmp_path / 'run' / 'controller.json'}: ")
    _journal(tmp_path, {"n7": {"reason": "x"}}, plan={"version": 1, "generation": 0,
                                                      "action": "end", "nodes": ["n0", "n1"]})
    assert list(read_journal(tmp_path / "run" / "controller.json")["excluded"]) == ["n7"]
    _journal(tmp_path, {"n7": {"reason": "x"}}, plan={"nodes": ["n0", "n1"]})
    with pytest.raises(ConfigError, match="its plan: field 'version' is missing"):
        read_journal(tmp_path / "run" / "controller.json")


def test_the_controller_rebuilding_redis_refuses_a_journal_with_a_bad_name(redis_server,
                                                                           tmp_path):
    _journal(tmp_path, {SCRIPT_LINE: {"reason": "x", "by": "c"}},
             job={"state": "RUNNING", "generation": "3"}, plan=None)
    config, settings = _job(tmp_path)
    store = Store(redis_server.url, "j")
    Controller(store, config, settings, ident="c").tick()
    assert store.excluded() == {}
    assert store.job_record()["state"] != "RUNNING" or store.job_record()["generation"] != "3"
    (said,) = [e["message"] for _, e in store.events(count=1000)
               if e.get("kind") == "journal_refused"]
    assert "names a node 'n9\\nhostname #', which is not a node name" in said


def test_known_bad_and_the_sbatch_script_refuse_a_bad_name_in_the_journal(tmp_path):
    _journal(tmp_path, {"n7": {"reason": "x"}, SCRIPT_LINE: {"reason": "x"}})
    with pytest.raises(ConfigError, match="not a node name"):
        known_bad(tmp_path / "run")
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", name="j")
    out = CliRunner().invoke(main, ["submit", "slurm", str(job), "--nodes", "2"])
    assert out.exit_code == 2, out.output
    assert "#SBATCH" not in out.output and "Traceback" not in out.output
    (line,) = out.output.strip().splitlines()
    assert "controller.json: names a node 'n9\\nhostname #', which is not a node name" in line


def test_the_pbs_script_is_refused_too(tmp_path):
    _journal(tmp_path, {SCRIPT_LINE: {"reason": "x"}})
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", name="j")
    out = CliRunner().invoke(main, ["submit", "pbs", str(job), "--nodes", "2", "--spares", "0",
                                    "--ranks-per-node", "1"])
    assert out.exit_code == 2, out.output
    assert "#PBS" not in out.output and "Traceback" not in out.output
    (line,) = out.output.strip().splitlines()
    assert "controller.json: names a node 'n9\\nhostname #', which is not a node name" in line


def test_a_good_journal_still_fills_the_exclusions(tmp_path):
    _journal(tmp_path, {"n7": {"reason": "x"}, "n3.cluster": {"reason": "y"}})
    assert known_bad(tmp_path / "run") == ["n3.cluster", "n7"]
