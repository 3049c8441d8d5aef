"""What bench/mfu.py prints and judges: the targets, and one block of lines per mode.

The targets (docs/gpu.md says where each comes from):
- Optimus / plain loop tokens/s on a GPU: >= 1.00 in compiled bf16 without recompute,
  >= 0.97 in every other mode (issue 16);
- MFU in compiled bf16 at Mula-1B on an H200: >= 52%, against the bf16 dense peak
  of optimus/runtime/peaks.py;
- float8 over bf16 tokens/s, compiled: >= 1.15 (eager float8 runs its scaling
  kernels unfused and has none);
- synchronisations per unlogged step of the trainer: 0 (bench/mfu_window.py).
"""

from __future__ import annotations

from bench.mfu_window import UNLOGGED_SYNC_TARGET, syncs_text

KEY_MODE = "compiled-bf16-none"  # the mode the trainer is judged by
RATIO_TARGET = 0.97  # Optimus / reference tokens/s on a GPU, every other mode (issue 16)
KEY_RATIO_TARGET = 1.00  # ... in KEY_MODE
MFU_TARGETS = {"h200": 0.52}  # KEY_MODE's MFU, by a substring of the device's name
FLOAT8_TARGET = 1.15  # float8 / bf16 tokens/s, compiled


def ratio_target(mode: str) -> float:
    return KEY_RATIO_TARGET if mode == KEY_MODE else RATIO_TARGET


def mfu_target(mode: str, device: str) -> float | None:
    if mode != KEY_MODE:
        return None
    return next((t for key, t in MFU_TARGETS.items() if key in device.lower()), None)


def judge(value: float, target: float) -> str:
    return f"target >= {target:g}: {'met' if value >= target else 'MISSED'}"


def float8_speedups(entries: dict[str, dict]) -> dict[str, dict]:
    """float8 / bf16 tokens/s of each float8 mode against its bf16 twin, both sides."""
    out = {}
    for name, entry in entries.items():
        twin = entries.get(name.replace("-float8-", "-bf16-"))
        if "-float8-" in name and twin:
            out[name] = {side: entry[side]["tokens_per_s"] / twin[side]["tokens_per_s"]
                         for side in ("optimus", "reference")}
    return out


def flop_rate(tflops: float) -> str:
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.1f} GFLOP/s"


def gib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.1f} GiB"


def print_mode(name: str, entry: dict, device: str, on_gpu: bool, peak: float | None) -> None:
    ours, ref = entry["optimus"], entry["reference"]
    ratio = entry["ratio"]
    judged = judge(ratio, ratio_target(name)) if on_gpu else "on a CPU recorded, not judged"
    print(f"{name}: optimus {ours['tokens_per_s']:,.0f} tok/s, reference "
          f"{ref['tokens_per_s']:,.0f} tok/s, ratio {ratio:.3f} ({judged})")
    against = " against the bf16 peak" if "float8" in name else ""
    target = mfu_target(name, device)
    mfu = (f"MFU {ours['mfu']:.1%} (reference {ref['mfu']:.1%}){against}, peak "
           f"{peak / 1e12:.0f} TFLOP/s" + (f" ({judge(ours['mfu'], target)})" if target else "")
           if peak else "MFU n/a (no peak for this device; --peak-tflops sets one)")
    print(f"    {flop_rate(ours['tflops'])} (reference {flop_rate(ref['tflops'])}); {mfu}; "
          f"memory optimus {gib(ours['max_memory_bytes'])}, reference "
          f"{gib(ref['max_memory_bytes'])}; first loss {ours['first_loss']:.4f} / "
          f"{ref['first_loss']:.4f}", flush=True)
    print_syncs(ours.get("syncs"), ref.get("syncs"))


def print_syncs(ours: dict | None, ref: dict | None) -> None:
    """The synchronisations per unlogged step of both sides, against the trainer's target;
    where Optimus's unlogged steps made theirs (file:line x count)."""
    if ours is None or ours["unlogged"] is None:
        print(f"    synchronisations per unlogged step: {syncs_text(ours)}", flush=True)
        return
    met = "met" if ours["unlogged"] <= UNLOGGED_SYNC_TARGET else "MISSED"
    logged = (f"; per logged step {ours['logged']:g} / {ref['logged']:g}"
              if ours.get("logged") is not None and ref and ref.get("logged") is not None
              else "")
    sites = ", ".join(f"{k} x{v}" for k, v in list(ours["sites"].items())[:6])
    print(f"    synchronisations per unlogged step: optimus {syncs_text(ours)}, reference "
          f"{syncs_text(ref)} (target {UNLOGGED_SYNC_TARGET} for optimus: {met}){logged}"
          + (f"; optimus's from {sites}" if sites else ""), flush=True)


def print_speedups(speedups: dict[str, dict]) -> None:
    for name, s in speedups.items():
        target = (judge(s["optimus"], FLOAT8_TARGET) if name.startswith("compiled")
                  else "eager: no target, its scaling runs unfused")
        print(f"float8 speed-up {name}: optimus {s['optimus']:.2f}x, reference "
              f"{s['reference']:.2f}x over bf16 ({target})")


def key_figures(info: dict) -> dict:
    """The key figures out of bench/mfu.py's JSON, None where not measured."""
    entry = info.get("modes", {}).get(KEY_MODE)
    speedup = info.get("float8_speedup", {}).get(KEY_MODE.replace("-bf16-", "-float8-"))
    ours = entry["optimus"] if entry else {}
    return {"mode": KEY_MODE, "ratio": entry and entry["ratio"], "mfu": ours.get("mfu"),
            "tokens_per_s": ours.get("tokens_per_s"),
            "float8_speedup": speedup and speedup["optimus"],
            "syncs_per_unlogged_step": (ours.get("syncs") or {}).get("unlogged"),
            "reference_syncs_per_unlogged_step":
                ((entry or {}).get("reference", {}).get("syncs") or {}).get("unlogged")}
