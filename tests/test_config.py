"""Job files: every refusal names its key and a fix; overrides, show and check work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from optimus.cli import main
from optimus.config import ConfigError, load_job, validate_job

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "jobs" / "tiny-gpt.yaml"


def job(**sections) -> dict:
    """A valid small job; keyword arguments replace or extend its sections."""
    raw = {"name": "t", "model": {"vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 4,
                                  "n_kv_heads": 2},
           "optim": {"steps": 10, "warmup_steps": 2},
           "data": {"seq_len": 32, "batch_size": 8, "microbatches": 2}}
    for name, values in sections.items():
        if isinstance(values, dict) and isinstance(raw.get(name), dict):
            raw[name] = {**raw[name], **values}
        else:
            raw[name] = values
    return raw


def refusal(raw: dict, world: int | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate_job(raw, source="job.yaml", world=world)
    return info.value


def keys(err: ConfigError) -> list[str]:
    return [key for key, _, _ in err.problems]


def test_valid_job_resolves_defaults_and_layout():
    cfg = validate_job(job(), world=4)
    assert cfg.model.ffn_dim == 192  # 8/3 * 64 = 170.67 -> next multiple of 64
    assert cfg.model.n_kv_heads == 2
    assert cfg.resolved_run_dir == "runs/t"
    assert cfg.resolved_checkpoint_dir == "runs/t/checkpoints"


def test_unknown_key_is_named_with_a_suggestion():
    err = refusal(job(model={"n_layer": 3}))
    assert keys(err) == ["model.n_layer"]
    assert "did you mean `n_layers`" in str(err)
    err = refusal(job(optimizer={"lr": 1.0}))
    assert keys(err) == ["optimizer"] and "did you mean `optim`" in str(err)


@pytest.mark.parametrize("section,key,value,expect", [
    ("model", "n_layers", "4", "valid integer"),
    ("model", "n_layers", 2.5, "valid integer"),
    ("optim", "lr", "fast", "valid number"),
    ("optim", "fused", "yes", "valid boolean"),
    ("parallel", "device", "tpu", "'auto', 'cpu', 'cuda' or 'xpu'"),
])
def test_wrong_types_are_refused(section, key, value, expect):
    err = refusal(job(**{section: {key: value}}))
    assert keys(err) == [f"{section}.{key}"]
    assert expect in str(err) and repr(value) in str(err)


@pytest.mark.parametrize("section,key,value", [
    ("model", "n_layers", 0), ("optim", "lr", 0.0), ("optim", "beta2", 1.0),
    ("data", "batch_size", -8), ("parallel", "tp", 0), ("parallel", "dp", -2),
])
def test_values_out_of_range_are_refused(section, key, value):
    err = refusal(job(**{section: {key: value}}))
    assert keys(err) == [f"{section}.{key}"]


def test_world_size_must_match_the_layout():
    err = refusal(job(parallel={"dp": 2, "tp": 2}), world=8)
    assert keys(err) == ["parallel.dp"]
    assert "2 x 2 x 1 = 4 but the world has 8 ranks" in str(err)
    assert "set parallel.dp to 4" in str(err)
    err = refusal(job(parallel={"tp": 4}), world=6)
    assert keys(err) == ["parallel"] and "does not divide the world size 6" in str(err)


def test_heads_and_kv_heads_must_split_over_tp():
    err = refusal(job(model={"n_heads": 4, "n_kv_heads": 4}, parallel={"tp": 8}), world=8)
    assert "n_heads=4 is not divisible by tp=8" in str(err)
    assert "use tp among 1, 2, 4" in str(err)
    err = refusal(job(model={"dim": 96, "n_heads": 6, "n_kv_heads": 3}, parallel={"tp": 2}),
                  world=2)
    assert keys(err) == ["parallel.tp"] and "n_kv_heads=3" in str(err)
    # fewer kv heads than tp, tp a multiple of them: each kv head is replicated, accepted
    validate_job(job(model={"n_heads": 4, "n_kv_heads": 2}, parallel={"tp": 4}), world=4)


def test_fewer_layers_than_pipeline_stages():
    err = refusal(job(model={"n_layers": 3}, parallel={"pp": 2, "virtual_stages": 2,
                                                       "schedule": "interleaved_1f1b"}), world=2)
    assert keys(err) == ["parallel.pp"]
    assert "3 layers cannot fill pp x virtual_stages = 4" in str(err)


def test_vocab_and_sequence_must_split_over_tp():
    err = refusal(job(model={"vocab_size": 257}, data={"seq_len": 30}, parallel={"tp": 4}),
                  world=4)
    assert sorted(keys(err)) == ["data.seq_len", "model.vocab_size"]
    assert "pad it to 260" in str(err) and "use a multiple of 4" in str(err)


@pytest.mark.parametrize("parallel,microbatches,expect", [
    ({"pp": 2, "schedule": "zbv_zero_bubble"}, 2, "exactly 2"),
    ({"pp": 2, "virtual_stages": 2, "schedule": "dualpipev"}, 2, "microbatches"),
    ({"pp": 4, "schedule": "1f1b"}, 2, "microbatches"),
    ({"pp": 2, "virtual_stages": 2, "schedule": "1f1b"}, 2, "virtual"),
])
def test_pipeline_schedules_refuse_what_they_cannot_run(parallel, microbatches, expect):
    err = refusal(job(parallel=parallel, data={"batch_size": 8, "microbatches": microbatches}),
                  world=parallel["pp"])
    assert keys(err) == ["parallel.schedule"]
    assert expect in str(err)


def test_virtual_stages_need_a_pipeline():
    err = refusal(job(parallel={"virtual_stages": 2}), world=1)
    assert keys(err) == ["parallel.virtual_stages"]


def test_batch_must_split_into_microbatches_and_dp():
    err = refusal(job(data={"batch_size": 12, "microbatches": 2}), world=4)
    assert keys(err) == ["data.batch_size"]
    assert "microbatches x dp = 2 x 4 = 8" in str(err) and "e.g. 16" in str(err)
    err = refusal(job(data={"batch_size": 9, "microbatches": 2}))
    assert "not divisible by microbatches=2" in str(err)


def test_experts_borrow_from_dp():
    err = refusal(job(parallel={"ep": 4}, model={"moe": {"experts": 8}}), world=2)
    assert keys(err) == ["parallel.ep"] and "use ep among 1, 2" in str(err)
    err = refusal(job(parallel={"ep": 2}), world=2)  # a dense model has no experts to shard
    assert keys(err) == ["parallel.ep"] and "ep=2 needs experts" in str(err)


def test_other_cross_field_checks():
    err = refusal(job(data={"seq_len": 4096}, optim={"warmup_steps": 11, "min_lr": 1.0},
                      run_dir="runs/{job}"))
    assert sorted(keys(err)) == ["data.seq_len", "optim.min_lr", "optim.warmup_steps",
                                 "run_dir"]
    assert refusal(job(data={"source": "shards"})).problems[0][0] == "data.path"
    err = refusal(job(fault_injection={"faults": [{"kind": "kill_rank", "step": 3}]}))
    assert keys(err) == ["fault_injection.faults.0"] and "needs `rank`" in str(err)
    err = refusal(job(fault_injection={"faults": [{"kind": "kill_rank", "step": 3,
                                                   "rank": 5}]}), world=4)
    assert keys(err) == ["fault_injection.faults.0.rank"]


def test_overrides_parse_values_as_yaml(tmp_path):
    path = tmp_path / "j.yaml"
    path.write_text(yaml.safe_dump(job()))
    cfg = load_job(path, ["optim.lr=1e-3", "model.n_layers=6", "optim.fused=false",
                          "data.path=", "name=other"])
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.model.n_layers == 6 and cfg.optim.fused is False and cfg.name == "other"
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_job(path, ["optim.lr"])
    with pytest.raises(ConfigError, match="`name` is a value, not a section"):
        load_job(path, ["name.x=1"])
    with pytest.raises(ConfigError, match="model.n_layer: unknown key"):
        load_job(path, ["model.n_layer=3"])


def test_yaml_reads_exponent_floats_and_reports_syntax_errors(tmp_path):
    path = tmp_path / "j.yaml"
    path.write_text("name: t\noptim:\n  lr: 3e-4\n  min_lr: 1E-5\n")
    cfg = load_job(path)
    assert cfg.optim.lr == pytest.approx(3e-4) and cfg.optim.min_lr == pytest.approx(1e-5)
    path.write_text("name: t\nmodel: {dim: 64\n")
    with pytest.raises(ConfigError, match=r"j.yaml at line \d+, column \d+: not valid YAML"):
        load_job(path)
    with pytest.raises(ConfigError, match="no such job file"):
        load_job(tmp_path / "missing.yaml")


def test_every_job_file_in_the_repo_validates():
    files = sorted((REPO / "jobs").glob("*.yaml"))
    assert TINY in files
    for path in files:
        load_job(path)


def test_the_mula_jobs_validate_on_768_aurora_tiles_with_their_sizes():
    from optimus.models import param_count

    runner = CliRunner()
    for name, layout in (("mula-1b", "dp=768 tp=1 pp=1 ep=1"),
                         ("mula-7b-a1b", "dp=768 tp=1 pp=1 ep=8")):
        result = runner.invoke(main, ["config", "check", str(REPO / "jobs" / f"{name}.yaml"),
                                      "--world", "768"])
        assert result.exit_code == 0 and layout in result.output, result.output
    dense = load_job(REPO / "jobs" / "mula-1b.yaml").model
    moe = load_job(REPO / "jobs" / "mula-7b-a1b.yaml").model
    assert 1.1e9 < param_count(dense) < 1.2e9
    assert 7.0e9 < param_count(moe) < 7.5e9 and 1.2e9 < param_count(moe, active=True) < 1.3e9


def test_the_paper_layouts_validate_for_their_world_sizes():
    runner = CliRunner()
    big = runner.invoke(main, ["config", "check", str(REPO / "jobs" / "gpt-175b.yaml"),
                               "--world", "1536"])
    assert big.exit_code == 0, big.output
    assert "dp=16 tp=8 pp=12 ep=1 virtual_stages=2" in big.output
    assert "96 microbatch(es) of 1 sequence(s)" in big.output
    small = runner.invoke(main, ["config", "check", str(REPO / "jobs" / "gpt-1.3b.yaml"),
                                 "--world", "32"])
    assert small.exit_code == 0 and "dp=32 tp=1 pp=1" in small.output
    wrong = runner.invoke(main, ["config", "check", str(REPO / "jobs" / "gpt-175b.yaml"),
                                 "--world", "768"])
    assert wrong.exit_code == 2 and "set parallel.dp to 8" in wrong.output


def test_config_show_prints_resolved_values():
    result = CliRunner().invoke(main, ["config", "show", str(TINY), "--set", "model.dim=256",
                                       "--world", "2", "-o", "json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["model"]["dim"] == 256
    assert shown["model"]["ffn_dim"] == 704  # 8/3 * 256 = 682.7 -> next multiple of 64
    assert shown["parallel"]["dp"] == 2


def test_config_check_reports_the_layout_or_refuses():
    runner = CliRunner()
    ok = runner.invoke(main, ["config", "check", str(TINY), "--world", "4"])
    assert ok.exit_code == 0
    assert "dp=4 tp=1 pp=1" in ok.output and "2 microbatch(es) of 2 sequence(s)" in ok.output
    bad = runner.invoke(main, ["config", "check", str(TINY), "--world", "3"])
    assert bad.exit_code == 2
    assert "data.batch_size: 16 is not divisible by microbatches x dp" in bad.output


def test_the_real_command_refuses_without_a_traceback():
    def check(world: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "optimus", "config", "check", str(TINY), "--world", world,
             "--set", "parallel.tp=3"], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr and proc.stdout == ""
        return proc.stderr

    # tp=3 fits neither the world of 8 nor n_heads=4: the world is named first...
    assert "parallel: tp x pp = 3 x 1 = 3 does not divide the world size 8" in check("8")
    # ...and on a world tp=3 fits, the heads.
    assert "parallel.tp: n_heads=4 is not divisible by tp=3" in check("3")


# Each wrong layout goes with a batch of 10 that microbatches x dp = 2 x dp does not divide
# either: the layout is named first, and alone; with the layout fixed, the batch is named.
@pytest.mark.parametrize("parallel,model,world,key,expect,fixed", [
    ({"dp": 3, "tp": 2, "pp": 2}, {}, 8, "parallel.dp",
     "dp x tp x pp = 3 x 2 x 2 = 12 but the world has 8 ranks", {"dp": 2}),
    ({"dp": 1, "tp": 2, "pp": 2}, {}, 8, "parallel.dp",
     "dp x tp x pp = 1 x 2 x 2 = 4 but the world has 8 ranks", {"dp": 2}),
    ({"dp": 2, "tp": 3}, {}, 8, "parallel.dp",  # tp=3 does not split n_heads=4 either
     "set parallel.dp: -1 and pick tp x pp dividing the world", {"dp": 4, "tp": 2}),
    ({"tp": 3}, {}, 8, "parallel", "tp x pp = 3 x 1 = 3 does not divide the world size 8",
     {"tp": 2}),
    ({"ep": 4}, {"moe": {"experts": 8}}, 2, "parallel.ep",
     "ep=4 does not divide dp=2; experts borrow their ranks from dp", {"ep": 2}),
], ids=["too-many", "too-few", "not-dividing-dp", "not-dividing-tp", "ep-over-dp"])
def test_the_layout_is_named_before_what_depends_on_it(parallel, model, world, key, expect,
                                                        fixed):
    data = {"batch_size": 10, "microbatches": 2}
    err = refusal(job(parallel=parallel, model=model, data=data), world=world)
    first_key, first_what, first_fix = err.problems[0]
    assert first_key == key and expect in f"{first_what} — fix: {first_fix}", str(err)
    if key == "parallel.ep":  # dp fits the world: the batch split over it is known to be wrong
        assert keys(err) == ["parallel.ep", "data.batch_size"]
    else:  # what the layout decides waits until the layout fits the world
        assert keys(err) == [key]
        assert str(err).startswith(f"job.yaml: {key}: {first_what}")
    err = refusal(job(parallel={**parallel, **fixed}, model=model, data=data), world=world)
    assert keys(err) == ["data.batch_size"]
    assert "is not divisible by microbatches x dp" in str(err)


def test_without_a_world_only_what_holds_on_every_world_is_checked():
    # The layout and the batch split wait for the world: `config check --world` names them.
    raw = job(parallel={"dp": 3, "tp": 2, "pp": 2}, data={"batch_size": 10})
    assert validate_job(raw).parallel.dp == 3
    # What no world can mend is refused at once, and still after a misfit layout.
    raw = job(parallel={"dp": 3, "tp": 2, "pp": 2}, optim={"min_lr": 1.0})
    assert keys(refusal(raw)) == ["optim.min_lr"]
    assert keys(refusal(raw, world=8)) == ["parallel.dp", "optim.min_lr"]
    result = CliRunner().invoke(main, ["config", "check", str(TINY), "--world", "8",
                                       "--set", "parallel.dp=3", "--set", "parallel.tp=2",
                                       "--set", "parallel.pp=2", "--set", "data.batch_size=10"])
    assert result.exit_code == 2
    assert "parallel.dp: dp x tp x pp = 3 x 2 x 2 = 12 but the world has 8 ranks" in \
        result.output and "batch_size" not in result.output


@pytest.mark.parametrize("text,expect", [
    ("", "the job file is empty"),
    ("  \n\n\t\n", "the job file is empty"),
    ("# name: t\n\n# model: {dim: 64}\n", "the job file is empty"),
    ("- name: t\n- model: {}\n", "the job file is a list, not a mapping of sections"),
    ("tiny-gpt\n", "the job file is a single value ('tiny-gpt'), not a mapping"),
], ids=["zero-bytes", "whitespace", "comments", "list", "scalar"])
def test_an_empty_or_shapeless_job_file_is_refused_in_one_line(tmp_path, text, expect):
    path = tmp_path / "EMPTY.yaml"
    path.write_text(text)
    optimus = Path(sys.executable).with_name("optimus")
    command = [str(optimus)] if optimus.exists() else [sys.executable, "-m", "optimus"]
    proc = subprocess.run([*command, "config", "check", str(path), "--world", "1"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith(f"error: {path}: {expect}"), proc.stderr
    assert "fix:" in proc.stderr
