"""Peak dense FLOP/s per device and matmul dtype: the one table MFU is measured against.

Vendors print tensor-core peaks "with sparsity" (2:4 structured sparsity doubles them); training
runs dense matmuls, so every figure here is the dense one, half the sparse headline. A device
is matched by a substring of its reported name, lower-cased, and the first match wins: the
variants with a suffix ("h100 nvl", "h100 pcie") come before the bare name that would also
match them. An Intel Max 1550 is two tiles, each its own torch device: its figure is per tile.
"""

from __future__ import annotations

DTYPES = ("bf16", "fp8")

# TFLOP/s, dense. A dtype missing from an entry has no tensor-core path on that device.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column: BF16 1,671 and FP8 3,341 with
    # sparsity, per GPU.
    "h100 nvl": {"bf16": 835.5, "fp8": 1670.5},
    # NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column: BF16 1,513 and FP8 3,026 with
    # sparsity.
    "h100 pcie": {"bf16": 756.0, "fp8": 1513.0},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column: as the H100 NVL.
    "h200 nvl": {"bf16": 835.5, "fp8": 1670.5},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 1,979 and FP8 3,958 with
    # sparsity (the H100 SXM's figures; the H200 differs in memory, not in compute).
    "h200": {"bf16": 989.0, "fp8": 1979.0},
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 1,979 and FP8 3,958 with
    # sparsity. The SXM part reports itself as e.g. "NVIDIA H100 80GB HBM3".
    "h100": {"bf16": 989.0, "fp8": 1979.0},
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 dense (624 with sparsity); Ampere has
    # no FP8 tensor cores.
    "a100": {"bf16": 312.0},
    # Intel Data Center GPU Max 1550, one tile, from Intel's Max series figures: 448 XVE x
    # 512 bf16 flop/clk x 1.3 GHz (torchtitan uses the same); it moves with the clock. The
    # Max series has no FP8 matmuls.
    "max 1550": {"bf16": 298.0},
}


def peak_flops(device_name: str, override_tflops: float | None = None,
               dtype: str = "bf16") -> float | None:
    """Peak dense FLOP/s of one device for `dtype` matmuls ("bf16" or "fp8").

    None when the table does not know the device (a CPU) or the device has no such matmuls:
    an MFU against a guessed peak would be a wrong figure that looks right. An override
    (`supervision.peak_tflops`) wins over the table, for whatever dtype is asked.
    """
    if dtype not in DTYPES:
        raise ValueError(f"peak of dtype {dtype!r}: the table has {', '.join(DTYPES)}")
    if override_tflops is not None:
        return override_tflops * 1e12
    name = device_name.lower()
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            tflops = peaks.get(dtype)
            return None if tflops is None else tflops * 1e12
    return None
