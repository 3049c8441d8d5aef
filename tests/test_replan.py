"""Shrinking with the planner (issue 32, part 2): the layout of each node count a job may run on
with fewer nodes (optimus/planner/replan.py, controller/control/settings.py), and the plans the
rules make of it (controller/control/decide.py): the job's own layout with a smaller dp where
it runs and fits, else the planner's best that `config check` accepts; a count no layout runs
on is refused with the planner's reason, and the job waits saying it. End to end:
tests/test_resize.py."""

from __future__ import annotations

import dataclasses

import pytest
from test_decide import NOW, node

from controller.control.decide import WAITING, JobView, Observed, Settings, decide
from controller.control.settings import node_counts
from optimus.config import ConfigError, check_job, validate_job
from optimus.planner.machines import get_machine
from optimus.planner.replan import replan, with_overrides

H100 = get_machine("h100-ndr")


def _job(**parallel) -> dict:
    return {"name": "r", "model": {"vocab_size": 264, "dim": 64, "n_layers": 6, "n_heads": 4,
                                   "n_kv_heads": 2, "max_seq_len": 64},
            "data": {"seq_len": 64, "batch_size": 12, "microbatches": 3},
            "parallel": parallel, "supervision": {}}


def test_the_job_s_own_layout_runs_where_its_dp_shrinks_and_fits():
    job = validate_job(_job())
    found = replan(job, 2, 1, H100)
    assert found.own and found.overrides == () and found.label == "tp1.pp1.dp2.mb2x3.none"
    assert found.tokens_per_s > 0 and 0 < found.gib < 1


def test_a_pipeline_that_cannot_stay_is_replanned_and_the_job_accepts_the_new_layout():
    job = validate_job(_job(pp=3, schedule="1f1b"))
    with pytest.raises(ConfigError):
        check_job(job, world=2)  # pp 3 on 2 ranks: the job file's layout cannot run
    found = replan(job, 2, 1, H100)
    assert not found.own and ".pp3." not in found.label
    changed = with_overrides(job, found.overrides)
    layout = check_job(changed, world=2)
    assert layout.world_size == 2 and layout.pp in (1, 2)
    assert (changed.data.batch_size, changed.model) == (job.data.batch_size, job.model)
    assert f"pp{layout.pp}" in found.label and f"dp{layout.dp}" in found.label


def test_tensor_parallelism_stays_inside_a_node():
    job = validate_job(_job(tp=2))
    # 2 nodes of 2 ranks -> 1 node of 2: tp 2 still fits inside it, the job's own layout
    assert replan(job, 2, 2, H100).own
    # nodes of one rank each: tp 2 would span two nodes, so the planner's layout has tp 1
    found = replan(job, 3, 1, H100)
    assert "tp1." in found.label and "parallel.tp=1" in found.overrides


def test_no_layout_that_fits_is_refused_with_the_planner_s_reason():
    small = H100.model_copy(update={"name": "tiny-gpu", "memory_gib": 0.001,
                                    "headroom_gib": 0.0})
    reason = replan(validate_job(_job()), 2, 1, small)
    assert isinstance(reason, str) and "tiny-gpu's 0.001 GiB" in reason
    raw = _job()
    odd = validate_job({**raw, "model": {**raw["model"], "n_layers": 4},
                        "data": {"seq_len": 64, "batch_size": 7, "microbatches": 1}})
    # 5 devices: dp 5 does not divide the batch, pp 5 exceeds the layers, tp 5 the heads
    assert "7 sequences" in replan(odd, 5, 1, H100)


def test_node_counts_follow_when_no_spare_and_the_floor():
    def counts(raw: dict, nodes: int, rpn: int = 1):
        return node_counts(validate_job(raw), nodes, rpn)

    shrink = _job()
    assert counts(shrink, 4)[0] == (4, 3, 2)  # default floor: half of --nodes
    assert counts({**shrink, "supervision": {"min_nodes": 1}}, 4)[0] == (4, 3, 2, 1)
    assert counts({**shrink, "supervision": {"when_no_spare": "wait"}}, 4) == ((4,), {}, {})
    found, layouts, refused = counts({**_job(pp=3, schedule="1f1b"),
                                      "supervision": {"min_nodes": 1}}, 3)
    assert found == (3, 2, 1) and refused == {}
    assert layouts[3]["overrides"] == [] and layouts[3]["layout"].startswith("tp1.pp3.dp1")
    assert "parallel.pp=3" not in layouts[2]["overrides"] and layouts[2]["overrides"]
    with pytest.raises(ConfigError, match="when_no_spare: wait never shrinks"):
        validate_job({**shrink, "supervision": {"when_no_spare": "wait", "min_nodes": 1}})


REPLANNED = {"devices": 2, "layout": "tp1.pp2.dp1.1f1b.mb4x3.none",
             "overrides": ["parallel.dp=1", "parallel.pp=2", "data.microbatches=3"],
             "tokens_per_s": 900.0, "gib": 0.1}
FULL = {"devices": 3, "layout": "tp1.pp3.dp1.1f1b.mb4x3.none", "overrides": [],
        "tokens_per_s": 1000.0, "gib": 0.1}
S3 = Settings(nodes=3, ranks_per_node=1, agent_timeout_s=5, node_counts=(3, 2),
              layouts={2: REPLANNED, 3: FULL}, refusals={1: "none of 40 layouts on 1 "
                                                            "devices fits h100-ndr's 76 GiB"},
              launch={"job_file": "/jobs/x.yaml", "overrides": ["optim.lr=0.001"],
                      "log_dir": "/runs/x/logs"})


def _restarting(nodes: dict) -> Observed:
    plan = {"generation": 0, "action": "run", "nodes": ["n0", "n1", "n2"],
            "ranks_per_node": 1, "world_size": 3, **S3.launch}
    return Observed(now=NOW, job=JobView(state="RESTARTING", generation=0), plan=plan,
                    nodes=nodes, latest_step=10)


def test_a_shrunk_generation_carries_the_planner_s_layout_and_the_event_names_both():
    two = {"n0": node("n0"), "n1": node("n1"), "n2": node("n2", alive=False)}
    d = decide(_restarting(two), S3)
    assert d.plan["nodes"] == ["n0", "n1"] and d.plan["world_size"] == 2
    assert d.plan["overrides"] == ["optim.lr=0.001", *REPLANNED["overrides"]]
    assert d.plan["layout"] == REPLANNED["layout"]
    assert ("shrunk to 2 of 3 nodes: the planner's layout tp1.pp2.dp1.1f1b.mb4x3.none instead "
            "of tp1.pp3.dp1.1f1b.mb4x3.none, predicted 900 tokens/s against 1,000 on 3; the "
            "checkpoint is resharded to it") in d.plan["reason"]
    (fields,) = [f for kind, _, f in d.events if kind == "generation"]
    assert fields == {"nodes": 2, "layout": REPLANNED["layout"], "tokens_per_s": 900.0,
                      "full_layout": FULL["layout"], "full_tokens_per_s": 1000.0}
    # all three nodes again: the job file's own layout, no overrides added
    three = {n: node(n) for n in ("n0", "n1", "n2")}
    d = decide(_restarting(three), S3)
    assert d.plan["overrides"] == ["optim.lr=0.001"] and "layout" not in d.plan
    assert "shrunk" not in d.plan["reason"]


def test_below_what_any_layout_runs_on_the_job_waits_with_the_planner_s_reason():
    one = {"n0": node("n0"), "n1": node("n1", alive=False), "n2": node("n2", alive=False)}
    d = decide(_restarting(one), S3)
    assert d.plan is None and d.job["state"] == WAITING
    assert d.job["reason"].startswith(
        "waiting for nodes: the layout needs 2 to 3 x 1 ranks, 1 healthy node(s) available "
        "(on 1: none of 40 layouts on 1 devices fits h100-ndr's 76 GiB); n1 silent")


def test_a_shrunk_job_grows_to_a_middle_size_only_for_a_predicted_gain():
    from test_resize import shrunk

    five = Settings(nodes=5, ranks_per_node=1, stop_grace_s=30, node_counts=(5, 4, 3, 2, 1),
                    layouts={1: {**FULL, "tokens_per_s": 500.0},
                             2: {**FULL, "tokens_per_s": 400.0}}, launch=S3.launch)
    # one node free: 2 of 5 would be slower than 1 by the planner: no stop for it
    assert not [e for e in decide(shrunk(spare_count=1), five).events if e[0] == "grow"]
    faster = dataclasses.replace(five, layouts={1: five.layouts[1],
                                                2: {**FULL, "tokens_per_s": 800.0}})
    assert [e for e in decide(shrunk(spare_count=1), faster).events if e[0] == "grow"]
    # back to all five nodes it goes whatever the prediction: the size the job asked for
    assert [e for e in decide(shrunk(spare_count=4), five).events if e[0] == "grow"]


def test_a_first_generation_starts_short_only_when_the_job_names_min_nodes():
    one = {"n0": node("n0"), "n1": node("n1", alive=False)}
    fresh = Observed(now=NOW + 60, job=JobView(state=WAITING, next_plan_at=NOW), plan=None,
                     nodes=one, latest_step=None)
    named = Settings(nodes=2, ranks_per_node=1, agent_timeout_s=5, node_counts=(2, 1),
                     launch=S3.launch)
    assert decide(fresh, named).plan["nodes"] == ["n0"]  # min_nodes: starts on what it has
    floor = dataclasses.replace(named, start_short=False)  # the default floor: lost nodes only
    d = decide(fresh, floor)
    assert d.plan is None and d.job["state"] == WAITING
    assert d.job["reason"].startswith("waiting for nodes: the layout needs 2 x 1 ranks, 1 "
                                      "healthy node(s) available")  # all of them, to start
    assert node_counts(validate_job({**_job(), "supervision": {}}), 2, 1)[0] == (2, 1)


def test_a_planner_that_fails_refuses_its_counts_and_the_controller_still_starts(monkeypatch):
    from controller.control import settings

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(settings, "replan", broken)
    counts, layouts, refused = node_counts(validate_job(_job()), 4, 1)
    assert counts == (4,) and layouts == {}
    assert refused == {3: "the planner failed: ZeroDivisionError: a bug",
                       2: "the planner failed: ZeroDivisionError: a bug"}
