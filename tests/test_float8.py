"""Float8 linear layers (training.float8): which layers convert, a float8 step on the cpu, FSDP2's
float8 all-gather, and the refusals (tensor parallel, devices without float8, no torchao)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
import yaml

from optimus.config import ConfigError, JobConfig, check_job, validate_job
from optimus.config.schema import ModelConfig
from optimus.models import build_model, materialize
from optimus.parallel.float8 import (
    MIN_DIM,
    apply_float8,
    check_float8_here,
    float8_message,
    float8_problem,
    precompute_float8_scales,
    torchao_problem,
)

if torchao_problem():  # CI installs it (the dev extra); elsewhere: pip install 'optimus[float8]'
    pytest.skip("torchao is not installed", allow_module_level=True)

VOCAB = 256
TINY = 16  # min_dim for these tiny models: the size rule is tested on its own


def _model_cfg(**moe) -> ModelConfig:
    # ffn_dim 72 is not a multiple of 16: the dense feed-forward must stay as it is.
    return ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_dim=72 if not moe else 64, init_std=0.1,
                       **({"moe": moe} if moe else {}))


def _converted(model) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def test_dense_model_converts_block_linears_and_names_the_rest():
    model = build_model(_model_cfg(), seed=0, device="meta")
    skipped = dict(apply_float8(model, "tensorwise", min_dim=TINY))
    attention = [f"layers.{i}.attention.{w}" for i in (0, 1) for w in ("wq", "wk", "wv", "wo")]
    assert _converted(model) == attention
    ffn = {f"layers.{i}.feed_forward.{w}" for i in (0, 1) for w in ("w1", "w3", "w2")}
    assert set(skipped) == ffn | {"output"}
    assert "multiples of 16" in skipped["layers.0.feed_forward.w1"]
    assert "output head" in skipped["output"]
    line = float8_message("tensorwise", "cpu", list(skipped.items()))
    assert line.count("multiples of 16") == 2  # one reason per shape: 64x72 and 72x64
    assert "emulated" in line and line.endswith("; output (the output head: the logits stay "
                                                "in high precision for the loss)")


def test_moe_model_skips_router_and_grouped_experts():
    cfg = _model_cfg(experts=4, top_k=2, shared_experts=1, expert_ffn_dim=32, dense_layers=1)
    model = build_model(cfg, seed=0, device="meta")
    skipped = dict(apply_float8(model, "rowwise", min_dim=TINY))
    assert set(skipped) == {"layers.1.feed_forward.router", "layers.1.feed_forward.experts",
                            "output"}
    assert "router" in skipped["layers.1.feed_forward.router"]
    assert "not nn.Linear" in skipped["layers.1.feed_forward.experts"]
    converted = set(_converted(model))
    assert {"layers.0.feed_forward.w1", "layers.1.feed_forward.shared.w2"} <= converted
    assert "layers.1.feed_forward.router" not in converted


def test_layers_narrower_than_min_dim_stay_high_precision():
    model = build_model(_model_cfg(), seed=0, device="meta")
    skipped = dict(apply_float8(model, "tensorwise"))  # the default min_dim, 1024
    assert _converted(model) == []
    assert "narrower than 1024" in skipped["layers.0.attention.wq"]


def _one_step(recipe: str | None, autocast: bool = False):
    """Loss, wq's gradient and how far AdamW moved wq, from one step of the same model."""
    model = build_model(_model_cfg(), seed=0, device="meta")
    if recipe:
        apply_float8(model, recipe, min_dim=TINY)
    materialize(model, 0, "cpu")
    tokens = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    wq = model.layers["0"].attention.wq
    grad, before = wq.weight.grad.clone(), wq.weight.detach().clone()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    return model, loss.item(), grad, (wq.weight.detach() - before).abs().max().item()


@pytest.mark.parametrize(("recipe", "autocast"), [("tensorwise", False), ("rowwise", True)])
def test_a_float8_step_on_cpu_is_close_to_fp32_but_not_equal(recipe, autocast):
    """Tolerances. e4m3 keeps 3 mantissa bits (e5m2, tensorwise's gradient format, 2): one
    element rounds by up to 6% (12%). Sums over 64-176 terms average that out in the forward,
    and at initialisation the loss sits near ln(256) whatever small changes the logits take:
    the losses differ by about 1e-3 (measured 0.9e-3 to 3.5e-3), against 2e-2 allowed. A
    gradient is a product of rounded operands at every layer above: measured 15-19% relative
    L2 error, where bf16 autocast gives 1.3%. Between 5% and 40%: more than bf16 rounding, so
    float8 really ran, and far from the 100%+ of a wrong scale."""
    if float8_problem("cpu", recipe=recipe):  # torch 2.11's CPU: per-tensor scales only
        pytest.skip(float8_problem("cpu", recipe=recipe))
    _, ref_loss, ref_grad, _ = _one_step(None)
    model, loss, grad, moved = _one_step(recipe, autocast)
    assert _converted(model)  # Float8Linear modules ran the step
    assert torch.isfinite(torch.tensor(loss))
    assert loss != ref_loss and abs(loss - ref_loss) < 2e-2
    error = ((grad - ref_grad).norm() / ref_grad.norm()).item()
    assert 0.05 < error < 0.4, error
    assert moved > 0.5e-3  # AdamW's first step moves each weight by about lr = 1e-3


def _dp_runs(rank: int, world: int) -> list[tuple[list[float], bool]]:
    """Two steps at dp 2 without, then with, the float8 all-gather: the losses, and whether
    scales were precomputed."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return [_dp_losses(rank, mesh, gather) for gather in (False, True)]


def _dp_losses(rank: int, mesh, float8_all_gather: bool) -> tuple[list[float], bool]:
    from optimus.parallel.data_parallel import apply_data_parallel

    model = build_model(_model_cfg(), seed=0, device="meta")
    apply_float8(model, "tensorwise", fsdp_float8_all_gather=float8_all_gather, min_dim=TINY)
    apply_data_parallel(model, mesh["dp"])
    materialize(model, 0, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator, losses = torch.Generator().manual_seed(rank), []
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (2, 32), generator=generator)
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        precompute_float8_scales([model])
        losses.append(loss.item())
    weight = model.layers["0"].attention.wq.weight._local_tensor  # the float8-aware subclass
    return losses, getattr(weight, "_precomputed_scale", None) is not None


def test_fsdp_float8_all_gather_trains_as_the_bf16_all_gather(run_ranks):
    """The float8 all-gather casts each shard with the scale of the whole weight (its amax
    reduced over dp), which is the cast the layer makes after a plain all-gather: the losses
    must be equal, not just close. The scales for the next step are precomputed."""
    ranks = run_ranks(_dp_runs, 2, timeout=120)
    plain, gathered = zip(*ranks, strict=True)  # per variant: (losses, scaled) by rank
    assert [losses for losses, _ in gathered] == [losses for losses, _ in plain]
    assert len({losses[0] for losses, _ in plain}) == 2  # the ranks saw different tokens
    assert [s for _, s in gathered] == [True, True]
    assert [s for _, s in plain] == [False, False]


def test_rowwise_refuses_float8_all_gather():
    model = build_model(_model_cfg(), seed=0, device="meta")
    with pytest.raises(ValueError, match="tensorwise"):
        apply_float8(model, "rowwise", fsdp_float8_all_gather=True)


def test_float8_problem_by_device():
    assert float8_problem("cpu") is None
    rowwise = float8_problem("cpu", recipe="rowwise")
    if torch.__version__ >= "2.13":  # 2.13's CPU _scaled_mm takes per-row scales
        assert rowwise is None
    else:  # 2.11 (the GPU machines' image) refuses them: said by name, with the fix
        assert torch.__version__ in rowwise and "tensorwise" in rowwise
    for capability in ((8, 9), (9, 0), (10, 0)):
        assert float8_problem("cuda", capability) is None
    a100 = float8_problem("cuda", (8, 0))
    assert a100 is not None and "8.0" in a100 and "8.9" in a100
    assert float8_problem("cuda", (7, 0)) is not None
    assert "Max 1550" in float8_problem("xpu")


def _job(**training) -> JobConfig:
    return JobConfig.model_validate({"name": "f8", "training": training,
                                     "parallel": {"tp": 2, "device": "cpu"}})


def test_tensor_parallel_with_float8_is_refused():
    with pytest.raises(ConfigError) as refused:
        check_job(_job(float8="rowwise"))
    assert [key for key, _, _ in refused.value.problems] == ["training.float8"]
    assert "tp=2" in str(refused.value) and "parallel.tp: 1" in str(refused.value)
    check_job(_job(float8="off"))  # the same layout without float8 passes


def test_cpu_with_torchao_runs_float8():
    check_float8_here(_job(float8="tensorwise"))  # no error: the cpu has _scaled_mm


def test_missing_torchao_refuses_the_job_before_training(tmp_path):
    """torchao made unimportable in a fresh interpreter: the agent's check and `optimus train`
    both refuse with the install hint, and train exits 2 without a traceback."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "f8", "run_dir": str(tmp_path / "run"),
                                   "model": {"dim": 32, "n_layers": 1, "n_heads": 2},
                                   "training": {"float8": "tensorwise"},
                                   "parallel": {"device": "cpu"}}))
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torchao"] = None
        from controller.node.checks import job_problem_here
        print("agent:", job_problem_here({str(job)!r}, []))
        from optimus.cli import main
        main(["train", {str(job)!r}], prog_name="optimus")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    hint = "pip install 'optimus[float8]'"
    assert "training.float8: tensorwise cannot run here: torchao is not installed" in done.stdout
    assert hint in done.stdout and hint in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_optimus_run_loads_torch_for_the_float8_check_only_when_float8_is_asked(tmp_path):
    """`optimus run`'s own process (Redis, controller and agents are its children) imports torch
    (~1.5 s of CPU) only to check float8 on this machine: a job without float8 starts without
    it, one with float8 and no torchao is refused before anything starts."""
    script = textwrap.dedent("""
        import sys
        import controller.cli.run
        def started(*args, **kwargs):
            print("started; torch loaded:", "torch" in sys.modules)
            return 0
        controller.cli.run.run_local = started
        sets = sys.argv[2:]  # a float8 job: with torchao unimportable
        if sets:
            sys.modules["torchao"] = None
        from controller.cli.main import main
        main(["run", sys.argv[1], *sets], prog_name="optimus")
    """)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "f8", "run_dir": str(tmp_path / "run"),
                                   "model": {"dim": 32, "n_layers": 1, "n_heads": 2},
                                   "parallel": {"device": "cpu"}}))
    said = {}
    for recipe, sets in (("off", []), ("tensorwise", ["--set", "training.float8=tensorwise"])):
        done = subprocess.run([sys.executable, "-c", script, str(job), *sets],
                              capture_output=True, text=True, timeout=120)
        said[recipe] = done.returncode, done.stdout + done.stderr
    assert said["off"] == (0, "started; torch loaded: False\n"), said
    code, out = said["tensorwise"]
    assert code == 2 and "started" not in out, said
    assert "tensorwise cannot run here: torchao is not installed" in out and "Traceback" not in out


def _train_job(rank: int, world_size: int, raw: dict) -> dict:
    import json
    from pathlib import Path

    from optimus.config import validate_job
    from optimus.train import train

    job = validate_job(raw, world=world_size)
    result = train(job)  # not quiet: quiet writes no metrics.jsonl
    lines = (Path(job.resolved_run_dir) / "metrics.jsonl").read_text().splitlines()
    events = [e for e in map(json.loads, lines) if e.get("event") == "float8"]
    return {"losses": result.losses, "events": events}


def test_the_trainer_runs_float8_blocks_and_names_what_it_left(run_ranks, tmp_path):
    """Through `train()`: a model as wide as `training.float8_min_dim` (256 here) converts its
    blocks' linears under bf16 mixed precision, logs the output head and the narrower key and
    value projections (2 kv heads: 256x64) as left alone, and trains to a loss near, but not
    equal to, the same run without float8 (float8 keeps 3 significant bits: the losses of 3
    steps stay within 2% of bf16's; a layer that computed garbage would move them by far more,
    or to NaN). The size rule's default (1024) is tested on its own above: torch's
    `_scaled_mm` on CPU takes ~1 s a 1024-wide matmul, 64x a 256-wide one's."""
    def raw(float8: str) -> dict:
        return {"name": f"f8-{float8}", "run_dir": str(tmp_path / float8),
                "model": {"vocab_size": 256, "dim": 256, "n_layers": 1, "n_heads": 8,
                          "n_kv_heads": 2, "ffn_dim": 256, "max_seq_len": 16},
                "optim": {"steps": 3, "lr": 1e-3, "warmup_steps": 1},
                "data": {"seq_len": 16, "batch_size": 2},
                "parallel": {"device": "cpu"},
                "training": {"mixed_precision": "bf16", "float8": float8,
                             "float8_min_dim": 256}}

    # Emulated float8 matmuls are slow on a loaded machine: the timeout only guards a hang.
    (plain,) = run_ranks(_train_job, 1, raw("off"), timeout=600)
    (f8,) = run_ranks(_train_job, 1, raw("tensorwise"), timeout=600)
    assert plain["events"] == []
    (event,) = f8["events"]
    kv = {"layers.0.attention.wk", "layers.0.attention.wv"}
    assert set(event["skipped"]) == {"output", *kv}, event
    assert "256x64: narrower than 256" in event["skipped"]["layers.0.attention.wk"], event
    assert "tensorwise" in event["message"]
    assert f8["losses"] == pytest.approx(plain["losses"], rel=2e-2)
    assert f8["losses"] != plain["losses"]


def test_float8_min_dim_is_a_multiple_of_16_from_16(tmp_path):
    """The job's size rule: validated where it is read, with the fix named."""
    base = {"name": "f8", "model": {"vocab_size": 256, "dim": 64, "n_layers": 1, "n_heads": 4},
            "parallel": {"device": "cpu"}}
    assert validate_job(base, world=1).training.float8_min_dim == MIN_DIM == 1024
    assert validate_job({**base, "training": {"float8_min_dim": 2048}},
                        world=1).training.float8_min_dim == 2048
    for bad, said in ((0, "greater than or equal to 16"), (100, "multiple of 16"),
                      ("wide", "valid integer")):
        with pytest.raises(ConfigError, match=f"training.float8_min_dim: .*{said}"):
            validate_job({**base, "training": {"float8_min_dim": bad}}, world=1)
