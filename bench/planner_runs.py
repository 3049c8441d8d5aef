"""Every run the planner is checked against: published runs and our own device runs, with the
layout each ran, the stack that ran it, and what it reached (bench/planner_calibration.py
prints them against the planner's predictions).

`use` says what a run is for: "calibrates" (one run per machine sets its `sustained`),
"stack" (the stack factor of stacks.yaml was measured on it, so it checks nothing), or ""
(a check: nothing of the model was set from it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_papers import SEED_001_TABLE_1  # noqa: E402

LLAMA3_8B = {"vocab_size": 128256, "dim": 4096, "n_layers": 32, "n_heads": 32,
             "n_kv_heads": 8, "ffn_dim": 14336, "max_seq_len": 8192}
LLAMA3_70B = {"vocab_size": 128256, "dim": 8192, "n_layers": 80, "n_heads": 64,
              "n_kv_heads": 8, "ffn_dim": 28672, "max_seq_len": 8192}
LLAMA2_13B = {"vocab_size": 32000, "dim": 5120, "n_layers": 40, "n_heads": 40,
              "n_kv_heads": 40, "ffn_dim": 13824, "max_seq_len": 4096}
LLAMA2_70B = {"vocab_size": 32000, "dim": 8192, "n_layers": 80, "n_heads": 64,
              "n_kv_heads": 8, "ffn_dim": 28672, "max_seq_len": 4096}
MIXTRAL_8X7B = {"vocab_size": 32000, "dim": 4096, "n_layers": 32, "n_heads": 32,
                "n_kv_heads": 8, "ffn_dim": 14336, "max_seq_len": 4096,
                "moe": {"experts": 8, "top_k": 2, "expert_ffn_dim": 14336}}
TITAN = "torchtitan docs/performance.md"
TITAN_A100 = "torchtitan docs/performance.md (2024, 64 A100 80GB)"
OURS = "docs/gpu.md: bench/mfu.py, median of 3 runs"
MEGATRON_70B = ("Megatron-core README (up to 47% MFU on H100); layout: Megatron-Bridge's "
                "llama3_70b H100 bf16 recipe (tp 4, pp 4, cp 2, GBS 256), NeMo's vp 5")
MEGATRON_MOE = ("Megatron-core MoE README (MCore v0.9: 468 TFLOP/s, Mixtral 8x7B bf16; "
                "its reference mapping: 64 H100, tp 1, ep 8, pp 4, vp 8, GBS 256)")


@dataclass(frozen=True)
class Run:
    """One run: the model, the layout it ran, who ran it, what it reached."""

    name: str
    source: str
    machine: str
    model: dict | str  # a model section, or a job file whose model it is
    seq: int
    batch: int  # sequences a step
    layout: dict = field(default_factory=dict)  # PlanLayout fields besides seq_len
    published: float = 0.0
    unit: str = "tokens/s"  # or "TFLOP/s": per device, recompute counted (seeds 000, 001)
    use: str = ""  # "calibrates", "stack", or "" for a check
    stack: str = "torchtitan"
    compiled: bool = False
    note: str = ""  # what the model does not price in it


def _fsdp(devices: int, local: int, recompute: str) -> dict:
    return {"dp": devices, "microbatch_size": local, "recompute": recompute}


def _mula(stack: str, compiled: bool, measured: float, use: str = "") -> Run:
    mode = "compiled" if compiled else "eager"
    return Run(f"Mula-1B, 1 H200, {mode}, {'the plain loop' if stack == 'plain' else stack}",
               OURS, "h200", "jobs/mula-1b.yaml", 2048, 4,
               {"dp": 1, "microbatch_size": 4, "recompute": "none"}, measured, use=use,
               stack=stack, compiled=compiled)


def _seed001(row) -> Run:
    size, _, _, _, tp, pp, gpus, batch, published, _ = row
    return Run(f"GPT {size:g}B, tp {tp} x pp {pp} on {gpus}", "seed 001, Table 1", "a100-hdr",
               "seed001", 2048, batch, {"paper": (tp, pp, gpus), "row": size}, published,
               "TFLOP/s", use="calibrates" if size > 1000 else "", stack="megatron-lm-2021",
               compiled=True)


RUNS = [
    # --- calibration: one run per machine --------------------------------------------------
    _mula("plain", True, 69295, "calibrates"),
    Run("Llama 3.1 8B, FSDP 8, op recompute", TITAN + ", Table 1", "h100-gt500", LLAMA3_8B,
        8192, 16, _fsdp(8, 2, "op"), 5762, use="calibrates"),
    Run("GPT 175B, tp 8 x pp 12 x dp 16", "seed 000 (arXiv 2605.07726)", "max1550-supermuc",
        "jobs/gpt-175b.yaml", 2048, 1536,
        {"dp": 16, "tp": 8, "pp": 12, "v": 2, "schedule": "interleaved_1f1b",
         "microbatches": 96, "recompute": "full"}, 29.8, "TFLOP/s", use="calibrates",
        stack="megatron-deepspeed", compiled=True),
    *[_seed001(row) for row in SEED_001_TABLE_1 if row[0] > 1000],
    # --- our own runs: the element-wise model's check, and the stack factor's source ---------
    _mula("plain", False, 51477),
    _mula("optimus", True, 55903, "stack"),
    _mula("optimus", False, 48038, "stack"),
    # --- Megatron-core on DGX H100 (700 W) ---------------------------------------------------
    Run("Llama 3 70B, tp 4 x pp 4 x cp 2, v 5, 64 H100", MEGATRON_70B, "h100-ndr", LLAMA3_70B,
        8192, 256, {"dp": 2, "tp": 4, "pp": 4, "cp": 2, "v": 5,
                    "schedule": "interleaved_1f1b", "recompute": "none",
                    "param_gather": "step"}, 965, stack="megatron-core", compiled=True,
        note="published as 47% MFU, not as tokens/s"),
    Run("Mixtral 8x7B, ep 8 x pp 4, v 8, 64 H100", MEGATRON_MOE, "h100-ndr", MIXTRAL_8X7B,
        4096, 256, {"dp": 16, "ep": 8, "pp": 4, "v": 8, "schedule": "interleaved_1f1b",
                    "recompute": "none", "param_gather": "step"}, 468, "TFLOP/s",
        stack="megatron-core", compiled=True),
    # --- torchtitan on H100 (Grand Teton, 500 W) ---------------------------------------------
    Run("Llama 3.1 8B, FSDP 8, op recompute, compiled", TITAN + ", Table 1", "h100-gt500",
        LLAMA3_8B, 8192, 16, _fsdp(8, 2, "op"), 6667, compiled=True),
    Run("Llama 3.1 8B, FSDP 128, op recompute", TITAN + ", Table 3", "h100-gt500", LLAMA3_8B,
        8192, 256, _fsdp(128, 2, "op"), 5605),
    *(Run(f"Llama 3.1 8B, FSDP {8 // cp} x cp {cp} at {seq:,}, full, compiled + float8",
          TITAN + ", Table 2", "h100-gt500", {**LLAMA3_8B, "max_seq_len": seq}, seq, 8 // cp,
          {"dp": 8 // cp, "cp": cp, "recompute": "full", "float8": True}, published,
          compiled=True, note="float8 matmuls not priced without a sweep")
      for cp, seq, published in ((1, 32768, 3890), (2, 65536, 2540), (4, 131072, 1071),
                                 (8, 262144, 548))),
    # --- torchtitan on A100 (2024) -----------------------------------------------------------
    Run("Llama 3 8B, FSDP 64, op recompute", TITAN_A100, "a100-hdr", LLAMA3_8B, 8192, 64,
        _fsdp(64, 1, "op"), 2973),
    Run("Llama 3 8B, FSDP 64, selective (every 2nd block)", TITAN_A100, "a100-hdr", LLAMA3_8B,
        8192, 64, _fsdp(64, 1, "selective"), 2904),
    Run("Llama 3 70B, FSDP 64, full recompute", TITAN_A100, "a100-hdr", LLAMA3_70B, 8192, 64,
        _fsdp(64, 1, "full"), 331),
    Run("Llama 2 13B, FSDP 64, no recompute", TITAN_A100, "a100-hdr", LLAMA2_13B, 4096, 128,
        _fsdp(64, 2, "none"), 2162),
    Run("Llama 2 13B, FSDP 64, selective (every 2nd block)", TITAN_A100, "a100-hdr",
        LLAMA2_13B, 4096, 128, _fsdp(64, 2, "selective"), 1914),
    Run("Llama 2 13B, FSDP 64, op recompute", TITAN_A100, "a100-hdr", LLAMA2_13B, 4096, 128,
        _fsdp(64, 2, "op"), 1904),
    Run("Llama 2 70B, FSDP 64, op recompute", TITAN_A100, "a100-hdr", LLAMA2_70B, 4096, 64,
        _fsdp(64, 1, "op"), 355),
    Run("Llama 2 70B, FSDP 64, full recompute", TITAN_A100, "a100-hdr", LLAMA2_70B, 4096, 128,
        _fsdp(64, 2, "full"), 353),
    # --- seed 001 (Megatron-LM 2021 on A100): Table 2, then Table 1 ------------------------
    Run("GPT 175B, tp 8 x pp 12 x dp 16 (PTD)", "seed 001, Table 2", "a100-hdr",
        "jobs/gpt-175b.yaml", 2048, 1536,
        {"dp": 16, "tp": 8, "pp": 12, "v": 2, "schedule": "interleaved_1f1b",
         "microbatches": 96, "recompute": "full", "param_gather": "step"}, 141, "TFLOP/s",
        stack="megatron-lm-2021", compiled=True),
    *(Run(f"GPT 175B, ZeRO-3 on {n}, microbatch {size}", "seed 001, Table 2", "a100-hdr",
          "jobs/gpt-175b.yaml", 2048, 1536, _fsdp(n, size, "full"), published, "TFLOP/s",
          stack="megatron-lm-2021", compiled=True, note="DeepSpeed ZeRO-3 (2021)")
      for n, size, published in ((384, 4, 144), (768, 2, 88), (1536, 1, 44))),
    *[_seed001(row) for row in SEED_001_TABLE_1 if row[0] < 1000],
]
