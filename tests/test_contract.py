"""The contract between ranks, agents and the controller (optimus/contract/): every exit status,
phase, chaos kind and environment name is defined there once and used from there; the plan and
the exit record are checked where they are read back from Redis; importing it loads no torch."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import get_args

import yaml
from click.testing import CliRunner
from cluster import ROOT, write_job
from records import exit_record, run_plan

from controller.cli.main import CHAOS, main
from controller.control.controller import Controller
from controller.control.settings import settings_for
from controller.store.store import Store
from optimus.config import validate_job
from optimus.config.schema import Fault
from optimus.contract import chaos, env, exits, phases
from optimus.contract.records import ExitRecord, Plan, RecordError

SOURCES = [p for package in ("optimus", "controller") for p in (ROOT / package).rglob("*.py")
           if "contract" not in p.relative_to(ROOT).parts]
# The batch scripts' own settings (deploy/pbs/optimus.pbs: OPTIMUS_NODES, ...), which the
# script reads, not a process of Optimus.
SCRIPT_SETTINGS = {ROOT / "controller" / "schedulers" / "pbs.py"}
NOT_YET: set = set()  # every reader uses the contract's names


def _trees():
    for path in SOURCES:
        yield path, ast.parse(path.read_text(), str(path))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def test_importing_the_contract_loads_no_torch_and_nothing_else_of_optimus_or_controller():
    code = ("import importlib, pkgutil, sys, optimus.contract as c; "
            "[importlib.import_module(f'optimus.contract.{m.name}') "
            "for m in pkgutil.iter_modules(c.__path__)]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'optimus', 'controller')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    loaded = set(eval(out))  # noqa: S307 (our own child's printed list)
    assert loaded == {"optimus", "optimus.contract", *(f"optimus.contract.{m}" for m in (
        "chaos", "env", "exits", "phases", "process", "records"))}, loaded


def test_exit_statuses_are_the_contract_s_alone():
    own = {v: k for k, v in vars(exits).items() if k.startswith("EXIT_")}
    assert sorted(own) == [0, 1, 2, 87, 88, 89, 90]
    assert all(exits.meaning(code) for code in own)
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and type(node.value) is int
                    and node.value in exits.OWN):
                found.append(f"{_where(path, node)}: the number {node.value}")
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id in own.values() for t in node.targets):
                found.append(f"{_where(path, node)}: defines {node.targets[0].id}")
    assert found == []


def _strings(node: ast.AST) -> list[str]:
    items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", [])
    return [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def test_chaos_kinds_and_collective_phases_are_listed_only_in_the_contract():
    kinds = {k.name for k in chaos.KINDS} | {chaos.word(k.name) for k in chaos.KINDS}
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
                continue
            said = _strings(node)
            if len(kinds.intersection(said)) >= 2:
                found.append(f"{_where(path, node)}: chaos kinds {said}")
            if len(set(phases.COLLECTIVE_PHASES).intersection(said)) >= 2:
                found.append(f"{_where(path, node)}: phases {said}")
    assert found == []


def test_the_job_file_the_cli_the_agent_and_the_rank_take_their_kinds_from_the_contract():
    assert get_args(Fault.model_fields["kind"].annotation) == chaos.JOB_FILE
    assert list(CHAOS) == [chaos.word(k) for k in chaos.OPERATOR]
    help_text = CliRunner().invoke(main, ["chaos", "--help"], terminal_width=200).output
    for kind in chaos.OPERATOR:
        assert re.search(rf"^\s*{chaos.word(kind)}\s+\S", help_text, re.M), kind
    assert set(chaos.IN_STEP) < set(chaos.OPERATOR) and set(chaos.RANK_FIRED) <= {
        *chaos.IN_STEP, chaos.SPIKE}
    # Every kind a job file may plan is one the rank's hooks or its agent carry out.
    hooks = (ROOT / "optimus" / "supervision" / "faults.py").read_text()
    assert all(f'"{k}"' in hooks or k in (chaos.SPIKE, chaos.KILL_NODE) for k in chaos.JOB_FILE)


def test_every_optimus_environment_name_is_the_contract_s():
    names = {v for k, v in vars(env).items() if k.isupper() and isinstance(v, str)}
    assert all(n.startswith(env.PREFIX) for n in names) and len(names) > 30
    found = []
    for path, tree in _trees():
        if path in SCRIPT_SETTINGS | NOT_YET:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(r"OPTIMUS_[A-Z0-9_]+", node.value)):
                found.append(f"{_where(path, node)}: {node.value}")
    assert found == []


def test_one_die_with_parent_and_the_agent_and_controller_import_no_side_of_each_other():
    defined = [_where(p, n) for p, tree in _trees() for n in ast.walk(tree)
               if isinstance(n, ast.FunctionDef) and "die_with_parent" in n.name]
    assert defined == []
    crossing = []
    for path, tree in _trees():
        side = path.relative_to(ROOT).parts[:2]
        other = {("controller", "node"): "controller.control",
                 ("controller", "control"): "controller.node"}.get(side)
        for node in ast.walk(tree):
            if other and isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    other):
                crossing.append(f"{_where(path, node)}: {node.module}")
    assert crossing == []


def _fields(title: str) -> set[str]:
    """The field names of one of docs/redis-schema.md's record tables (`a`, `b` rows count
    each)."""
    text = (ROOT / "docs" / "redis-schema.md").read_text()
    table = text.split(f"### {title}\n", 1)[1].strip().split("\n\n", 1)[0]
    return {name for line in table.splitlines()[2:]
            for name in re.findall(r"`(\w+)`", line.split("|")[1])}


def test_the_schema_documents_exactly_the_records_fields():
    assert _fields("The plan") == set(Plan.model_fields)
    assert _fields("An exit record") == set(ExitRecord.model_fields)


def test_a_record_with_a_missing_or_mistyped_field_is_refused_in_one_line_naming_it():
    good = run_plan(3, ["n0", "n1"])
    assert Plan.parse(good).record() == good
    for bad, said in [
            ({k: v for k, v in good.items() if k != "world_size"},
             "plan: field 'world_size' is missing from a run plan"),
            ({**good, "generation": "3"}, "plan: field 'generation' should be a valid integer"),
            ({**good, "version": 2}, "plan: field 'version' should be 1"),
            ({**good, "worldsize": 4}, "plan: field 'worldsize' is not one of version 1's"),
            ({**good, "memory": {"step": 1, "generation": 2, "holders": {"n1": {"node": 0}}}},
             "plan: field 'memory.holders.n1.node' should be a valid string")]:
        try:
            Plan.parse(bad)
        except RecordError as e:
            assert str(e).startswith(said) and "\n" not in str(e), str(e)
        else:
            raise AssertionError(f"accepted: {bad}")
    record = exit_record("n0", 1).record()
    assert ExitRecord.parse(record).record() == record
    assert str(_refused(ExitRecord, {**record, "by_agent": 0})) == (
        "exit record: field 'by_agent' should be a valid boolean (got 0)")


def test_a_plan_field_left_out_reads_as_its_default_and_is_not_written_back():
    """The defaults an agent acts on are the record's, not each reader's own."""
    written = run_plan(0, ["n0"])
    plan = Plan.parse(written)
    assert (plan.save, plan.grace_s, plan.heartbeat_timeout_s, plan.startup_timeout_s,
            plan.overrides, plan.node_faults, plan.straggler_window, plan.buddies) == (
        True, 3.0, 30.0, 300.0, [], [], 20, {})
    assert plan.record() == written
    assert _refused(Plan, {**written, "save": None}).what == (
        "field 'save' should be a valid boolean (got None)")


def _refused(kind, value) -> RecordError:
    try:
        kind.parse(value)
    except RecordError as e:
        return e
    raise AssertionError(f"accepted: {value}")


def test_the_store_reads_a_bad_plan_or_exit_record_as_none_and_notes_it_once(redis_server):
    store = Store(redis_server.url, "j")
    plan = run_plan(2, ["n0"])
    store.r.set(store.k("plan"), json.dumps({**plan, "ranks_per_node": "1"}))
    assert store.plan() is None and store.plan_record() is None
    assert store.records.take() == [
        "plan: field 'ranks_per_node' should be a valid integer (got '1')"]
    store.set_plan(plan)
    assert store.plan() == plan and store.records.take() == []
    assert store.plan_record() == Plan.parse(plan)  # what an agent follows
    good = exit_record("n0", 0, generation=2)
    entries = [json.dumps(good.record()), json.dumps({**good.record(), "code": "1"}),
               json.dumps({k: v for k, v in good.record().items() if k != "tail"}), "[]"]
    ids = [store.r.xadd(store.k("exits"), {"json": text}) for text in entries]
    assert [r for _, r in store.exits()] == [good.record()]
    assert store.records.take() == [
        f"exit record {ids[1]}: field 'code' should be a valid integer (got '1')",
        f"exit record {ids[2]}: field 'tail' is missing",
        f"exit record {ids[3]}: it is no JSON object"]
    store.exits()
    assert store.records.take() == []  # each said once


def test_the_controller_says_a_refused_plan_in_one_event_and_plans_anew(redis_server, tmp_path):
    raw = yaml.safe_load(write_job(tmp_path / "job.yaml", tmp_path / "run", name="j").read_text())
    config = validate_job(raw, world=2)
    settings = settings_for(config, str(tmp_path / "job.yaml"), [], 2, 1)
    store = Store(redis_server.url, "j")
    for name in ("n0", "n1"):
        store.own.register_node(name, {"host": name, "health": "ok", "snapshot_addr": ""})
    bad = {k: v for k, v in run_plan(0, ["n0", "n1"]).items() if k != "job_file"}
    store.r.set(store.k("plan"), json.dumps(bad))
    ctl = Controller(store, config, settings, ident="c")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (store.plan() or {}).get("action") != "run":
        ctl.tick()
    plan = store.plan()
    assert plan is not None and Plan.parse(plan).job_file == str(tmp_path / "job.yaml")
    said = [e["message"] for _, e in store.events(count=1000) if e["kind"] == "record_refused"]
    assert said == ["a record in Redis is ignored: plan: field 'job_file' is missing from a run "
                    "plan"]
