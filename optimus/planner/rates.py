"""Measured matmul and attention rates of one device, by shape: the table a GEMM sweep writes
(bench/gemm_sweep.py) and a machine profile loads (`rates:` in machines.yaml).

The file is JSON, never a pickle, and is read through `load_rates` only: at most
`MAX_BYTES`, one schema, every row checked; anything else is one ConfigError naming the
file, what is wrong and how to make a good one. Its shape:

    {"format": "optimus-rates/1", "device": "NVIDIA H200", "torch": "2.11.0+cu130",
     "date": "2026-12-01", "peak_tflops": 989.0,
     "matmul": {"bf16": [[m, n, k, tflops], ...], "float8": [...]},
     "attention": {"bf16": [[seq_len, head_dim, tflops], ...]}}

A matmul row is one `x @ w.t()` of x [m, k] and w [n, k] (a linear layer's forward), its
rate in TFLOP/s of 2 m n k FLOPs. The rows of a dtype form a full grid (every m with every n
and every k), so a shape between measured ones is interpolated in log space (trilinear in
log m, log n, log k, and the rate's log); outside the grid it takes the nearest edge. An
attention row is causal `scaled_dot_product_attention`, forward and backward, at one
sequence length and head dimension; its rate counts the whole T x T square as
`optimus.models.counts.flops_per_token` does (12 x head_dim x seq_len FLOPs per token and
head), so the planner divides the FLOPs it counts by it. Rows of a head dimension form a
line in the sequence length, interpolated the same way; the nearest head dimension is used.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from optimus.config import ConfigError

FORMAT = "optimus-rates/1"
MAX_BYTES = 2 * 2**20  # a full sweep is ~40 KB; anything this size is not one
MAX_ROWS = 20_000
MAX_DIM = 2**22  # tokens, features or positions of one measured shape
MAX_TFLOPS = 1e5
DTYPES = ("fp32", "bf16", "float8")
FIX = "write it with bench/gemm_sweep.py (docs/planner.md, 'Matmul rates by shape')"


@dataclass(frozen=True)
class Grid:
    """Rates on a full grid: axes[i] sorted, logs[j] the log rate at the flattened index."""

    axes: tuple[tuple[int, ...], ...]
    logs: tuple[float, ...]

    def at(self, *point: float) -> float:
        """The rate (TFLOP/s) at `point`, interpolated in log space, clamped to the grid."""
        corners = []
        for axis, value in zip(self.axes, point, strict=True):
            v = min(max(value, axis[0]), axis[-1])
            i = max(bisect_right(axis, v) - 1, 0)
            j = min(i + 1, len(axis) - 1)
            w = 0.0 if j == i else math.log(v / axis[i]) / math.log(axis[j] / axis[i])
            corners.append((i, j, w))
        return math.exp(self._blend(corners, 0, 0))

    def _blend(self, corners, dim: int, index: int) -> float:
        if dim == len(corners):
            return self.logs[index]
        i, j, w = corners[dim]
        stride = math.prod(len(a) for a in self.axes[dim + 1:])
        low = self._blend(corners, dim + 1, index + i * stride)
        if w == 0.0:
            return low
        return (1 - w) * low + w * self._blend(corners, dim + 1, index + j * stride)


@dataclass(frozen=True)
class Rates:
    """One device's measured rates; `source` says where and when they were measured."""

    path: str
    device: str
    torch: str
    date: str
    matmuls: dict  # dtype -> Grid over (m, n, k)
    attentions: dict  # dtype -> {head_dim: Grid over (seq_len,)}

    @property
    def source(self) -> str:
        return f"measured on {self.device}, torch {self.torch}, {self.date} ({self.path})"

    def matmul(self, dtype: str, m: float, n: float, k: float) -> float:
        """FLOP/s of x [m, k] @ w [n, k].t() in `dtype` (bf16 where it was not measured)."""
        grid = self.matmuls.get(dtype) or self.matmuls.get("bf16") or next(
            iter(self.matmuls.values()))
        return grid.at(m, n, k) * 1e12

    def attention(self, dtype: str, seq_len: float, head_dim: int) -> float | None:
        """FLOP/s (the whole square counted) of causal attention, or None if not measured."""
        lines = self.attentions.get(dtype) or self.attentions.get("bf16")
        if not lines:
            return None
        nearest = min(lines, key=lambda d: (abs(math.log(d / head_dim)), d))
        return lines[nearest].at(seq_len) * 1e12


def _bad(path: Path, what: str) -> ConfigError:
    return ConfigError(str(path), f"is not a rate table: {what}", FIX)


def _grid(path: Path, rows, width: int, name: str) -> Grid:
    """A full grid from rows of `width` - 1 positive integer dims and one positive rate."""
    if not isinstance(rows, list) or not rows:
        raise _bad(path, f"{name} must be a non-empty list of rows")
    points = {}
    for n, row in enumerate(rows):
        ok = (isinstance(row, list) and len(row) == width
              and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_DIM
                      for v in row[:-1])
              and isinstance(row[-1], (int, float)) and not isinstance(row[-1], bool)
              and 0 < row[-1] <= MAX_TFLOPS and math.isfinite(row[-1]))
        if not ok:
            raise _bad(path, f"{name} row {n} is {str(row)[:80]}: want {width - 1} positive "
                       f"integer sizes (at most {MAX_DIM}) and a rate in TFLOP/s "
                       f"(0 < rate <= {MAX_TFLOPS:g})")
        key = tuple(row[:-1])
        if key in points:
            raise _bad(path, f"{name} row {n}: the shape {list(key)} is measured twice")
        points[key] = float(row[-1])
    axes = tuple(tuple(sorted({key[i] for key in points})) for i in range(width - 1))
    if len(points) != math.prod(len(a) for a in axes):
        raise _bad(path, f"{name} is not a full grid: {len(points)} shapes where "
                   f"{' x '.join(str(len(a)) for a in axes)} sizes need "
                   f"{math.prod(len(a) for a in axes)}")
    order = sorted(points)
    return Grid(axes, tuple(math.log(points[key]) for key in order))


def load_rates(path: str | Path) -> Rates:
    """The rate table at `path`, checked (module text); ConfigError if it is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(str(path), f"cannot read the rate table: {e.strerror}", FIX) from None
    if len(data) > MAX_BYTES:
        raise _bad(path, f"larger than {MAX_BYTES // 2**20} MiB")
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(path, f"not JSON ({e})") from None
    return _parse(path, raw)


@lru_cache(maxsize=32)
def cached_rates(path: str) -> Rates:
    return load_rates(path)


def _parse(path: Path, raw) -> Rates:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _bad(path, f'its "format" must be "{FORMAT}"')
    known = {"format", "device", "torch", "date", "peak_tflops", "matmul", "attention", "note"}
    extra = sorted(set(raw) - known)
    if extra:
        raise _bad(path, f"unknown field {extra[0]!r}")
    for field in ("device", "torch", "date"):
        if not isinstance(raw.get(field), str) or not 0 < len(raw[field]) <= 200:
            raise _bad(path, f'"{field}" must be a string of 1 to 200 characters')
    matmul, attention = raw.get("matmul"), raw.get("attention", {})
    if not isinstance(matmul, dict) or not matmul or not isinstance(attention, dict):
        raise _bad(path, '"matmul" must map a dtype to rows; "attention" likewise, if given')
    rows = sum(len(v) if isinstance(v, list) else 0
               for v in [*matmul.values(), *attention.values()])
    if rows > MAX_ROWS:
        raise _bad(path, f"{rows} rows, more than {MAX_ROWS}")
    for dtype in [*matmul, *attention]:
        if dtype not in DTYPES:
            raise _bad(path, f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    matmuls = {dtype: _grid(path, rows, 4, f"matmul.{dtype}") for dtype, rows in matmul.items()}
    attentions = {}
    for dtype, rows in attention.items():
        if not isinstance(rows, list) or not rows:
            raise _bad(path, f"attention.{dtype} must be a non-empty list of rows")
        by_dim: dict[int, list] = {}
        for n, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != 3:
                raise _bad(path, f"attention.{dtype} row {n} is {str(row)[:80]}: want "
                           "[seq_len, head_dim, tflops]")
            dim = row[1]
            if not isinstance(dim, int) or isinstance(dim, bool) or not 1 <= dim <= 4096:
                raise _bad(path, f"attention.{dtype} row {n}: head_dim {str(dim)[:20]} is not "
                           "an integer from 1 to 4096")
            by_dim.setdefault(dim, []).append([row[0], row[2]])
        attentions[dtype] = {d: _grid(path, r, 2, f"attention.{dtype} (head_dim {d})")
                             for d, r in by_dim.items()}
    return Rates(str(path), raw["device"], raw["torch"], raw["date"], matmuls, attentions)
