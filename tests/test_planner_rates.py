"""Matmul rates by shape (issue 61): the GEMM sweep on a CPU into a table, the table checked
where it is read, looked up in log space, used by the step time; `optimus plan` saying where
its rates come from, and its --explain the stack factors with their sources.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from optimus.cli import main
from optimus.config import ConfigError, validate_job
from optimus.planner.machines import get_machine
from optimus.planner.memory import PlanLayout
from optimus.planner.rates import FORMAT, MAX_BYTES, load_rates
from optimus.planner.steptime import step_time
from optimus.runtime.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TINY = str(ROOT / "jobs" / "tiny-gpt.yaml")
SIZES = (128, 1024, 8192)


def _table(rate=lambda m, n, k: 100.0, attention=50.0, **extra) -> dict:
    return {"format": FORMAT, "device": "test", "torch": "0", "date": "2026-12-02",
            "matmul": {"bf16": [[m, n, k, rate(m, n, k)] for m in SIZES for n in SIZES
                                for k in SIZES]},
            "attention": {"bf16": [[s, 64, attention] for s in (256, 4096)]}, **extra}


def _write(tmp_path, table, name="rates.json") -> Path:
    path = tmp_path / name
    path.write_text(table if isinstance(table, str) else json.dumps(table))
    return path


def _profiles(tmp_path, rates: str, base: str = "h100-ndr") -> Path:
    fields = get_machine(base).model_dump(exclude={"name", "rates"})
    path = tmp_path / "machines.yaml"
    path.write_text(json.dumps({"measured": {**fields, "rates": rates}}))
    return path


def test_the_sweep_runs_on_a_cpu_into_a_table_a_profile_loads(tmp_path):
    import torch

    from bench.gemm_sweep import main as sweep

    out = sweep(["--device", "cpu", "--out", str(tmp_path / "cpu.json"), "--each-ms", "0.5"])
    raw = json.loads(out.read_text())
    assert (raw["device"], raw["torch"], raw["format"]) == ("cpu", torch.__version__, FORMAT)
    assert len(raw["date"]) == 10 and sorted(raw["matmul"]) == ["bf16", "fp32"]
    assert len(raw["matmul"]["fp32"]) == 8 and raw["attention"]["fp32"]  # a 2 x 2 x 2 grid
    # a profile file beside it names it relatively; the planner then reads rates by shape
    machine = get_machine("measured", _profiles(tmp_path, "cpu.json", base="cpu"))
    assert machine.rate_table.device == "cpu"
    assert machine.rates_note().startswith(
        f"matmul rates measured on cpu, torch {torch.__version__}")
    cfg = validate_job({"name": "t", "model": {"vocab_size": 256, "dim": 64, "n_layers": 2,
                                               "n_heads": 4, "max_seq_len": 128},
                        "data": {"seq_len": 128, "batch_size": 2}}).model
    lay = PlanLayout(seq_len=128, microbatch_size=2, precision="fp32")
    measured = step_time(cfg, lay, machine, 2)
    guessed = step_time(cfg, lay, get_machine("cpu"), 2)
    assert measured.compute > 0 and measured.compute != guessed.compute
    assert measured.memory_s == guessed.memory_s  # the element-wise work is the same bytes


def test_plan_says_where_its_rates_come_from(tmp_path):
    run = CliRunner()
    plain = run.invoke(main, ["plan", TINY, "--devices", "2", "--machine", "h100-ndr",
                              "--top", "1"])
    assert plain.exit_code == 0, plain.output
    assert plain.output.splitlines()[0].startswith(
        "h100-ndr: matmul rates UNCALIBRATED: no GEMM sweep for this profile (peak x sustained "
        "0.613 x a shape factor; bench/gemm_sweep.py measures them)")
    answer = json.loads(run.invoke(main, ["plan", TINY, "--devices", "2", "--machine",
                                          "h100-ndr", "-o", "json"]).stdout)
    assert answer["rates"]["calibrated"] is False
    profiles = _profiles(tmp_path, str(_write(tmp_path, _table())))
    measured = run.invoke(main, ["plan", TINY, "--devices", "2", "--machines", str(profiles),
                                 "--machine", "measured", "--top", "1"])
    assert measured.exit_code == 0, measured.output
    assert "measured: matmul rates measured on test, torch 0, 2026-12-02" in measured.output
    answer = json.loads(run.invoke(main, ["plan", TINY, "--devices", "2", "--machines",
                                          str(profiles), "--machine", "measured", "-o",
                                          "json"]).stdout)
    assert answer["rates"]["calibrated"] is True and answer["rates"]["device"] == "test"


def test_explain_states_the_stack_factors_with_their_sources():
    run = CliRunner()
    args = ["plan", TINY, "--devices", "2", "--machine", "h100-ndr", "--explain",
            "tp1.pp1.dp2.mb1x1.none"]
    eager = run.invoke(main, args)
    assert eager.exit_code == 0, eager.output
    assert "stack_s" in eager.output and "memory_s" in eager.output
    assert ("stack: optimus (eager) at 0.934 of the plain loop's rate (stack_s is the "
            "difference); measured: Optimus over the plain loop") in eager.output
    assert "torchtitan (eager): 1.07x ours; assumed equal to the plain loop" in eager.output
    assert "megatron-core" not in eager.output  # no eager figure for it
    compiled = run.invoke(main, [*args, "--set", "training.compile=true"])
    assert "stack: optimus (compiled) at 0.818" in compiled.output
    assert "megatron-core (compiled): 1.22x ours; assumed equal to the compiled plain loop" \
        in compiled.output
    answer = json.loads(run.invoke(main, [*args, "-o", "json"]).stdout)
    assert answer["rates"]["calibrated"] is False and answer["stack"][0].startswith("stack: ")
    assert answer["compiled"] is False and {"stack_s", "memory_s"} <= set(answer["step_terms_s"])


def test_a_flat_table_is_the_uncalibrated_model_at_its_rate(tmp_path):
    """Every matmul and attention at one rate R: the compute is the FLOPs over R, as the
    uncalibrated model gives at peak x sustained x shape = R."""
    cfg = validate_job({"name": "t", "model": {"vocab_size": 32000, "dim": 1024,
                                               "n_layers": 4, "n_heads": 16, "n_kv_heads": 4,
                                               "max_seq_len": 1024},
                        "data": {"seq_len": 1024, "batch_size": 8}}).model
    lay = PlanLayout(ParallelDims(dp=2), microbatch_size=4, seq_len=1024, recompute="full")
    flat = get_machine("measured", _profiles(
        tmp_path, str(_write(tmp_path, _table(lambda m, n, k: 300.0, attention=300.0)))))
    shape = 4096 / (4096 + 128) * 1024 / (1024 + 128)
    same = get_machine("h100-ndr").model_copy(update={"sustained": 300 / 989 / shape})
    assert step_time(cfg, lay, flat, 8).compute == pytest.approx(
        step_time(cfg, lay, same, 8).compute, rel=1e-9)
    # a device faster on large matmuls gives the wider model more of its peak
    steep = get_machine("measured", _profiles(tmp_path, str(_write(
        tmp_path, _table(lambda m, n, k: 50.0 * math.log2(min(m, n, k)) - 300,
                         attention=300.0), "steep.json"))))
    wide = cfg.model_copy(update={"dim": 4096})
    narrow_mfu = step_time(cfg, lay, steep, 8).compute / step_time(cfg, lay, flat, 8).compute
    wide_mfu = step_time(wide, lay, steep, 8).compute / step_time(wide, lay, flat, 8).compute
    assert wide_mfu < narrow_mfu


def test_float8_jobs_take_the_float8_rates_for_the_blocks_linears(tmp_path):
    """torchao converts the blocks' linear layers; the head and attention stay in bf16.
    Without a table float8 is not priced."""
    table = _table(lambda m, n, k: 200.0, attention=1e5)
    table["matmul"]["float8"] = [[m, n, k, 400.0] for m, n, k, _ in table["matmul"]["bf16"]]
    machine = get_machine("measured", _profiles(tmp_path, str(_write(tmp_path, table))))
    cfg = validate_job({"name": "t", "model": {"vocab_size": 32000, "dim": 1024,
                                               "n_layers": 4, "n_heads": 16,
                                               "max_seq_len": 1024},
                        "data": {"seq_len": 1024, "batch_size": 4}}).model
    lay = PlanLayout(microbatch_size=4, seq_len=1024)
    bf16 = step_time(cfg, lay, machine, 4).compute
    float8 = step_time(cfg, PlanLayout(microbatch_size=4, seq_len=1024, float8=True),
                       machine, 4).compute
    tokens, d, f = 4096, 1024, cfg.ffn_dim
    blocks = 6 * 4 * (4 * d * d + 3 * d * f) * tokens  # q, k, v, o and the SwiGLU, 4 layers
    assert bf16 - float8 == pytest.approx(blocks / 200e12 - blocks / 400e12, rel=1e-6)
    plain = get_machine("h100-ndr")
    assert step_time(cfg, PlanLayout(microbatch_size=4, seq_len=1024, float8=True), plain,
                     4).compute == step_time(cfg, lay, plain, 4).compute


def test_rates_interpolate_in_log_space_and_clamp(tmp_path):
    # a rate that is a power law in each size is linear in log space: interpolation exact
    table = load_rates(_write(tmp_path, _table(lambda m, n, k: 2.0 * (m * n) ** 0.25 * k ** 0.1)))

    def law(m, n, k):
        return 2.0 * (m * n) ** 0.25 * k ** 0.1 * 1e12

    for shape in ((128, 1024, 8192), (362, 2896, 181), (4096, 500, 1024)):
        assert table.matmul("bf16", *shape) == pytest.approx(law(*shape), rel=1e-9)
    assert table.matmul("bf16", 10, 10**6, 8192) == pytest.approx(law(128, 8192, 8192))
    assert table.matmul("float8", 128, 128, 128) == table.matmul("bf16", 128, 128, 128)
    assert table.attention("bf16", 1000, 128) == pytest.approx(50e12)  # nearest head dim
    assert table.attention("fp32", 1000, 64) == pytest.approx(50e12)


@pytest.mark.parametrize("content,says", [
    ("{not json", "not JSON"),
    (b"\x80\x04\x95pickle", "not JSON"),
    (_table(format="other"), '"format" must be "optimus-rates/1"'),
    (_table(extra=1), "unknown field 'extra'"),
    ({**_table(), "device": ""}, '"device" must be a string'),
    ({**_table(), "matmul": {"int8": [[1, 1, 1, 1.0]]}}, "unknown dtype 'int8'"),
    ({**_table(), "matmul": {"bf16": [[128, 128, 128, -1.0]]}}, "matmul.bf16 row 0"),
    ({**_table(), "matmul": {"bf16": [[128, 128, 128.5, 1.0]]}}, "positive integer sizes"),
    ({**_table(), "matmul": {"bf16": [[128, 128, 128, 1.0], [128, 128, 128, 2.0]]}},
     "measured twice"),
    ({**_table(), "matmul": {"bf16": [[128, 128, 128, 1.0], [256, 128, 256, 2.0]]}},
     "not a full grid: 2 shapes where 2 x 1 x 2 sizes need 4"),
    ({**_table(), "attention": {"bf16": [[256, 64.5, 1.0]]}}, "head_dim 64.5"),
])
def test_a_bad_table_is_refused_with_one_message(tmp_path, content, says):
    path = tmp_path / "bad.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError) as refused:
        load_rates(path)
    assert says in str(refused.value) and "bench/gemm_sweep.py" in str(refused.value)


def test_a_table_too_large_or_missing_is_refused_where_the_profile_is_read(tmp_path):
    big = _write(tmp_path, " " * (MAX_BYTES + 1), "big.json")
    with pytest.raises(ConfigError, match="larger than 2 MiB"):
        load_rates(big)
    profiles = _profiles(tmp_path, "missing.json")
    with pytest.raises(ConfigError, match="cannot read the rate table"):
        get_machine("measured", profiles)
    refused = CliRunner().invoke(main, ["plan", TINY, "--devices", "2", "--machines",
                                        str(profiles), "--machine", "measured"])
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1
    assert "missing.json" in refused.output
