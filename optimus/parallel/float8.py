"""Float8 matmuls in the transformer blocks' linear layers, through torchao (`training.float8`).

`apply_float8` swaps the blocks' `nn.Linear` layers for torchao's `Float8Linear`, on the meta
device, before tensor parallel, activation checkpointing and FSDP2. Master weights, gradients
and optimizer state stay as they were; only the three matmuls of each converted layer (output,
input gradient, weight gradient) take float8 operands with dynamic scales, per tensor
(`tensorwise`) or per row (`rowwise`). What is not converted is named, with the reason.

FSDP2 and float8 all-gather. Under `tensorwise` with the blocks sharded over dp, each weight
shard is cast to float8 before the all-gather, halving its bytes against bf16; the shards must
then share one scale, which costs an all-reduce of the weights' absolute maxima. Calling
`precompute_float8_scales` after every optimizer step does that in one all-reduce for all the
layers, instead of one per layer inside each all-gather. `rowwise` all-gathers in the
parameters' own dtype: its weight is cast with one scale per row for the forward matmul and one
per column for the input gradient's, and a column spans every dp shard, so no single float8 copy
made before the all-gather serves both (torchao allows the float8 all-gather for tensorwise
only).

Which devices: `float8_problem` says why a device cannot run float8 matmuls, before any rank
starts. CUDA needs compute capability 8.9 (Ada, Hopper and newer). The CPU runs torch's own
`_scaled_mm` (emulated, slow: for tests and CI). XPU is refused: torch 2.13 dispatches
`_scaled_mm` to oneDNN on XPU, but the Max 1550 (Xe-HPC) has no float8 matrix engine, so there
is nothing to gain, and torchao's float8 training is built and tested for CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from optimus.config import ConfigError, JobConfig
from optimus.config.schema import TrainingConfig
from optimus.models.moe import GroupedExperts

RECIPES = ("tensorwise", "rowwise")
FLOAT8_CUDA_CAPABILITY = (8, 9)  # Ada Lovelace (sm_89): the first with float8 tensor cores
# A linear narrower than this on either side stays in bf16 (see `skip_reason`): the default of
# `training.float8_min_dim`.
MIN_DIM = TrainingConfig.model_fields["float8_min_dim"].default
INSTALL_HINT = "pip install 'optimus[float8]'"


def apply_float8(model: nn.Module, recipe: str, *, fsdp_float8_all_gather: bool = False,
                 min_dim: int = MIN_DIM) -> list[tuple[str, str]]:
    """Convert `model`'s block linears to Float8Linear in place; return (name, reason) of
    every matmul layer left as it was.

    `fsdp_float8_all_gather`: set it when the blocks will be FSDP2-sharded (dp > 1), under
    `tensorwise` only (the module's docstring says why). Apply to the meta-device model, before
    tensor parallel; a model already converted is left as it is.
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown float8 recipe {recipe!r}: use one of {', '.join(RECIPES)}")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError("float8 all-gather works with the tensorwise recipe only")
    torchao_float8 = import_torchao_float8()
    convert, skipped = set(), []
    for name, module in _matmul_layers(model):
        reason = skip_reason(name, module, min_dim)
        if reason is None:
            convert.add(name)
        else:
            skipped.append((name, reason))
    config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    torchao_float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _module, fqn: fqn in convert)
    return skipped


def skip_reason(name: str, module: nn.Module, min_dim: int = MIN_DIM) -> str | None:
    """Why the layer `name` keeps its high-precision matmul, or None to convert it.

    In order: the output head (`output`: the logits feed the loss, whose softmax is taken in
    fp32; float8 error there reaches every token's loss directly); MoE routers (`router`: their
    scores pick the experts, and float8 rounding would flip near-tied choices); grouped experts
    (stacked [experts, in, out] weights, not nn.Linear: `training.float8_experts` gives them
    float8 grouped GEMMs, optimus/parallel/float8_experts.py); a dimension not a multiple of 16
    (float8 matmul kernels need both); and the rule "both in_features and out_features >=
    `min_dim`" (`training.float8_min_dim`, default 1024). Below that the per-call cost of
    scaling and casting the operands, which is memory-bound, takes back most of what the faster
    matmul saves. torchao's own filter, drawn from H100 measurements, skips layers up to about
    1024 wide under tensorwise and 2048 under rowwise; 1024 for both keeps the projections of a
    1B-class model (dim 2048) in float8.
    """
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, GroupedExperts):
        return ("grouped experts (stacked weights, not nn.Linear): converted by "
                "training.float8_experts, not training.float8")
    if leaf == "output":
        return "the output head: the logits stay in high precision for the loss"
    if leaf == "router":
        return "MoE router: float8 rounding would change which experts are chosen"
    if not name.startswith("layers."):
        return "outside the transformer blocks"
    out_features, in_features = module.weight.shape
    if in_features % 16 or out_features % 16:
        return f"{in_features}x{out_features}: float8 matmuls need dims that are multiples of 16"
    if min(in_features, out_features) < min_dim:
        return f"{in_features}x{out_features}: narrower than {min_dim}, too small to gain"
    return None


def precompute_float8_scales(parts: list[nn.Module]) -> None:
    """After every optimizer step, under tensorwise float8 all-gather: the weights' scales for
    the next all-gathers, in one all-reduce per model chunk. Once called, it must follow every
    step (torchao keeps the last scales it was given). A no-op without float8 all-gather."""
    if not any(_gathers_float8(m) for part in parts for m in part.modules()):
        return
    fsdp_utils = importlib.import_module("torchao.float8.fsdp_utils")
    for part in parts:
        fsdp_utils.precompute_float8_dynamic_scale_for_fsdp(part)


def float8_problem(kind: str, capability: tuple[int, int] | None = None,
                   recipe: str = "tensorwise") -> str | None:
    """Why a device of `kind` ("cuda", "xpu", "cpu") cannot run float8 training, or None.

    `capability`: the CUDA compute capability (major, minor); ignored for other kinds.
    """
    if kind == "cpu":
        return cpu_rowwise_problem() if recipe == "rowwise" else None
    if kind == "cuda":
        if capability is None:
            return "the CUDA compute capability is unknown"
        if tuple(capability) < FLOAT8_CUDA_CAPABILITY:
            have = ".".join(map(str, capability))
            return (f"CUDA compute capability {have} has no float8 matmuls; they need 8.9 or "
                    "newer (Ada, Hopper, Blackwell), e.g. not the A100 (8.0)")
        return None
    if kind == "xpu":
        return ("XPU: the Max 1550 (Xe-HPC) has no float8 matrix engine, and torchao's float8 "
                "training is built for CUDA")
    return f"unknown device kind {kind!r}"


@functools.cache
def cpu_rowwise_problem() -> str | None:
    """Why this torch's CPU `_scaled_mm` cannot take per-row scales, or None. Tried, not read
    off a version: torch 2.13 takes them; 2.11 (the GPU machines' image) asserts inside."""
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    b = torch.ones(2, 16).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return (f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only, "
                "not the rowwise recipe's per-row ones (torch 2.13 takes both); use "
                "tensorwise on a CPU")
    return None


def torchao_problem() -> str | None:
    """Why torchao's float8 training cannot be imported, or None."""
    try:
        import_torchao_float8()
    except ImportError as e:
        return f"torchao is not installed ({e})"
    return None


def check_float8_here(job: JobConfig, source: str = "job") -> None:
    """Raise ConfigError if `job` asks for float8 (`training.float8`, `training.float8_experts`)
    and this machine cannot run it: torchao missing, or a device without the float8 kernels.
    Runs before any rank starts: in `optimus train`, `optimus run`, and in the node agent
    before it spawns ranks."""
    problems = []
    recipe = job.training.float8
    if recipe != "off":
        problem, fix = torchao_problem(), f"{INSTALL_HINT}, or set training.float8: off"
        if problem is None:
            problem = device_problem_here(job.parallel.device, recipe)
            fix = "run on a device with float8 matmuls, or set training.float8: off"
        if problem is not None:
            problems.append(("training.float8", f"{recipe} cannot run here: {problem}", fix))
    recipe = job.training.float8_experts
    if recipe != "off" and (device := device_here(job.parallel.device)) is not None:
        from optimus.parallel.float8_experts import float8_experts_fix, float8_experts_problem

        problem = float8_experts_problem(recipe, device)
        if problem is not None:
            problems.append(("training.float8_experts", f"{recipe} cannot run here: {problem}",
                             float8_experts_fix(recipe)))
    if problems:
        raise ConfigError(source, problems=problems)


def device_problem_here(kind: str = "auto", recipe: str = "tensorwise") -> str | None:
    """`float8_problem` for the device a rank of this machine gets with `parallel.device`
    `kind` (its first one: a node's accelerators are all of one model)."""
    device = device_here(kind)
    if device is None:
        return None
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return float8_problem(device.type, capability, recipe)


def device_here(kind: str = "auto") -> torch.device | None:
    """The device a rank of this machine gets with `parallel.device` `kind` (its first one: a
    node's accelerators are all of one model), or None where it gets none (the trainer names
    that problem itself)."""
    from optimus.runtime.device import DeviceError, pick_device

    try:
        return pick_device(kind)
    except DeviceError:
        return None


def float8_note(kind: str) -> str:
    """What the log says about where float8 runs."""
    if kind == "cpu":
        return "cpu: torch's _scaled_mm is emulated, slow; for tests, not for speed"
    return f"{kind}: hardware float8 matmuls"


def float8_message(recipe: str, kind: str, skipped: list[tuple[str, str]]) -> str:
    """The trainer's log line: the recipe, the device, and every layer left as it was, by
    reason (a large model repeats a few reasons over many layers)."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in skipped:
        by_reason.setdefault(reason, []).append(name)
    kept = "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())
    return f"{recipe} ({float8_note(kind)}); left as they were: {kept or 'none'}"


def import_torchao_float8():
    """`torchao.float8`, without the lines torchao logs while importing: it tries to load its
    prebuilt CUDA kernels (none of which float8 training uses: its matmuls are torch's
    `_scaled_mm`) and warns of a pytree registration deprecated in torch 2.13."""
    return import_quietly("torchao.float8")


def import_quietly(module: str):
    """Import a torchao `module` without the lines torchao logs while importing."""
    with _quiet("torchao", "torch.utils._pytree"):
        return importlib.import_module(module)


@contextlib.contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in loggers]
    for logger, _ in saved:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def _matmul_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every layer with a weight matmul: nn.Linear, and the grouped experts that are not."""
    for name, module in model.named_modules():
        if type(module) is nn.Linear or isinstance(module, GroupedExperts):
            yield name, module


def _gathers_float8(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return bool(getattr(config, "enable_fsdp_float8_all_gather", False))
