"""The figures of one size of bench/controller_scale.py (`Result`) and their report: the lines
per size, against the targets, and the closing table of all sizes."""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field

from bench.controller_scale_fleet import HANG_STEP_FACTOR, HANG_TIMEOUT_S, INTERVAL_S, STEP_S
from controller.control.controller import TICK_S

TARGET_LOOP_S, TARGET_REDIS_CPU = 1.0, 50.0


@dataclass
class Result:
    ranks: int
    nodes: int
    rate: float = 0.0  # node ticks per second achieved
    late_s: float = 0.0  # the latest any tick ran
    loop: list[float] = field(default_factory=list)  # wall time of each controller tick
    loop_cpu: list[float] = field(default_factory=list)  # its CPU time (this process)
    errors: int = 0
    stale_s: float | None = None
    stale_how: str = ""
    stall_s: float | None = None
    stall_how: str = ""
    memory: int = 0
    cpu: dict[str, float] = field(default_factory=dict)  # % of one core, over the loop window
    false_alarms: list[str] = field(default_factory=list)
    scrape: list[float] = field(default_factory=list)  # wall time of each /metrics render
    scrape_bytes: int = 0

    @property
    def sustained(self) -> bool:
        return self.rate >= 0.99 * self.nodes / INTERVAL_S and self.late_s <= 0.25 * INTERVAL_S

    @property
    def loop_period(self) -> float:
        """How long after a condition becomes true the controller's event can land: the wait
        for the next tick (ticks start every TICK_S while one takes less) plus that tick's own
        time up to its event (p99). Back-to-back ticks (p99 > TICK_S): up to two ticks."""
        took = p99(self.loop)
        return min(TICK_S + took if took <= TICK_S else 2 * took, TARGET_LOOP_S)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


# --- report -------------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(r: Result) -> None:
    need = r.nodes / INTERVAL_S
    print(f"  simulator: {r.rate:,.0f} node ticks/s of {need:,.0f} needed "
          f"({100 * r.rate / need:.1f}%), latest tick {1000 * r.late_s:.0f} ms behind "
          f"schedule: " + ("sustained 1 Hz per node" if r.sustained else "did NOT sustain 1 Hz "
                           "per node: the figures below do not describe a 1 Hz cluster"))
    if not r.loop:
        return
    top = max(r.loop)
    print(f"  controller loop: tick median {ms(statistics.median(r.loop))}, p99 "
          f"{ms(p99(r.loop))}, max {ms(top)} over {len(r.loop)} ticks (target <= "
          f"{TARGET_LOOP_S:g} s: {verdict(top <= TARGET_LOOP_S)}); CPU per tick median "
          f"{ms(statistics.median(r.loop_cpu))}, max {ms(max(r.loop_cpu))}"
          + (f"; {r.errors} tick(s) hit a Redis error" if r.errors else ""))
    limit = 2 * INTERVAL_S + r.loop_period
    if r.stale_s is None:
        print(f"  stale node: {r.stale_how} (target <= {limit:.2f} s: MISSED)")
    else:
        print(f"  stale node: decided {r.stale_s:.2f} s after its last tick (target <= 2 x "
              f"{INTERVAL_S:g} s + one loop {r.loop_period:.2f} s = {limit:.2f} s: "
              f"{verdict(r.stale_s <= limit)}); {r.stale_how[:160]}")
    bound = STEP_S + max(HANG_TIMEOUT_S, HANG_STEP_FACTOR * STEP_S) + 2 * INTERVAL_S \
        + r.loop_period
    if r.stall_s is None:
        print(f"  stalled rank: {r.stall_how[:300]}")
    else:
        print(f"  stalled rank: first event naming the culprit {r.stall_s:.2f} s after the "
              f"stall (no target; expected <= 1 step + threshold max({HANG_TIMEOUT_S:g}, "
              f"{HANG_STEP_FACTOR:g} x {STEP_S:g} s) + 2 intervals + one loop = {bound:.2f} s: "
              f"{'within' if r.stall_s <= bound else 'OVER'}); {r.stall_how[:160]}")
    print(f"  Redis: used_memory {r.memory / 2**20:,.1f} MiB; CPU {r.cpu['redis']:.1f}% of one "
          f"core (target <= {TARGET_REDIS_CPU:g}%: {verdict(r.cpu['redis'] <= TARGET_REDIS_CPU)})"
          f"; beside it, % of one core: controller process {r.cpu['controller']:.0f}, simulator "
          f"{r.cpu['simulator']:.0f}, other work on this machine {r.cpu['others']:.0f} "
          f"(of {100 * (os.cpu_count() or 1)})")
    if r.scrape:
        print(f"  exporter: /metrics ({r.scrape_bytes:,} bytes) computed from Redis in "
              f"{ms(statistics.median(r.scrape))} median, {ms(max(r.scrape))} max over "
              f"{len(r.scrape)} scrapes (no target; at a 15 s scrape interval that is "
              f"{100 * statistics.median(r.scrape) / 15:.1f}% of a core)")
    if r.false_alarms:
        print(f"  false alarms: {len(r.false_alarms)} decision(s) about healthy nodes (failures "
              f"undone), e.g. " + " | ".join(r.false_alarms[:2]))


def ms(seconds: float) -> str:
    return f"{1000 * seconds:,.0f} ms" if seconds >= 0.1 else f"{1000 * seconds:.1f} ms"


def table(results: list[Result]) -> None:
    print("\n| ranks | nodes | sim ticks/s (needed) | loop median / p99 / max | stale node | "
          "stalled rank | Redis memory | Redis CPU | /metrics median |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        stale = "-" if r.stale_s is None else f"{r.stale_s:.2f} s"
        stall = "-" if r.stall_s is None else f"{r.stall_s:.2f} s"
        loop = " / ".join(ms(f(r.loop)) for f in (statistics.median, p99, max)) if r.loop \
            else "-"
        print(f"| {r.ranks:,} | {r.nodes:,} | {r.rate:,.0f} ({r.nodes:,}) | {loop} | {stale} | "
              f"{stall} | {r.memory / 2**20:,.1f} MiB | {r.cpu.get('redis', 0):.1f}% | "
              f"{ms(statistics.median(r.scrape)) if r.scrape else '-'} |")
