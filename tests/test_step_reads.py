"""A steady-state step waits on the device no more than a plain loop does, and dispatches about
as many ops (bench/step_counts.py counts them on this CPU: what a device would pay)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import step_counts  # noqa: E402


@pytest.fixture(scope="module")
def counts():
    # log_every 4 over 16 steps: steps 1-4, 8, 12 and 16 logged, the rest not.
    job = step_counts.tiny_job(16, 4)
    return step_counts.compare(job)


def test_an_unlogged_step_reads_nothing_more_than_the_plain_loop(counts):
    assert counts["optimus"]["unlogged"]["steps"] >= 5
    assert counts["plain"]["unlogged"]["host_reads"] == 0
    assert counts["unlogged"]["extra_host_reads"] == 0, counts


def test_a_logged_step_reads_its_figures_once(counts):
    assert counts["optimus"]["logged"]["host_reads"] <= 1, counts
    assert counts["logged"]["extra_host_reads"] <= 0, counts


def test_a_step_dispatches_within_three_percent_of_the_plain_loops_ops(counts):
    assert counts["unlogged"]["ops_ratio"] <= 1.03, counts
    assert counts["logged"]["ops_ratio"] <= 1.03, counts


def test_the_counts_see_a_host_read_where_there_is_one():
    """The counter is not blind: a `.item()` added to every step is counted as one read more."""
    job = step_counts.tiny_job(8, 4)
    inner = step_counts.optimus.train.train_step

    def reading(*args, **kwargs):
        out = inner(*args, **kwargs)
        out.pending.host.sum().item()
        return out

    step_counts.optimus.train.train_step = reading
    try:
        steps = step_counts.optimus_steps(job)
    finally:
        step_counts.optimus.train.train_step = inner
    unlogged = step_counts.steady(steps, logged=False)
    assert unlogged and all(s.host_reads == 1 for s in unlogged)
    logged = step_counts.steady(steps, logged=True)
    assert logged and all(s.host_reads == 2 for s in logged)  # its own wait, and the item


def test_the_spike_and_nan_paths_keep_the_step_free_of_host_reads():
    """With the stability rules armed early (the device holds spikes back from the host's
    thresholds) and MoE-free grad-norm rules on, an unlogged step still reads nothing."""
    job = step_counts.tiny_job(16, 4, stability={"warmup_steps": 2, "window": 4,
                                                 "grad_ratio": 50.0})
    steps = step_counts.optimus_steps(job)
    unlogged = step_counts.steady(steps, logged=False)
    assert unlogged and all(s.host_reads == 0 for s in unlogged), [
        (s.step, s.ops[step_counts.HOST_READ], s.waits) for s in unlogged]


def test_the_overhead_bench_prints_the_counts_and_the_launch_bound_ratio(capsys):
    from bench import overhead

    results = overhead.main(["--mode", "launch", "--rounds", "1", "--steps", "8"])
    assert results["counts"]["unlogged"]["extra_host_reads"] == 0
    (row,) = results["modes"]
    assert row["mode"] == "launch" and row["target"] == 1.05
    assert row["ratio"] == row["optimus_ms"] / row["plain_ms"]
    said = capsys.readouterr().out
    assert "unlogged host reads 0 (loop 0, extra 0; target 0)" in said
    assert "launch: optimus" in said and "(target <= 1.05)" in said


def _reads(rank, world_size, parallel, training):
    job = step_counts.tiny_job(16, 4, world=world_size, parallel=parallel, training=training)
    steps = step_counts.optimus_steps(job)
    return {kind: [s.host_reads for s in step_counts.steady(steps, kind == "logged")]
            for kind in ("unlogged", "logged")}


@pytest.mark.parametrize("world,parallel,training", [
    (2, {"dp": 2}, {}), (2, {"dp": 1, "tp": 2}, {}),
    (2, {"dp": 1, "pp": 2, "schedule": "1f1b"}, {}),
    (1, {}, {"mixed_precision": "bf16"}),
], ids=["DP2-FSDP", "TP2", "PP2", "bf16-one-replica"])
def test_every_layouts_unlogged_step_reads_nothing_and_a_logged_one_once(
        run_ranks, world, parallel, training):
    """On every rank: the agreement and the peak memory go over the host's group, the loss's
    and tokens' sums, the clip's norm and the pipeline's losses stay on the device."""
    for rank in run_ranks(_reads, world, parallel, training, timeout=240):
        assert rank["unlogged"] and set(rank["unlogged"]) == {0}, rank
        assert rank["logged"] and set(rank["logged"]) == {1}, rank


def test_as_the_profiler_counts_them_nested_reads_included_the_step_reads_no_more_than_the_loop():
    """torch's profiler also sees reads made inside other ops' kernels (the model's own make
    some on a CPU, the same in both): Optimus's run reads no more a step than the loop's, which
    reads its loss on the steps Optimus logs (a 20-step run less a 12-step one)."""
    ours = step_counts.profiled_reads(step_counts.optimus_steps)
    plain = step_counts.profiled_reads(step_counts.plain_steps)
    assert ours <= plain, (ours, plain)
    assert plain - ours == pytest.approx(2 / 8)  # steps 16 and 20: the loop's two loss reads


def test_a_replicas_step_reads_nothing_more_on_the_host(tmp_path, monkeypatch):
    """Replicas that carry on (optimus/parallel/replica_mode.py): the quorum's exchange keeps its
    figures on the device, and the newest quorum id its members saw is read one step late,
    from host memory: an unlogged step still reads nothing. A quorum of this one replica."""
    import json

    import torch.distributed as dist

    from optimus.contract.env import QUORUM_FILE, REPLICA
    from optimus.contract.records import Quorum

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    quorum = tmp_path / "quorum.json"
    quorum.write_text(json.dumps(Quorum(id=1, members=[0], store_addr="127.0.0.1",
                                        store_port=store.port).record()))
    monkeypatch.setenv(QUORUM_FILE, str(quorum))
    monkeypatch.setenv(REPLICA, "0")
    job = step_counts.tiny_job(16, 4, batch=8, run_dir=str(tmp_path / "run"),
                               parallel={"replicas": 2}, world=2)
    steps = step_counts.optimus_steps(job)
    assert len(steps) == 16
    unlogged = step_counts.steady(steps, logged=False)
    assert unlogged and all(s.host_reads == 0 for s in unlogged), \
        [(s.step, s.ops[step_counts.HOST_READ], s.waits) for s in unlogged]
    # The exchange ran in every step counted: its two clamps of the token count (the sum's
    # divisor, and the loss's) are the only ones beyond what a step without replicas runs.
    monkeypatch.delenv(QUORUM_FILE)
    alone = step_counts.steady(step_counts.optimus_steps(step_counts.tiny_job(
        16, 4, batch=8, run_dir=str(tmp_path / "alone"))), logged=False)
    assert {s.ops["aten.clamp"] - alone[0].ops["aten.clamp"] for s in unlogged} == {2}
