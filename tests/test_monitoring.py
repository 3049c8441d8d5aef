"""The monitoring files: alert rules and their unit tests (promtool), the Prometheus config,
the Grafana dashboard and provisioning, and the metric names they reference."""

import json
import re
import shutil
import subprocess

import pytest
import yaml
from promql import (
    ALERTS,
    ROOT,
    dashboard_expressions,
    exported_names,
    metric_names,
    monitoring_expressions,
)

MONITORING = ROOT / "monitoring"
PROMETHEUS = MONITORING / "prometheus"
GRAFANA = MONITORING / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "optimus.json"
OPERATIONS = ROOT / "docs" / "operations.md"

# What the controller's /metrics serves (docs/monitoring.md): sample names, so the histogram
# appears as its _bucket, _sum and _count series.
CONTRACT = {
    "optimus_job_info",
    "optimus_job_state",
    "optimus_generation",
    "optimus_step",
    "optimus_target_steps",
    "optimus_tokens",
    "optimus_loss",
    "optimus_validation_loss",
    "optimus_tokens_per_second",
    "optimus_mfu_ratio",
    "optimus_step_time_seconds",
    "optimus_moe_alltoall_bytes",
    "optimus_memory_peak_allocated_bytes",
    "optimus_memory_peak_reserved_bytes",
    "optimus_ranks",
    "optimus_heartbeat_age_seconds_bucket",
    "optimus_heartbeat_age_seconds_sum",
    "optimus_heartbeat_age_seconds_count",
    "optimus_heartbeat_timeout_seconds",
    "optimus_heartbeat_overdue_nodes",
    "optimus_restarts_total",
    "optimus_rank_restarts_total",
    "optimus_restart_lost_seconds_total",
    "optimus_last_recovery_seconds",
    "optimus_nodes",
    "optimus_excluded_nodes",
    "optimus_stragglers",
    "optimus_checkpoint_step",
    "optimus_memory_snapshot_step",
    "optimus_checkpoint_age_seconds",
    "optimus_checkpoint_duration_seconds",
    "optimus_checkpoint_interval_steps",
    "optimus_controller_up",
    "optimus_controller_leader",
    "optimus_exporter_unreadable_records",
    "optimus_loss_spikes_total",
    "optimus_divergences_total",
    "optimus_skipped_steps_total",
    "optimus_rewinds_total",
    "optimus_stability_loss_threshold",
    "optimus_stability_grad_norm_threshold",
}
ALERT_NAMES = {"OptimusHeartbeatsStale", "OptimusTrainingStalled", "OptimusRestartsHigh",
               "OptimusCheckpointOverdue", "OptimusMFUDrop", "OptimusControllerDown",
               "OptimusJobFailed", "OptimusRepeatedRewinds", "OptimusLossDiverging"}


@pytest.fixture(scope="module")
def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run `apt-get install -y prometheus` (CI installs it)")
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
            for rule in group["rules"]]


def panels(items: list[dict]):
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


# --- promtool ----------------------------------------------------------------------------

def test_alert_rules_pass_promtool_check(promtool):
    result = run(promtool, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in result.stdout
    assert {rule["alert"] for rule in rules()} == ALERT_NAMES


def test_alert_unit_tests_pass(promtool, tmp_path):
    # from another directory: the test file names alerts.yml relative to itself
    result = subprocess.run([promtool, "test", "rules", str(PROMETHEUS / "alerts_test.yml")],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "FAILED" not in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case.get("exp_alerts")}
    quiet = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert fired == ALERT_NAMES
    assert quiet == ALERT_NAMES


def test_prometheus_config_passes_promtool_and_loads_the_alerts(promtool):
    result = run(promtool, "check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    [scrape] = config["scrape_configs"]
    assert scrape["scrape_interval"] == "15s"
    assert scrape["static_configs"][0]["targets"] == ["localhost:9780"]


def test_dashboard_expressions_are_valid_promql(promtool, tmp_path):
    # promtool parses each expression as a recording rule, Grafana's variables filled in.
    filled = {"$__rate_interval": "1m", "$__range": "1h", "$instance": ".+"}
    exprs = dashboard_expressions(DASHBOARD)
    records = []
    for i, expr in enumerate(e for k, e in exprs.items() if not k.startswith("dashboard var")):
        for variable, value in filled.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        records.append({"record": f"dashboard_expr_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    result = run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(records)} rules found" in result.stdout


# --- the rules' shape ----------------------------------------------------------------------

def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_alert_has_severity_annotations_and_a_runbook_section():
    anchors = _anchors(OPERATIONS.read_text())
    for rule in rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], rule["alert"]
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page == "docs/operations.md", rule["alert"]
        assert anchor == rule["alert"].lower() and anchor in anchors, rule["alert"]


# --- Grafana -------------------------------------------------------------------------------

def test_dashboard_panels_have_a_title_the_datasource_variable_and_targets():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "optimus" and dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["query"] == "label_values(optimus_job_info, instance)"
    assert variables["instance"]["datasource"]["uid"] == "${datasource}"
    shown = [p for p in panels(dashboard["panels"]) if p["type"] != "row"]
    assert len(shown) >= 20
    titles = [p.get("title") for p in shown]
    assert all(titles) and len(set(titles)) == len(titles)
    for panel in shown:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"].strip(), panel["title"]
    # the collapsed row keeps its panels inside it
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert any(row["collapsed"] and row["panels"] for row in rows)


def test_dashboard_panels_do_not_overlap():
    dashboard = json.loads(DASHBOARD.read_text())
    boxes = [(p["title"], p["gridPos"]) for p in panels(dashboard["panels"])]
    for i, (a, pa) in enumerate(boxes):
        assert pa["x"] + pa["w"] <= 24, a
        for b, pb in boxes[i + 1:]:
            apart = (pa["x"] + pa["w"] <= pb["x"] or pb["x"] + pb["w"] <= pa["x"]
                     or pa["y"] + pa["h"] <= pb["y"] or pb["y"] + pb["h"] <= pa["y"])
            assert apart, (a, b)


def test_the_loss_panel_marks_spikes_skipped_steps_divergences_and_rewinds():
    dashboard = json.loads(DASHBOARD.read_text())
    loss = next(p for p in panels(dashboard["panels"]) if p.get("title") == "Loss")
    notes = {n["name"]: n for n in dashboard["annotations"]["list"]}
    counted = {"Loss spikes": "optimus_loss_spikes_total",
               "Skipped steps": "optimus_skipped_steps_total",
               "Divergences": "optimus_divergences_total", "Rewinds": "optimus_rewinds_total"}
    assert notes.keys() == counted.keys()
    for name, metric in counted.items():
        note = notes[name]
        assert metric_names(note["expr"]) == {metric}, name
        assert note["enable"] and note["datasource"]["uid"] == "${datasource}", name
        assert loss["id"] in note["filter"]["ids"] and not note["filter"]["exclude"], name
    assert 'optimus_stability_loss_threshold{instance=~"$instance"}' in [
        t["expr"] for t in loss["targets"]]


def test_the_marks_come_where_a_count_rose_not_where_a_rewind_took_it_back(promtool,
                                                                          tmp_path):
    # Each annotation's query, evaluated by promtool on a count that rises at 10m, goes back
    # at 30m (a rewind to an earlier checkpoint) and rises again at 50m.
    notes = json.loads(DASHBOARD.read_text())["annotations"]["list"]
    labels = '{instance="ctl-a:9780", job="optimus"}'
    tests = []
    for note in notes:
        (metric,) = metric_names(note["expr"])
        expr = note["expr"].replace("$instance", ".+")
        at = lambda t, value, expr=expr: {"expr": expr, "eval_time": t, "exp_samples": [
            {"labels": labels, "value": value}] if value else []}
        tests.append({"name": note["name"], "interval": "1m",
                      "input_series": [{"series": metric + labels,
                                        "values": "2x9 3x19 1x19 2x19"}],
                      "promql_expr_test": [at("9m", 0), at("10m", 1), at("14m", 1),
                                           at("16m", 0), at("31m", 0), at("40m", 0),
                                           at("50m", 1), at("56m", 0)]})
    path = tmp_path / "marks_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m",
                                    "tests": tests}))
    result = run(promtool, "test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and len(tests) == 4


def test_grafana_provisioning_files():
    datasources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasources["apiVersion"] == 1
    [source] = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    providers = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "optimus.yml").read_text())
    assert providers["apiVersion"] == 1
    [provider] = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


# --- metric names --------------------------------------------------------------------------

@pytest.mark.parametrize("expr, names", [
    ("histogram_quantile(0.99, sum by (le) (rate(optimus_heartbeat_age_seconds_bucket[5m])))",
     {"optimus_heartbeat_age_seconds_bucket"}),
    ("absent(optimus_controller_up) or max(optimus_controller_leader) == 0",
     {"optimus_controller_up", "optimus_controller_leader"}),
    ('changes(optimus_step[15m]) == 0 and on(instance) optimus_job_state{state="RUNNING"} == 1',
     {"optimus_step", "optimus_job_state"}),
    ('sum(rate(a_total{path=~"x{2}|[a-z]"}[$__rate_interval] offset 1h)) by (le, cause)'
     " / ignoring(cause) group_left(name) b_info > bool 0.5e-3 unless c offset -5m",
     {"a_total", "b_info", "c"}),
    ("sum without (instance) (x) * on (job) group_right (node) y # z is a comment",
     {"x", "y"}),
    ('max_over_time(deriv(m[1h:5m])[2h:]) @ start() + {__name__="by_name", a="b"} - Inf',
     {"m", "by_name"}),
    ('topk(5, q) + count_values("le", r) + label_replace(s, "dst", "$1", "src", "(.*)")',
     {"q", "r", "s"}),
    ('optimus_mfu_ratio{instance=~"$instance"} < 0.8 * avg_over_time(optimus_mfu_ratio[${d}])',
     {"optimus_mfu_ratio"}),
    ("label_values(optimus_job_info, instance)", {"optimus_job_info"}),
    ('label_values(optimus_nodes{state="spare"}, name)', {"optimus_nodes"}),
    ("label_values(instance)", set()),
    ("vector(1) + time() - 3", set()),
])
def test_metric_names(expr, names):
    assert metric_names(expr) == names


def test_monitoring_expressions_cover_dashboard_rows_variables_and_alerts():
    exprs = monitoring_expressions()
    assert {f"alert: {name}" for name in ALERT_NAMES} <= exprs.keys()
    assert "dashboard variable: instance" in exprs
    assert "dashboard: Controllers reading Redis" in exprs  # inside the collapsed row
    assert exprs["dashboard: Heartbeat age [D]"] == \
        'optimus_heartbeat_timeout_seconds{instance=~"$instance"}'
    assert exprs["alert: OptimusJobFailed"] == next(
        r["expr"] for r in rules() if r["alert"] == "OptimusJobFailed")


def test_every_referenced_metric_is_in_the_contract():
    for where, expr in monitoring_expressions().items():
        names = metric_names(expr)
        assert names, f"{where} references no metric: {expr}"
        assert names <= CONTRACT, f"{where} references {sorted(names - CONTRACT)}"


def test_the_dashboard_shows_every_metric():
    shown = set().union(*map(metric_names, dashboard_expressions(DASHBOARD).values()))
    unused = {"optimus_heartbeat_age_seconds_sum", "optimus_heartbeat_age_seconds_count",
              "optimus_exporter_unreadable_records"}  # not a figure of the job: docs/security.md
    assert CONTRACT - unused == shown


def test_the_metric_table_documents_every_metric():
    table = (ROOT / "docs" / "monitoring.md").read_text()
    documented = set(re.findall(r"^\| `(optimus_\w+)`", table, flags=re.M))
    histograms = {"optimus_heartbeat_age_seconds"}
    families = {re.sub(r"_(bucket|sum|count)$", "", n) if n.startswith(tuple(histograms)) else n
                for n in CONTRACT}
    assert documented == families


def test_exported_names_lists_every_sample_name():
    text = """\
# HELP optimus_restarts_total Restarts by cause.
# TYPE optimus_restarts_total counter
optimus_restarts_total{cause="hang"} 2.0
optimus_restarts_total{cause="rank_exit"} 0.0
# HELP optimus_heartbeat_age_seconds Oldest rank heartbeat per node.
# TYPE optimus_heartbeat_age_seconds histogram
optimus_heartbeat_age_seconds_bucket{le="0.5"} 1.0
optimus_heartbeat_age_seconds_bucket{le="+Inf"} 2.0
optimus_heartbeat_age_seconds_sum 1.2
optimus_heartbeat_age_seconds_count 2.0
# HELP optimus_job_state Current state.
# TYPE optimus_job_state gauge
optimus_job_state{state="RUNNING"} 1.0
optimus_job_state{state="PAUSED"} 0.0
"""
    assert exported_names(text) == {
        "optimus_restarts_total", "optimus_heartbeat_age_seconds_bucket",
        "optimus_heartbeat_age_seconds_sum", "optimus_heartbeat_age_seconds_count",
        "optimus_job_state"}


def test_a_scrape_without_redis_still_names_the_job():
    # OptimusControllerDown counts a controller that cannot read Redis under its job's name.
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from controller.exporter import JobCollector
    from controller.store.store import StoreUnavailable

    class NoRedis:
        def __getattr__(self, name):
            def unavailable(*args, **kwargs):
                raise StoreUnavailable("connection refused")
            return unavailable

    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(NoRedis(), SimpleNamespace(name="gpt-1p3b"),
                                   leading=lambda: True, agent_timeout_s=30.0))
    text = generate_latest(registry).decode()
    assert exported_names(text) == {"optimus_controller_up", "optimus_controller_leader",
                                    "optimus_job_info"}
    assert 'optimus_job_info{name="gpt-1p3b"} 1.0' in text
    assert "optimus_controller_up 0.0" in text
