"""The peak table: each device variant gets its own datasheet's dense figure, per dtype."""

import pytest

from optimus import metrics
from optimus.runtime.peaks import PEAK_TFLOPS, peak_flops


@pytest.mark.parametrize("name, bf16, fp8", [
    ("NVIDIA H100 80GB HBM3", 989e12, 1979e12),  # SXM
    ("NVIDIA H100 PCIe", 756e12, 1513e12),  # not the SXM figure, though "h100" matches too
    ("NVIDIA H100 NVL", 835.5e12, 1670.5e12),
    ("NVIDIA H200", 989e12, 1979e12),
    ("NVIDIA H200 NVL", 835.5e12, 1670.5e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, None),  # Ampere: no fp8 matmuls
    ("Intel(R) Data Center GPU Max 1550", 298e12, None),
    ("cpu", None, None),
])
def test_dense_peaks_by_device_and_dtype(name, bf16, fp8):
    assert peak_flops(name) == bf16
    assert peak_flops(name, dtype="bf16") == bf16
    assert peak_flops(name, dtype="fp8") == fp8


def test_fp8_peak_is_twice_bf16_where_both_exist():
    """Hopper's fp8 tensor cores run at twice the bf16 rate: a typo in either breaks this."""
    for key, peaks in PEAK_TFLOPS.items():
        if "fp8" in peaks:
            assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], abs=1.0), key


def test_override_wins_and_unknown_dtype_is_refused():
    assert peak_flops("cpu", override_tflops=2.0) == 2e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", override_tflops=5.0, dtype="fp8") == 5e12
    with pytest.raises(ValueError, match="fp16"):
        peak_flops("NVIDIA H100 80GB HBM3", dtype="fp16")


def test_metrics_reexports_the_one_table():
    assert metrics.peak_flops is peak_flops and metrics.PEAK_TFLOPS is PEAK_TFLOPS
