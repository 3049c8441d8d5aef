"""What nodes and users wrote, shown to people and to Prometheus (docs/security.md): values from
Redis are text, never Rich markup in `optimus node list`, `job status` or `optimus run`'s
console, never mathtext in `optimus report`'s figures; and a record the exporter cannot read is
skipped and counted, never the end of the scrape."""

from __future__ import annotations

import io
import json
import time
import urllib.request

import pytest
import yaml
from click.testing import CliRunner
from cluster import free_port, relay, write_job
from prometheus_client.parser import text_string_to_metric_families
from records import run_plan
from rich.console import Console

from controller.cli.console import Follow
from controller.cli.main import main
from controller.exporter import serve
from controller.store.store import Store
from optimus.config import validate_job
from optimus.report import build_report, read_run
from optimus.report.timeline import marks

CLOSING = "[/x]"  # Rich: "closing tag '[/x]' ... doesn't match any open tag"
LINK = "[link=http://e]x[/link]"  # Rich: a terminal hyperlink, shown as "x"
MATH = "$\\foo{$"  # matplotlib: "Unknown symbol: \foo"


def _running(url: str) -> Store:
    store = Store(url, "j")
    store.update_job({"state": "RUNNING", "generation": 0, "reason": f"{CLOSING} {LINK}"})
    store.set_plan(run_plan(0, ["n0", "n1"]))
    return store


def _cli(url: str, *args: str) -> str:
    out = CliRunner().invoke(main, [*args, "--job", "j", "--redis", url],
                             env={"COLUMNS": "300"})
    assert out.exit_code == 0, out.output
    return out.output


def test_node_list_and_job_status_show_markup_from_redis_as_it_is(redis_server):
    store = _running(redis_server.url)
    store.own.register_node("n0", {"host": CLOSING, "health": "failed", "health_detail": LINK})
    store.own.register_node("n2", {"host": "h2", "health": "ok"})
    relay(store)  # the controller's
    store.exclude("n2", f"{CLOSING} {LINK}", by=f"ana@{CLOSING}")
    listed = _cli(redis_server.url, "node", "list")
    row = next(line for line in listed.splitlines() if " n0 " in line)
    assert CLOSING in row and LINK in row
    assert f"{CLOSING} {LINK} (by ana@{CLOSING})" in listed
    status = _cli(redis_server.url, "job", "status")
    assert f"{CLOSING} {LINK}" in status


def test_the_run_console_says_events_as_they_are(redis_server, tmp_path):
    store = _running(redis_server.url)
    config = validate_job(yaml.safe_load(write_job(tmp_path / "job.yaml", tmp_path / "run",
                                                   name="j").read_text()), world=2)
    out = io.StringIO()
    follow = Follow(Console(file=out, width=300), store, config)  # markup on, as by default
    store.event(f"agent:{CLOSING}", "register", f"node n0 registered (host {LINK})")
    follow.poll(progress=False)
    assert f"[agent:{CLOSING}] register: node n0 registered (host {LINK})" in out.getvalue()


def test_the_report_draws_a_node_named_like_a_formula(tmp_path):
    steps = [{"time": 100.0 + i, "step": i, "loss": 5.0 - i / 10, "tokens": 100 * i,
              "tokens_per_s": 200.0} for i in range(1, 6)]
    events = [{"time": 101.5, "actor": "controller", "kind": "straggler", "node": MATH,
               "message": f"node {MATH} is a straggler"},
              {"time": 102.5, "actor": "alice", "kind": "exclude", "node": MATH,
               "message": f"node {MATH} excluded"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    labels = [m.label for m in marks(read_run(tmp_path))]
    assert labels == [f"straggler {MATH}", f"{MATH} excluded by alice"]
    page = build_report(tmp_path)
    assert f"{MATH} excluded by alice" in page.read_text()
    assert (page.parent / "timeline.png").stat().st_size > 10_000


def _scrape(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url.replace("0.0.0.0", "127.0.0.1"), timeout=10) as reply:
        text = reply.read().decode()
        return reply.status, {(s.name, tuple(sorted(s.labels.items()))): s.value
                              for f in text_string_to_metric_families(text) for s in f.samples}


def _exporter(store: Store, tmp_path) -> str:
    config = validate_job(yaml.safe_load(write_job(tmp_path / "job.yaml", tmp_path / "run",
                                                   name="j").read_text()), world=2)
    return serve(store, config, leading=lambda: True, agent_timeout_s=30.0, port=free_port())


def test_a_scrape_skips_and_counts_a_malformed_rank_states(redis_server, tmp_path):
    store = _running(redis_server.url)
    store.r.hset(store.k("node:n0:status"), "rank_states", json.dumps({"training": 1}))
    store.r.hset(store.k("node:n1:status"), "rank_states", json.dumps(["training"]))
    status, samples = _scrape(_exporter(store, tmp_path))
    assert status == 200
    assert samples[("optimus_controller_up", ())] == 1.0
    assert samples[("optimus_ranks", (("state", "training"),))] == 1.0
    assert samples[("optimus_exporter_unreadable_records", (("record", "rank_states"),))] == 1.0
    assert samples[("optimus_exporter_unreadable_records", (("record", "rank_beat"),))] == 0.0


@pytest.mark.parametrize("beat", [
    "not json", json.dumps(["a list"]),
    json.dumps({"generation": 0, "metrics": {"loss": "low", "tokens_per_s": 10.0}}),
])
def test_a_scrape_skips_and_counts_an_unreadable_rank_0_heartbeat(redis_server, tmp_path,
                                                                   beat):
    store = _running(redis_server.url)
    store.r.hset(store.k("node:n0:ranks"), "0", beat)
    for node in ("n0", "n1"):
        store.r.hset(store.k(f"node:{node}:status"), "rank_states", json.dumps({"training": 1}))
    status, samples = _scrape(_exporter(store, tmp_path))
    assert status == 200 and samples[("optimus_controller_up", ())] == 1.0
    assert samples[("optimus_ranks", (("state", "training"),))] == 2.0
    assert samples[("optimus_exporter_unreadable_records", (("record", "rank_beat"),))] == 1.0
    assert ("optimus_loss", ()) not in samples and ("optimus_tokens_per_second", ()) not in samples


def test_a_scrape_sums_the_agents_rank_restarts_and_skips_a_malformed_count(redis_server,
                                                                          tmp_path):
    store = _running(redis_server.url)
    counts = {"n0": {"in_process": 3, "process": 1}, "n1": {"in_process": 2, "process": 4},
              "n2": {"in_process": "9", "process": 1}, "n3": {"in_process": -5, "process": 0}}
    for node, count in counts.items():
        store.r.zadd(store.k("agents"), {node: time.time()})
        store.r.hset(store.k(f"node:{node}:status"), "restarts", json.dumps(count))
    status, samples = _scrape(_exporter(store, tmp_path))
    assert status == 200
    assert samples[("optimus_rank_restarts_total", (("kind", "in_process"),))] == 5.0
    assert samples[("optimus_rank_restarts_total", (("kind", "process"),))] == 5.0
    assert samples[("optimus_exporter_unreadable_records", (("record", "restarts"),))] == 2.0


# --- stability: rank 0's counts and thresholds, the job record's rewinds --------------------

REWIND = {"step": 240, "first": 241, "last": 250, "resume_step": 200, "to": 200,
          "by": "controller", "reason": "spike at step 240", "time": 1700000000.0}
FIGURES = {"spikes": 3, "divergences": 1, "skipped_steps": 2, "loss_threshold": 3.25,
           "grad_norm_threshold": None}


def _stability_job(store: Store, stability, rewinds: str | None) -> None:
    beat = {"generation": 0, "metrics": {"loss": 2.5, "tokens_per_s": 10.0,
                                         "stability": stability}}
    store.r.hset(store.k("node:n0:ranks"), "0", json.dumps(beat))
    if rewinds is not None:
        store.update_job({"rewinds": rewinds})


def test_a_scrape_serves_rank_0_s_stability_counts_thresholds_and_the_rewinds(redis_server,
                                                                               tmp_path):
    store = _running(redis_server.url)
    _stability_job(store, FIGURES, json.dumps([REWIND, {**REWIND, "step": 300,
                                                        "by": "operator ana"}]))
    url = _exporter(store, tmp_path)
    status, samples = _scrape(url)
    assert status == 200
    assert samples[("optimus_loss_spikes_total", ())] == 3.0
    assert samples[("optimus_divergences_total", ())] == 1.0
    assert samples[("optimus_skipped_steps_total", ())] == 2.0
    assert samples[("optimus_rewinds_total", ())] == 2.0
    assert samples[("optimus_stability_loss_threshold", ())] == 3.25
    assert ("optimus_stability_grad_norm_threshold", ()) not in samples  # that rule is off
    assert samples[("optimus_loss", ())] == 2.5
    for record in ("rank_beat", "stability", "rewinds"):
        assert samples[("optimus_exporter_unreadable_records", (("record", record),))] == 0.0
    with urllib.request.urlopen(url.replace("0.0.0.0", "127.0.0.1"), timeout=10) as reply:
        text = reply.read().decode()
    for name in ("loss_spikes", "divergences", "skipped_steps", "rewinds"):
        assert f"# TYPE optimus_{name}_total counter" in text

    # Armed gradient-norm rule, a rewind later: the count goes back with the line (a counter
    # reset, to Prometheus), and the job record's third rewind is counted.
    _stability_job(store, {**FIGURES, "spikes": 1, "grad_norm_threshold": 4},
                   json.dumps([REWIND] * 3))
    _, samples = _scrape(url)
    assert samples[("optimus_loss_spikes_total", ())] == 1.0
    assert samples[("optimus_stability_grad_norm_threshold", ())] == 4.0
    assert samples[("optimus_rewinds_total", ())] == 3.0
    # Past the 100 rewinds the record keeps, the restarts a rewind caused go on counting.
    store.update_job({"rewinds": json.dumps([REWIND] * 100),
                      "restart_causes": json.dumps({"rewind": 130, "failure": 2})})
    _, samples = _scrape(url)
    assert samples[("optimus_rewinds_total", ())] == 130.0
    store.update_job({"restart_causes": json.dumps({"rewind": "130"})})  # not a count
    _, samples = _scrape(url)
    assert samples[("optimus_rewinds_total", ())] == 100.0
    store.r.hdel(store.k("job"), "restart_causes")

    # Stability off (no "stability" in the heartbeat), no rewind yet: no counts, rewinds 0.
    store.r.hdel(store.k("job"), "rewinds")
    _stability_job(store, None, None)
    _, samples = _scrape(url)
    assert not [k for k in samples if k[0].startswith(("optimus_loss_spikes", "optimus_stab"))]
    assert samples[("optimus_rewinds_total", ())] == 0.0
    assert samples[("optimus_exporter_unreadable_records", (("record", "stability"),))] == 0.0


@pytest.mark.parametrize("stability", [
    ["a list"], {**FIGURES, "spikes": "3"}, {**FIGURES, "divergences": True},
    {**FIGURES, "skipped_steps": -1}, {k: v for k, v in FIGURES.items() if k != "spikes"},
    {**FIGURES, "loss_threshold": "high"}, {**FIGURES, "grad_norm_threshold": float("nan")},
])
def test_a_scrape_skips_and_counts_unreadable_stability_figures(redis_server, tmp_path,
                                                                 stability):
    store = _running(redis_server.url)
    _stability_job(store, stability, None)
    status, samples = _scrape(_exporter(store, tmp_path))
    assert status == 200 and samples[("optimus_controller_up", ())] == 1.0
    assert samples[("optimus_exporter_unreadable_records", (("record", "stability"),))] == 1.0
    assert samples[("optimus_exporter_unreadable_records", (("record", "rank_beat"),))] == 0.0
    assert samples[("optimus_loss", ())] == 2.5  # the other figures stand
    assert not [k for k in samples if k[0].startswith(("optimus_loss_spikes", "optimus_diverg",
                                                       "optimus_skipped", "optimus_stability"))]


@pytest.mark.parametrize("rewinds", [
    "not json", json.dumps({"step": 1}), json.dumps([1, 2]),
    json.dumps([REWIND] * 10_000),  # over the bound (1 MiB) on what a scrape parses
])
def test_a_scrape_skips_and_counts_an_unreadable_list_of_rewinds(redis_server, tmp_path,
                                                                  rewinds):
    store = _running(redis_server.url)
    _stability_job(store, FIGURES, rewinds)
    status, samples = _scrape(_exporter(store, tmp_path))
    assert status == 200 and samples[("optimus_controller_up", ())] == 1.0
    assert samples[("optimus_exporter_unreadable_records", (("record", "rewinds"),))] == 1.0
    assert ("optimus_rewinds_total", ()) not in samples
    assert samples[("optimus_loss_spikes_total", ())] == 3.0


@pytest.mark.parametrize("lost,last,served", [
    ({"rank_exit": 12.5, "node_lost": 4.25}, {"seconds": 4.25, "cause": "node_lost"}, 4.25),
    # What the controller did not write: a cause's figure that is not a non-negative number
    # counts 0, and a last recovery that is not an object with one is left out.
    ({"rank_exit": "12", "node_lost": -1, "hang": float("nan")}, {"seconds": "4"}, None),
    ("not json", ["a list"], None),
])
def test_a_scrape_serves_the_time_lost_to_restarts_by_cause(redis_server, tmp_path, lost,
                                                           last, served):
    store = _running(redis_server.url)
    store.r.hset(store.k("job"), mapping={
        "lost_s": lost if isinstance(lost, str) else json.dumps(lost),
        "last_recovery": json.dumps(last)})
    status, samples = _scrape(_exporter(store, tmp_path))
    assert status == 200 and samples[("optimus_controller_up", ())] == 1.0
    by_cause = {c: samples[("optimus_restart_lost_seconds_total", (("cause", c),))]
                for c in ("rank_exit", "node_lost", "hang", "operator")}
    good = served is not None
    assert by_cause == {"rank_exit": 12.5 if good else 0.0, "node_lost": 4.25 if good else 0.0,
                        "hang": 0.0, "operator": 0.0}
    assert samples.get(("optimus_last_recovery_seconds", ())) == served
