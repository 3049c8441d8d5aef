"""Float8 grouped GEMMs for the MoE layers' experts, through torchao (`training.float8_experts`).

`apply_float8_experts` sets `matmul` of every `GroupedExperts` (optimus/models/moe.py) to a
`Float8GroupedMM`, on the meta device, before expert parallel and FSDP2 (both keep the
attribute: expert parallel passes `experts.matmul` to `swiglu_experts`). Each of an expert
SwiGLU's three grouped GEMMs (w1, w3, w2), and the two each has in backward (input gradient,
weight gradient), then takes float8 operands with dynamic scales:
- `rowwise`: one power-of-two scale per row of the activations and per output column of each
  expert's weight (torchao's `_to_fp8_rowwise_then_scaled_grouped_mm`, on torch's
  `_scaled_grouped_mm`): CUDA compute capability 9.0+, the H100, H200 and B200.
- `mxfp8`: one power-of-two scale per block of 32 values (torchao's
  `_to_mxfp8_then_scaled_grouped_mm`): compute capability 10.0, the B200, with the kernels of
  torchao's CUDA 12.8+ builds.
Master weights, gradients and optimizer state stay as they were; outputs come back in bf16,
cast to the compute dtype. Routers, shared experts and the combine are not touched (the shared
experts are nn.Linear: `training.float8` converts those). Off by default: the bf16 grouped GEMM
is the reference.

Groups. The kernels need each expert's rows to start at a multiple of 16 (rowwise) or 32
(mxfp8: its weight gradient scales blocks of 32 rows). torchao 0.18's own padding
(`pad_token_groups_for_grouped_mm`) is refused by its rowwise function, and without torchao's
SM100 CUDA kernels it pads expert by expert with host reads; `pad_groups` here pads for both
recipes on the device, without a host read. Padding rows are zero: they add nothing to the
weight gradient, and their outputs are never read back. An expert with no rows is an empty
group. A 3-d input [experts, C, in] (capacity) is C rows an expert, padded only where C is not
a multiple.

Weights. torchao takes each expert's weight as [in, out] in column-major order; ours are
row-major, so each call makes a column-major copy (`w.mT.contiguous().mT`: one pass over the
weights, small beside the GEMM over the tokens, and its gradient comes back through it).

Devices: `float8_experts_problem` says why one cannot run a recipe; `check_float8_here`
(optimus/parallel/float8.py) asks it before any rank starts. A CPU runs none: only mxfp8's
emulated kernel (torchao dequantises to bf16 and runs torch's grouped GEMM: the same rounding,
none of the speed), which the tests take with `apply_float8_experts(..., emulated=True)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from optimus.config.checks import FLOAT8_EXPERTS_MULTIPLE
from optimus.models.moe import GroupedExperts
from optimus.parallel.float8 import INSTALL_HINT, import_quietly

RECIPES = ("rowwise", "mxfp8")
CAPABILITY = {"rowwise": (9, 0), "mxfp8": (10, 0)}  # the CUDA compute capability each needs
GPUS = {"rowwise": "Hopper or Blackwell: H100, H200, B200", "mxfp8": "Blackwell: B200"}
_KERNELS = {  # recipe -> torchao's module, and its differentiable float8 grouped GEMM
    "rowwise": ("torchao.prototype.moe_training.fp8_grouped_mm",
                "_to_fp8_rowwise_then_scaled_grouped_mm"),
    "mxfp8": ("torchao.prototype.moe_training.mxfp8_grouped_mm",
              "_to_mxfp8_then_scaled_grouped_mm"),
}


def apply_float8_experts(model: nn.Module, recipe: str, *, emulated: bool = False) -> int:
    """Give every `GroupedExperts` of `model` a float8 grouped GEMM; return how many.

    `emulated`: mxfp8's emulated kernel, which runs on a CPU (for tests: a job on a CPU is
    refused). Apply to the meta-device model, before expert parallel and FSDP2.
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown float8 experts recipe {recipe!r}: use one of "
                         f"{', '.join(RECIPES)}")
    if emulated and recipe != "mxfp8":
        raise ValueError(f"{recipe} has no emulated kernel (torchao's are Triton, CUDA only); "
                         "mxfp8 has")
    matmul = Float8GroupedMM(recipe, emulated)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for module in experts:
        module.matmul = matmul
    return len(experts)


@dataclass(frozen=True)
class Float8GroupedMM:
    """A `GroupedMM` (optimus/models/moe.py) whose operands are cast to float8."""

    recipe: str
    emulated: bool = False
    # torchao's kernel, imported when made: not in a forward, where torch.compile would trace
    # the import.
    kernel: Callable = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel", _kernel(self.recipe, self.emulated))

    def __call__(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor | None,
                 rows_max: int | None = None) -> torch.Tensor:
        """Rows of `x` ([rows, in], grouped by expert, `counts[e]` for expert e; or
        [experts, C, in]) times their expert's `w[e]`, in `x`'s dtype (the autocast dtype
        under autocast). `rows_max` is not needed: the padding's bound is known."""
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dtype), w.to(dtype)
        multiple = FLOAT8_EXPERTS_MULTIPLE[self.recipe]
        if x.dim() == 3:  # [experts, C, in]: C rows an expert (capacity)
            experts, capacity, width = x.shape
            rows = x.reshape(experts * capacity, width)
            if capacity % multiple:
                counts = torch.full((experts,), capacity, dtype=torch.int64, device=x.device)
                out = self(rows, w, counts)
            else:  # aligned already: no padding
                ends = torch.arange(1, experts + 1, dtype=torch.int32, device=x.device)
                out = self._grouped(rows, w, ends * capacity).to(x.dtype)
            return out.view(experts, capacity, -1)
        padded, ends, where = pad_groups(x, counts, multiple)
        return self._grouped(padded, w, ends)[where].to(x.dtype)

    def _grouped(self, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """torchao's float8 grouped GEMM on rows already aligned: `ends`, the groups' ends."""
        # The operands are in their compute dtype already; the kernels pick their own.
        with torch.autocast(x.device.type, enabled=False):
            return self.kernel(x.contiguous(), w.mT.contiguous().mT, ends,
                               out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)


def pad_groups(x: torch.Tensor, counts: torch.Tensor, multiple: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x`'s rows (grouped by expert, `counts[e]` for expert e) with each group moved to start
    at a multiple of `multiple`: (the padded rows, the padded groups' ends as int32, each row's
    place among the padded rows). No host read: the padded tensor has the most rows padding
    can need, rows + experts x (multiple - 1), rounded up to a multiple; the rows past the last
    group are zero, and no kernel reads them as a group."""
    ends = torch.cumsum(counts, 0)
    padded_counts = (counts + multiple - 1) // multiple * multiple
    padded_ends = torch.cumsum(padded_counts, 0)
    row = torch.arange(x.shape[0], device=x.device, dtype=ends.dtype)
    expert = torch.searchsorted(ends, row, right=True)
    where = row + (padded_ends - padded_counts - (ends - counts))[expert]
    size = -(-(x.shape[0] + counts.numel() * (multiple - 1)) // multiple) * multiple
    padded = x.new_zeros(size, x.shape[-1]).index_put((where,), x)
    return padded, padded_ends.to(torch.int32), where


def float8_experts_problem(recipe: str, device: torch.device | str) -> str | None:
    """Why `device` cannot run the `recipe` float8 grouped GEMMs, in one line, or None."""
    device = torch.device(device)
    need = _dotted(CAPABILITY[recipe])
    if device.type == "cpu":
        return (f"the cpu has no float8 grouped GEMM: {recipe} needs CUDA compute capability "
                f"{need} or newer ({GPUS[recipe]}); only the tests run mxfp8 there, emulated")
    if device.type == "xpu":
        return ("XPU: the Max 1550 (Xe-HPC) has no float8 matrix engine, and torchao's float8 "
                "grouped GEMMs are CUDA kernels")
    if device.type != "cuda":
        return f"unknown device kind {device.type!r}"
    have = tuple(torch.cuda.get_device_capability(device))
    if have < CAPABILITY[recipe]:
        return (f"CUDA compute capability {_dotted(have)} has no {recipe} float8 grouped "
                f"GEMM; it needs {need} or newer ({GPUS[recipe]})")
    return torchao_experts_problem(recipe)


def torchao_experts_problem(recipe: str) -> str | None:
    """Why this torch and torchao cannot run the `recipe` float8 grouped GEMMs, or None."""
    try:
        module = import_quietly(_KERNELS[recipe][0])
    except ImportError as e:
        return f"torchao is not installed ({e}): {INSTALL_HINT}"
    if recipe == "rowwise" and not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no _scaled_grouped_mm"
    if recipe == "mxfp8" and not getattr(module, "_SM100_KERNELS_AVAILABLE", False):
        return ("this torchao was built without its SM100 mxfp8 kernels (torchao's CUDA 12.8+ "
                "builds have them)")
    return None


def float8_experts_fix(recipe: str) -> str:
    """The fix a refusal names."""
    return (f"run on CUDA compute capability {_dotted(CAPABILITY[recipe])}+ "
            f"({GPUS[recipe]}), or set training.float8_experts: off")


def _kernel(recipe: str, emulated: bool = False):
    """torchao's float8 grouped GEMM for `recipe` (mxfp8's emulated one where asked)."""
    module, name = _KERNELS[recipe]
    kernel = getattr(import_quietly(module), name)
    if emulated:
        common = import_quietly("torchao.quantization.quantize_.common")
        kernel = functools.partial(kernel, kernel_preference=common.KernelPreference.EMULATED)
    return kernel


def _dotted(capability: tuple[int, int]) -> str:
    return ".".join(map(str, capability))
