"""Pick this rank's device and the collective backend that goes with it.

cuda -> nccl, xpu -> xccl (native in torch since 2.8), cpu -> gloo. The legacy Intel `ccl`
backend is used only when asked for and only when oneccl_bindings_for_pytorch imports.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

KINDS = ("auto", "cuda", "xpu", "cpu")
DEFAULT_BACKEND = {"cuda": "nccl", "xpu": "xccl", "cpu": "gloo"}
# Backends that can move tensors of each device type.
ALLOWED_BACKENDS = {
    "cuda": ("nccl", "gloo"),
    "xpu": ("xccl", "ccl"),
    "cpu": ("gloo", "ccl"),
}


class DeviceError(ValueError):
    """The requested device or backend cannot be used on this machine."""


def accelerator_available(kind: str) -> bool:
    """Whether torch sees a usable device of this kind ("cuda" or "xpu")."""
    module = getattr(torch, kind, None)
    return bool(module is not None and module.is_available())


def pick_device(kind: str = "auto", local_rank: int = 0) -> torch.device:
    """The device for this rank: auto prefers cuda, then xpu, then cpu.

    An accelerator's index is local_rank modulo the visible devices, so one device per rank
    works both with every device visible and with one masked in (ZE_AFFINITY_MASK).
    """
    kind = kind.lower()
    if kind not in KINDS:
        raise DeviceError(f"unknown device {kind!r}: use one of {', '.join(KINDS)}")
    if kind == "auto":
        kind = next((k for k in ("cuda", "xpu") if accelerator_available(k)), "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if not accelerator_available(kind):
        raise DeviceError(
            f"device {kind!r} was requested but torch {torch.__version__} sees no {kind} "
            f"device (torch.{kind}.is_available() is False); use device 'auto' or 'cpu', "
            f"or install a torch build with {kind} support"
        )
    count = getattr(torch, kind).device_count()
    return torch.device(kind, local_rank % count)


def pick_backend(device: torch.device, requested: str = "auto") -> str:
    """The process-group backend for `device`; an explicit request must suit the device."""
    requested = requested.lower()
    if requested == "auto":
        backend = DEFAULT_BACKEND.get(device.type)
        if backend is None:
            raise DeviceError(f"no collective backend is known for device {device}")
    else:
        backend = requested
        allowed = ALLOWED_BACKENDS.get(device.type, ())
        if backend not in allowed:
            raise DeviceError(
                f"backend {backend!r} cannot move {device.type} tensors; "
                f"for {device.type} use {' or '.join(allowed) or 'nothing known'}"
            )
    if backend == "ccl":
        _import_legacy_ccl()
    if not dist.is_backend_available(backend):
        raise DeviceError(
            f"backend {backend!r} is not available in this torch {torch.__version__} build; "
            f"for {device.type} the default is {DEFAULT_BACKEND.get(device.type)!r}"
        )
    return backend


def _import_legacy_ccl() -> None:
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
    except ImportError:
        raise DeviceError(
            "backend 'ccl' needs the legacy oneccl_bindings_for_pytorch (torch-ccl), which is "
            "end-of-life and not installed; use backend 'xccl', native in torch since 2.8"
        ) from None


def device_name(device: torch.device) -> str:
    """A human-readable name of the device model, e.g. "NVIDIA H100 80GB HBM3"."""
    if device.type in ("cuda", "xpu"):
        return getattr(torch, device.type).get_device_name(device)
    return device.type


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype the step computes in: `precision` auto is bf16 on an accelerator, float32 on
    cpu; bf16 on any device, so the cpu can run (and CI can test) the accelerators' path."""
    if precision == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if precision not in ("bf16", "fp32"):
        raise DeviceError(f"unknown precision {precision!r}: use auto, bf16 or fp32")
    return torch.bfloat16 if precision == "bf16" else torch.float32
