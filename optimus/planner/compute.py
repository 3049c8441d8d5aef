"""The device's own work in a step: matmuls and attention at the profile's rates, and the
element-wise work at its memory bandwidth, for the pipeline rank with the most of it.

Matmul and attention rates come from one of two places:
- measured (`Machine.rates`, a table bench/gemm_sweep.py writes: rates.py): each of the
  block's matmuls at its own shape, forward, input gradient and weight gradient each looked
  up as the matmul it is (x [m, k] @ w [n, k].t(); the input gradient is (m, k, n), the
  weight gradient (n, k, m)); attention at its measured rate by sequence length;
- uncalibrated, until a sweep exists for the profile: the FLOPs at peak x `sustained` x a
  shape factor M / (M + 128) x K / (K + 128), M the rank's tokens of a microbatch and K =
  dim / tp (`SHAPE_KNEE`), attention at the same rate.

Element-wise work (`elementwise_bytes`) is memory-bound: the bytes its kernels read and write
per token, at the profile's `hbm_gbps`. Counted from optimus/models/gpt.py's block as it runs:
eager, each op is a kernel that reads its inputs and writes its output (the float32 casts of
RMSNorm and RoPE, RoPE's four half-width products, its sum and difference and stack, the
attention output's copy, two residual adds, SiLU and the gate's product; in an MoE layer the
dispatch and combine of top_k copies); compiled (torch.compile, or a stack's fused kernels),
a fused kernel reads its inputs once and writes its outputs once (residual add and norm
together, RoPE in one pass, the SwiGLU gate in one). A backward moves twice its forward's
bytes (the output's gradient and the saved inputs read, the input's gradient written), a
recomputed forward once more. The loss's softmax over the vocabulary is float32 either way
(parallel/loss.py). The counts are checked against two compile speed-ups in
docs/planner.md: ours (Mula-1B on an H200) and torchtitan's published one (Llama 3.1 8B).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from optimus.config.schedule_rules import stage_ids, stage_layers, stage_style
from optimus.models.counts import _matmul_params_per_layer, is_moe_layer
from optimus.planner.machines import Machine
from optimus.planner.memory import COMPUTE, _kv_local, shape_of

SHAPE_KNEE = 128  # tokens or width at which a matmul runs at half its sustained rate
FP32 = 4


@dataclass(frozen=True)
class Work:
    """Seconds of one microbatch's device work on the busiest pipeline rank."""

    compute: float  # matmuls and attention, recomputed forwards included
    memory: float  # element-wise work at the memory bandwidth
    attention_rate: float  # FLOP/s of attention (the whole square counted)


def shape_factor(tokens: float, width: float) -> float:
    return tokens / (tokens + SHAPE_KNEE) * width / (width + SHAPE_KNEE)


def _dtype(lay, linear: bool = False) -> str:
    """The table's dtype: fp32, bf16, or float8 for the blocks' linears under training.float8
    (without a table float8 is not priced: the uncalibrated rate is bf16's)."""
    if lay.precision == "fp32":
        return "fp32"
    return "float8" if linear and lay.float8 else "bf16"


@lru_cache(maxsize=65536)
def _gemms(cfg, layer: int, tp: int, ep: int, tokens: float) -> tuple:
    """Forward matmuls (m, n, k, how many) of one layer on one rank, `tokens` the rank's
    tokens of a microbatch (sequence parallel gathers them whole for each matmul)."""
    d, hd = cfg.dim, cfg.dim // cfg.n_heads
    q = cfg.n_heads * hd / tp
    kv = _kv_local(cfg, tp)
    out = [(tokens, q, d, 1), (tokens, kv, d, 2), (tokens, d, q, 1)]
    if not is_moe_layer(cfg, layer):
        f = cfg.ffn_dim / tp
        return (*out, (tokens, f, d, 2), (tokens, d, f, 1))
    m = cfg.moe
    # the rank's tokens (tokens / tp of them: experts stay whole on every tp rank) go top_k
    # times to the experts; each of the rank's experts / ep gets its share from ep ranks
    per_expert = tokens / tp * m.top_k / m.experts * ep
    local = m.experts / ep
    out += [(tokens / tp, m.experts, d, 1), (per_expert, m.expert_ffn_dim, d, 2 * local),
            (per_expert, d, m.expert_ffn_dim, local)]
    if m.shared_experts:
        shared = m.expert_ffn_dim * m.shared_experts
        out += [(tokens / tp, shared, d, 2), (tokens / tp, d, shared, 1)]
    return tuple(out)


def _table_seconds(machine: Machine, dtype: str, gemms, recomputed: bool,
                   dense: int = 0) -> float:
    """Seconds of `gemms` forward, backward (input and weight gradients) and, if
    `recomputed`, forward again, at their measured rates; the first `dense` of them (the
    block's dense linears) in `dtype`, the rest in bf16 (or fp32) where `dtype` is float8:
    torchao's float8 training converts the blocks' linear layers, not the router, the
    experts (training.float8_experts) or the output projection."""
    rates = machine.rate_table
    total = 0.0
    for i, (m, n, k, count) in enumerate(gemms):
        if dtype == "float8" and i >= dense:
            dtype = "bf16"
        flops = 2 * m * n * k * count
        forward = flops / rates.matmul(dtype, m, n, k)
        total += forward * (2 if recomputed else 1) + flops / rates.matmul(dtype, m, k, n) \
            + flops / rates.matmul(dtype, n, k, m)
    return total


def elementwise_bytes(cfg, layer: int, tp: int, c: int, compiled: bool) -> float:
    """Bytes one layer's element-wise kernels read and write per token of a rank's
    microbatch, forward only (module text)."""
    d = cfg.dim / tp  # norms and residuals: the rank's tokens / tp of the sequence
    q, kv = cfg.n_heads * (cfg.dim // cfg.n_heads) / tp, _kv_local(cfg, tp)
    cast = 0 if c == FP32 else c + FP32  # a float32 cast: read c, write 4
    moe = is_moe_layer(cfg, layer)
    if compiled:
        block = 2 * 4 * c * d + 2 * c * (q + kv) + 2 * c * d  # add+norm x2, RoPE, attn copy
        if cfg.qk_norm:
            block += 2 * c * (q + kv)
        ffn = 3 * c * cfg.ffn_dim / tp  # read gate and up, write their product
    else:
        norm = 2 * cast + 2 * FP32  # cast up, the float32 norm, cast down
        rope = 2 * cast + 4 * FP32 + 2 * 3 * FP32 / 2 + 2 * FP32  # products, +/-, stack
        block = 2 * norm * d + rope * (q + kv) + 2 * c * d + 2 * 3 * c * d
        if cfg.qk_norm:
            block += norm * (q + kv)
        ffn = 5 * c * cfg.ffn_dim / tp  # SiLU (read, write), product (read 2, write)
    if moe:
        m = cfg.moe
        gate = (3 if compiled else 5) * c
        ffn = (2 * c * cfg.dim * m.top_k  # dispatch: each copy read and written
               + gate * m.expert_ffn_dim * (m.top_k + m.shared_experts)
               + (c + FP32) * cfg.dim * m.top_k + c * cfg.dim) / tp  # float32 combine
    return block + ffn


def head_bytes(cfg, tp: int, c: int, compiled: bool) -> float:
    """Bytes per token of the last stage's final norm (forward and backward) and its loss's
    float32 softmax over the vocabulary / tp (forward and backward)."""
    v, d = cfg.vocab_size / tp, cfg.dim / tp
    if compiled:
        return 3 * 2 * c * d + 3 * c * v  # logits read twice, their gradient written
    cast = 0 if c == FP32 else c + FP32
    return 3 * (2 * cast + 2 * FP32) * d + (2 * cast + 4 * FP32) * v


def _attention_flops(cfg, lay) -> float:
    """Attention FLOPs per token per layer on a rank (the whole square, forward and backward)."""
    return 12 * cfg.n_heads * (cfg.dim // cfg.n_heads) * lay.seq_len / lay.dims.tp


def _layer(cfg, lay, machine: Machine, layer: int, again: bool) -> tuple[float, float]:
    """(compute, element-wise) seconds of one layer for one microbatch on one rank, its
    forward run `again` under recompute."""
    dims, tokens = lay.dims, lay.rank_tokens
    passes = 3 + again  # forward, backward (twice the forward), a recomputed forward
    attention = _attention_flops(cfg, lay) * tokens * passes / 3
    if machine.rate_table is None:
        flops = (6 * _matmul_params_per_layer(cfg, layer, True) / dims.tp * tokens
                 * passes / 3 + attention)
        seconds = flops / uniform_rate(cfg, lay, machine)
    else:
        gemms = _gemms(cfg, layer, dims.tp, dims.ep, tokens)
        linears = 3 if is_moe_layer(cfg, layer) else len(gemms)  # attention's; the ffn's
        seconds = _table_seconds(machine, _dtype(lay, linear=True), gemms, again, linears)
        seconds += attention / attention_rate(cfg, lay, machine)
    c = COMPUTE[lay.precision]
    memory = elementwise_bytes(cfg, layer, dims.tp, c, lay.compiled) * passes * tokens
    return seconds, memory / (machine.hbm_gbps * 1e9)


def _head(cfg, lay, machine: Machine) -> tuple[float, float]:
    """(compute, element-wise) seconds of the output projection and loss for a microbatch."""
    tokens, tp = lay.rank_tokens, lay.dims.tp
    if machine.rate_table is None:
        seconds = 6 * cfg.dim * cfg.vocab_size / tp * tokens / uniform_rate(cfg, lay, machine)
    else:
        seconds = _table_seconds(machine, _dtype(lay),
                                 ((tokens, cfg.vocab_size / tp, cfg.dim, 1),), False)
    memory = head_bytes(cfg, tp, COMPUTE[lay.precision], lay.compiled) * tokens
    return seconds, memory / (machine.hbm_gbps * 1e9)


def uniform_rate(cfg, lay, machine: Machine) -> float:
    """FLOP/s of every matmul without a measured table: peak x sustained x shape factor."""
    return (machine.peak_tflops * 1e12 * machine.sustained
            * shape_factor(lay.rank_tokens, cfg.dim / lay.dims.tp))


def attention_rate(cfg, lay, machine: Machine) -> float:
    """FLOP/s of attention, the whole square counted: measured, or the matmuls' rate."""
    table = machine.rate_table
    measured = table and table.attention(_dtype(lay), lay.seq_len, cfg.dim // cfg.n_heads)
    return measured or uniform_rate(cfg, lay, machine)


def _multiples(start: int, stop: int, k: int) -> int:
    """How many multiples of k lie in [start, stop)."""
    return max(0, (stop - 1) // k - (start - 1) // k) if stop > start else 0


def _kinds(cfg, lay, layers: range) -> dict[tuple[bool, bool], int]:
    """How many of `layers` are (MoE, recomputed), counted without walking them."""
    first_moe = cfg.moe.dense_layers if cfg.moe.experts else cfg.n_layers
    out = {}
    for moe, part in ((False, range(layers.start, min(layers.stop, first_moe))),
                      (True, range(max(layers.start, first_moe), layers.stop))):
        if not len(part):
            continue
        if lay.recompute == "full":
            again = len(part)
        elif lay.recompute == "selective":
            again = _multiples(part.start, part.stop, lay.ac_every)
        else:
            again = 0
        for recomputed, count in ((True, again), (False, len(part) - again)):
            if count:
                out[(moe, recomputed)] = count
    return out


def rank_work(cfg, lay, machine: Machine) -> Work:
    """One microbatch's work on the busiest pipeline rank: the rank holding the first stage
    (the most layers) or the one holding the last (the head and loss)."""
    cfg, dims = shape_of(cfg), lay.dims
    kinds: dict[tuple[bool, bool], tuple[float, float]] = {}
    first_moe = cfg.moe.dense_layers if cfg.moe.experts else cfg.n_layers
    ranges = stage_layers(cfg.n_layers, dims.stages)
    last, style = dims.stages - 1, stage_style(lay.schedule)
    best = None
    for rank in {0, dims.pp - 1}:
        compute = memory = 0.0
        for s in stage_ids(rank, dims.pp, dims.virtual_stages, style):
            for kind, count in _kinds(cfg, lay, ranges[s]).items():
                if kind not in kinds:  # a layer of that kind: the first MoE or dense one
                    layer = first_moe if kind[0] else 0
                    kinds[kind] = _layer(cfg, lay, machine, layer, kind[1])
                compute, memory = compute + count * kinds[kind][0], \
                    memory + count * kinds[kind][1]
            if s == last:
                head = _head(cfg, lay, machine)
                compute, memory = compute + head[0], memory + head[1]
        if best is None or compute + memory > sum(best):
            best = (compute, memory)
    return Work(best[0], best[1], attention_rate(cfg, lay, machine))
