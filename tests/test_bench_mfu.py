"""bench/mfu.py's CPU parts: the timed window and its synchronisation count, both sides' runs
through it, the targets it prints, and bench/gpu.sh's time budget (a GPU runs the rest)."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import mfu  # noqa: E402
from bench.mfu_report import key_figures, mfu_target, print_mode, ratio_target  # noqa: E402
from bench.mfu_window import SYNC_MESSAGE, StepWindow, syncs_text  # noqa: E402

CPU = torch.device("cpu")


def synchronise() -> None:
    """What torch's sync debug mode says at a synchronising call."""
    warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)


def test_window_counts_each_steps_syncs_and_tells_unlogged_from_logged_steps():
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with StepWindow(CPU, steps=7, warmup=1, logged=lambda s: s % 3 == 0,
                        count_syncs=True) as window:
            for step in range(1, 8):
                window.step_start(step)
                for _ in range(step):  # step n synchronises n times
                    synchronise()
                warnings.warn(f"not a sync, step {step}", UserWarning, stacklevel=1)
    figures = window.figures()
    syncs = figures["syncs"]
    # step 1 is dropped, 7 closes the window: 2..6 are timed; 3 and 6 are logged
    assert syncs["per_step"] == {2: 2, 3: 3, 4: 4, 5: 5, 6: 6}
    assert syncs["unlogged_steps"] == [2, 4, 5]
    assert syncs["unlogged"] == pytest.approx(11 / 3)
    assert syncs["logged"] == pytest.approx(4.5)
    line = synchronise.__code__.co_firstlineno + 2
    assert syncs["sites"] == {f"tests/test_bench_mfu.py:{line}": 11}
    assert syncs["sites_logged"] == {f"tests/test_bench_mfu.py:{line}": 9}
    assert syncs_text(syncs) == "3.66667"
    # every other warning is shown once the window closes; no sync warning is
    assert [str(w.message) for w in shown] == [f"not a sync, step {s}" for s in range(1, 8)]
    assert len(figures["step_times_s"]) == 5
    assert figures["window_s"] == pytest.approx(sum(figures["step_times_s"]))
    assert figures["step_s"] == pytest.approx(figures["window_s"] / 5)


def test_on_a_cpu_nothing_is_counted_and_a_missed_step_is_an_error():
    with StepWindow(CPU, steps=4, warmup=1, logged=lambda s: False) as window:
        for step in (1, 2, 4):  # step 3's start never marked
            window.step_start(step)
            synchronise()
    assert window.syncs() is None and syncs_text(None) == "n/a (cpu)"
    with pytest.raises(RuntimeError, match="did not mark each step"):
        window.figures()
    with pytest.raises(ValueError, match="no step to time"):
        StepWindow(CPU, steps=3, warmup=2, logged=bool)


def small_bench(steps: int, warmup: int) -> mfu.Bench:
    return mfu.Bench(device=CPU, model=mfu.SMALL, seq_len=64, batch=2, steps=steps,
                     warmup=warmup, recipe="tensorwise", num_workers=0)


def test_both_sides_are_timed_step_by_step_from_the_same_weights():
    """The trainer's steps are marked through its per-step call (RankFaults.step_start): a
    trainer that stopped making it would fail here, not time the wrong thing."""
    torch.set_num_threads(1)
    bench = small_bench(steps=5, warmup=1)
    mode = mfu.Mode(False, "fp32", "none")
    ours = mfu.optimus_side(bench, mode)
    ref = mfu.reference_side(bench, mode, mfu.initial_weights(bench))
    for side in (ours, ref):
        assert len(side["step_times_s"]) == 3 and all(t > 0 for t in side["step_times_s"])
        assert side["syncs"] is None  # a CPU
    assert ours["first_loss"] == pytest.approx(ref["first_loss"], abs=1e-4)
    figures = mfu.side_figures(ours, bench.tokens_per_step, flops=10, peak=100.0)
    assert figures["tokens_per_s"] == pytest.approx(128 / (sum(ours["step_times_s"]) / 3))
    assert figures["mfu"] == pytest.approx(10 * figures["tokens_per_s"] / 100.0)


def test_the_targets_issue_55_sets_and_how_a_mode_prints(capsys):
    assert ratio_target("compiled-bf16-none") == 1.00 and ratio_target("eager-bf16-op") == 0.97
    assert mfu_target("compiled-bf16-none", "NVIDIA H200") == 0.52
    assert mfu_target("compiled-bf16-none", "NVIDIA H100 80GB HBM3") is None
    assert mfu_target("compiled-float8-none", "NVIDIA H200") is None
    side = {"tokens_per_s": 99.0, "tflops": 494.5, "mfu": 0.5, "max_memory_bytes": 2**31,
            "first_loss": 10.4}
    entry = {"ratio": 0.99,
             "optimus": {**side, "syncs": {"unlogged": 2.0, "logged": 3.0,
                                           "sites": {"optimus/train.py:249": 4}}},
             "reference": {**side, "tokens_per_s": 100.0,
                           "syncs": {"unlogged": 0.0, "logged": 1.0, "sites": {}}}}
    print_mode("compiled-bf16-none", entry, "NVIDIA H200", True, 989e12)
    print_mode("compiled-bf16-op", entry, "NVIDIA H200", True, 989e12)
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("ratio 0.990 (target >= 1: MISSED)")
    assert "MFU 50.0% (reference 50.0%), peak 989 TFLOP/s (target >= 0.52: MISSED)" in out[1]
    assert out[2] == ("    synchronisations per unlogged step: optimus 2, reference 0 (target 0 "
                      "for optimus: MISSED); per logged step 3 / 1; optimus's from "
                      "optimus/train.py:249 x4")
    assert out[3].endswith("ratio 0.990 (target >= 0.97: met)") and "target" not in out[4]


def test_key_figures_are_read_out_of_the_json():
    entry = {"ratio": 0.9, "optimus": {"mfu": 0.45, "tokens_per_s": 6e4,
                                       "syncs": {"unlogged": 7.0}},
             "reference": {"syncs": {"unlogged": 0.0}}}
    info = {"modes": {"compiled-bf16-none": entry},
            "float8_speedup": {"compiled-float8-none": {"optimus": 1.1, "reference": 1.2}}}
    assert key_figures(info) == {
        "mode": "compiled-bf16-none", "ratio": 0.9, "mfu": 0.45, "tokens_per_s": 6e4,
        "float8_speedup": 1.1, "syncs_per_unlogged_step": 7.0,
        "reference_syncs_per_unlogged_step": 0.0}
    assert set(key_figures({}).values()) == {None, "compiled-bf16-none"}


def test_mfu_on_a_cpu_writes_the_window_and_says_no_sync_count(tmp_path):
    out = tmp_path / "mfu.json"
    done = subprocess.run([sys.executable, "bench/mfu.py", "--device", "cpu", "--modes",
                           "eager-fp32-none", "--steps", "5", "--warmup", "1", "--seq", "64",
                           "--batch", "2", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "    synchronisations per unlogged step: n/a (cpu)" in done.stdout.splitlines()
    info = json.loads(out.read_text())
    assert (info["timed_steps"], info["log_every"], info["step_figure"]) == (3, 3, "window mean")
    for side in ("optimus", "reference"):
        figures = info["modes"]["eager-fp32-none"][side]
        assert len(figures["step_times_s"]) == 3 and figures["syncs"] is None
        assert figures["tokens_per_s"] == pytest.approx(128 / figures["step_s"])


def test_gpu_sh_keeps_to_its_deadline_and_returns_few_files(tmp_path):
    """With no time left, every part that gpu_check did not leave out is left out for time;
    what comes back is gpu-results.json, gpu.log and parts.tar (8 files at most return)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho no GPU here\n")
    (fake / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHON": sys.executable,
           "GPU_DEADLINE_S": "0", "GPU_WHEELS": str(tmp_path / "no-wheels")}
    done = subprocess.run(["bash", "bench/gpu.sh", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((out / "gpu-results.json").read_text())
    parts = results["parts"]
    assert list(parts) == ["mfu", "torchtitan", "gemm_sweep", "profile", "moe", "mfu_rest",
                           "checkpoint", "planner_memory"]
    for name in ("torchtitan", "gemm_sweep", "profile"):  # tried on a CUDA machine only: here,
        # no time
        assert parts[name] == {"exit": None, "seconds": 0, "skipped": True,
                               "why": "no time left"}
    for name in ("mfu", "mfu_rest", "moe", "checkpoint", "planner_memory"):
        assert parts[name]["why"] == "bench/gpu_check.py"
    assert results["key"]["ratio"] is None and results["key"]["optimus_over_torchtitan"] is None
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.json", "gpu.log"]
