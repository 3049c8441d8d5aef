"""How `optimus plan` shows its answer: a rich table, JSON, or every term of one layout."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from optimus.planner.machines import Machine
from optimus.planner.search import Candidate
from optimus.planner.stacks import OURS, against_ours, get_stack, stacks

GIB = 2**30


def as_dict(c: Candidate) -> dict:
    t = c.time
    return {"layout": c.layout.label(), **c.layout.fields(),
            "tokens_per_s_per_device": round(t.tokens_per_s_per_device, 3),
            "tflops_per_device": round(t.tflops_per_device, 2), "mfu": round(t.mfu, 4),
            "step_s": round(t.total, 4),
            "step_terms_s": {k: round(v, 4) for k, v in t.terms().items()},
            "memory_gib": round(c.memory.total / GIB, 3),
            "memory_terms_gib": {k: round(v / GIB, 3) for k, v in c.memory.terms().items()},
            "memory_pp_rank": c.memory.pp_rank}


def table(candidates: list[Candidate], title: str) -> Table:
    out = Table(title=title)
    for name in ("#", "layout", "tokens/s/dev", "TFLOP/s/dev", "MFU", "step s", "bubble",
                 "comm", "GiB/rank", "state", "act", "other"):
        out.add_column(name, justify="left" if name == "layout" else "right")
    for i, c in enumerate(candidates, 1):
        t, m = c.time, c.memory
        state = m.parameters + m.gradients + m.optimizer
        acts = m.activations + m.logits
        comm = t.tp_comm + t.pp_comm + t.ep_comm + t.dp_exposed + t.cp_comm
        out.add_row(str(i), c.layout.label(), f"{t.tokens_per_s_per_device:,.0f}",
                    f"{t.tflops_per_device:.3g}", f"{t.mfu:.1%}", f"{t.total:.2f}",
                    f"{t.bubble / t.total:.1%}", f"{comm / t.total:.1%}",
                    f"{m.total / GIB:.1f}", f"{state / GIB:.1f}", f"{acts / GIB:.1f}",
                    f"{(m.total - state - acts) / GIB:.1f}")
    return out


def header(machine: Machine) -> str:
    """The line `optimus plan` prints above its answer: where the rates come from."""
    return f"{machine.name}: {machine.rates_note()}"


def rates_dict(machine: Machine) -> dict:
    table = machine.rate_table
    return {"calibrated": table is not None, "note": machine.rates_note(),
            **({"device": table.device, "torch": table.torch, "date": table.date,
                "path": table.path} if table else {})}


def stack_lines(compiled: bool) -> list[str]:
    """Optimus's factor against the plain loop, and every other stack's against ours, each
    with its source: the inputs behind `stack_s` and behind the published checks."""
    mode = "compiled" if compiled else "eager"
    ours = get_stack(OURS)
    out = [f"stack: {OURS} ({mode}) at {ours.factor(compiled):g} of the plain loop's rate "
           f"(stack_s is the difference); {ours.source}"]
    for name, stack in stacks().items():
        if name == OURS or (stack.compiled if compiled else stack.eager) is None:
            continue
        out.append(f"  {name} ({mode}): {against_ours(name, compiled):.3g}x ours; "
                   f"{stack.source}")
    return out


def explain(c: Candidate, capacity_gib: float, console: Console, room: str = "",
            machine: Machine | None = None) -> None:
    """Every term of one layout's memory and step time; `room` says what headroom the
    capacity leaves; with `machine`, where its rates come from and the stack factors."""
    fits = "fits" if c.memory.total <= capacity_gib * GIB else "does NOT fit"
    console.print(f"{c.layout.label()}: memory of pipeline rank {c.memory.pp_rank} (the "
                  f"largest), {fits} in {capacity_gib:g} GiB{room}")
    console.print(_terms(c.memory.terms(), c.memory.total, "GiB", lambda v: f"{v / GIB:.2f}"))
    console.print(_terms(c.time.terms(), c.time.total, "s", lambda v: f"{v:.4f}"))
    t = c.time
    if c.layout.dims.cp > 1:
        console.print(f"context parallel cp {c.layout.dims.cp} ({c.layout.cp_method}): "
                      f"{t.cp_comm + t.cp_hidden:.4f} s of exchange a step, {t.cp_hidden:.4f} "
                      "of it under attention")
    console.print(f"{t.tokens_per_s_per_device:,.1f} tokens/s per device, "
                  f"{t.tflops_per_device:.1f} TFLOP/s per device (recompute counted), "
                  f"MFU {t.mfu:.1%}")
    if machine is not None:
        console.print(header(machine), soft_wrap=True)
        for line in stack_lines(c.layout.compiled):
            console.print(line, soft_wrap=True)


def _terms(terms: dict[str, float], total: float, unit: str, show) -> Table:
    """A table of terms and their total, each shown by `show`."""
    table = Table()
    table.add_column("term")
    table.add_column(unit, justify="right")
    for name, value in terms.items():
        table.add_row(name, show(value))
    table.add_row("total", show(total))
    return table
