"""bench/moe.py's table: one column a layer, one row a measure (bench/moe_measure.py's Figures).

Times in ms and bytes in KiB per token are written "forward + backward"; a dense layer has no
regions, so no row of a part ("-"). Shares are dispatch and combine's of the layer's time.
"""

from __future__ import annotations

from bench.moe_measure import LAYER, REST, Figures

KIB, MIB = 2**10, 2**20


def ms(s: float) -> str:
    return f"{1e3 * s:.1f}" if abs(s) >= 0.01 else f"{1e3 * s:.2f}"


def both(f: Figures, table: str, part: str, fmt) -> str:
    """'forward + backward' of `part` in `table`, or '-' where the layer has no such part."""
    values = getattr(f, table)
    if (part != LAYER and not f.regions) or part not in values["forward"]:
        return "-"
    return " + ".join(fmt(values[p][part]) for p in ("forward", "backward"))


def per_token(f: Figures):
    return lambda n: f"{n / f.tokens / KIB:.1f}"


def shares(f: Figures) -> str:
    if not f.regions:
        return "-"
    return f"{f.share('forward'):.0%} / {f.share('backward'):.0%} / {f.share():.0%}"


def rest_bytes(f: Figures) -> str:
    if not f.regions:
        return "-"
    return f"{both(f, 'bytes', REST, per_token(f))} = {f.per_token() / KIB:.1f}"


ROWS = [
    ("time, ms (fwd + bwd)", lambda f: both(f, "seconds", LAYER, ms)),
    ("  expert GEMMs", lambda f: both(f, "seconds", "experts", ms)),
    ("  router", lambda f: both(f, "seconds", "router", ms)),
    ("  dispatch + combine", lambda f: both(f, "seconds", REST, ms)),
    ("  its share (fwd / bwd / all)", shares),
    ("KiB/token: dispatch + combine", rest_bytes),
    ("  experts", lambda f: both(f, "bytes", "experts", per_token(f))),
    ("  layer (fwd and bwd)", lambda f: f"{f.per_token(LAYER) / KIB:.1f}"),
    ("aten ops (fwd + bwd)", lambda f: both(f, "ops", LAYER, str)),
    ("host reads (fwd + bwd)", lambda f: both(f, "reads", LAYER, str)),
    ("memory, MiB: peak", lambda f: f"{f.peak_bytes / MIB:,.1f}"),
    ("  held from fwd to bwd", lambda f: f"{f.held_bytes / MIB:,.1f}"),
]


def print_table(figures: dict[str, Figures]) -> None:
    width = max(12, *(len(fn(f)) + 2 for f in figures.values() for _, fn in ROWS))
    print(f"   {'':<30}" + "".join(f"{name:>{width}}" for name in figures))
    for label, fn in ROWS:
        print(f"   {label:<30}" + "".join(f"{fn(f):>{width}}" for f in figures.values()))


def judged(ok: bool, on_gpu: bool) -> str:
    return ("met" if ok else "MISSED") if on_gpu else "on a CPU recorded, not judged"
