"""Step time of a layout on a machine profile: compute, communication, pipeline bubble.

Assumptions, all of them here:
- compute (compute.py): the matmuls and attention of `optimus.models.counts.flops_per_token`
  (6 per active matmul weight per token, plus attention), plus the forward recomputed under
  activation checkpointing (full: every block's; selective: the blocks it checkpoints, one in
  `ac_every`), at the profile's measured rates by shape where a GEMM sweep made a table for
  it, and otherwise uncalibrated: peak x `sustained` x a shape factor M/(M + 128) x
  K/(K + 128) (small microbatches and narrow tensor-parallel shards starve the device). Under
  a pipeline the step waits for the busiest rank: its stages' blocks (the earlier stages take
  the extra layers) plus the output projection and loss on the rank holding the last stage;
  without one, every rank does the same.
- element-wise work (`memory_s`, compute.py): the bytes the block's norms, RoPE, residual adds,
  SwiGLU gate, MoE dispatch and combine and the loss's softmax read and write, eager (one
  kernel an op) or compiled (fused), at the profile's HBM bandwidth.
- the stack (`stack_s`, stacks.py): what Optimus's step adds to the plain loop's on the same
  device work, from their measured ratio; a published run of another stack takes its own.
- op-level recompute redoes no matmul, only the element-wise ops (norms, RoPE, the SwiGLU's
  gate, softmax statistics): memory-bound work, priced as the bytes of what it recomputes
  (what a block keeps without recompute less what `op` keeps, memory.py's table) read and
  written once each, at the profile's HBM bandwidth (`recompute_s`; bench/recompute.py
  measured it at 1.06x the step on a CPU, where bandwidth is scarce against compute).
- tensor parallel: per block per microbatch two all-gathers and two reduce-scatters of the
  microbatch's hidden states forward, as many backward (and again forward under recompute),
  on the intra-node link while tp fits a node; not overlapped with compute.
- pipeline: each microbatch's hidden states cross every stage boundary forward and back, on
  the inter-node link once tp x pp exceeds a node; not overlapped. The bubble is the replay
  of torch's own action list for the schedule (schedules.bubble).
- data parallel (FSDP2): parameters all-gathered in compute dtype for each microbatch's
  forward and again for its backward (under a pipeline torch's stages hold them from a
  backward to the next forward: m + 1 a step), or once a step where they stay gathered
  (`param_gather: step`, or a zero-bubble schedule: PlanLayout.keeps_gathered); gradients
  reduce-scattered in fp32 once per step, on the inter-node link; overlapped per unit (one
  block) with the compute of the unit before: the first gather of each pass and the last
  reduce-scatter show whole, and a unit whose traffic exceeds its compute shows the excess
  (`fsdp_exposed`).
- attention: `flops_per_token` counts its scores and weighted sum over the whole sequence,
  12 x layers x heads x head_dim x seq_len per token, the full T x T square. Causal attention
  needs half of it, but the attention kernels run well below the matmuls' rate, and the
  square priced at the matmuls' rate lands within 20% of torchtitan's published
  long-sequence runs (Llama 3.1 8B with cp 4 at 131,072 and cp 8 at 262,144 tokens on 8 H100:
  tests/test_planner_context.py), where half of it would be 1.7-1.8x too fast; a GEMM sweep's
  measured attention rate replaces it. Under context parallel each rank computes
  seq_len / cp positions' share, against the whole sequence.
- context parallel: the exchange of `context.exchange`, per layer per microbatch: all-to-all
  shows whole; the ring's k, v shifts show only what exceeds the attention of the block they
  run under (`cp_comm`; `cp_hidden` is what hides).
- expert parallel: four all-to-alls per MoE layer per microbatch (dispatch and combine,
  forward and backward) of top_k copies of each token, intra-node while tp x ep fits a node.
- ring collectives: a device sends (n - 1) / n of the buffer; latency per step of the ring.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from optimus.config.schedule_rules import stage_layers
from optimus.models.counts import flops_per_token, is_moe_layer, matmul_param_count
from optimus.planner import context
from optimus.planner.compute import SHAPE_KNEE, rank_work  # noqa: F401  (SHAPE_KNEE: re-exported)
from optimus.planner.machines import Machine
from optimus.planner.memory import COMPUTE, GRAD, PlanLayout, _layer_activation, shape_of
from optimus.planner.schedules import bubble
from optimus.planner.stacks import OURS, get_stack


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by term, and what they give."""

    compute: float
    tp_comm: float
    pp_comm: float
    ep_comm: float
    bubble: float
    dp_exposed: float
    recompute_s: float = 0.0  # op-level recompute: memory-bound element-wise work
    cp_comm: float = 0.0  # context parallel's exchange that attention does not hide
    cp_hidden: float = 0.0  # the ring's exchange under attention (not in the total)
    memory_s: float = 0.0  # element-wise work (norms, RoPE, gates, the loss's softmax)
    stack_s: float = 0.0  # what the stack's step adds to the plain loop's (stacks.yaml)
    tokens_per_s_per_device: float = 0.0
    tflops_per_device: float = 0.0  # model FLOPs with recompute, as seed 001 counts them
    mfu: float = 0.0  # model FLOPs without recompute, against the peak

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.pp_comm + self.ep_comm + self.bubble
                + self.dp_exposed + self.recompute_s + self.cp_comm + self.memory_s
                + self.stack_s)

    def terms(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items()
                if k not in ("cp_hidden", "tokens_per_s_per_device", "tflops_per_device",
                             "mfu")}


def _ring(n: int, size: float, gbps: float, latency_us: float) -> float:
    """Seconds of a ring all-gather or reduce-scatter of `size` bytes over n devices."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * size / (gbps * 1e9) + (n - 1) * latency_us * 1e-6


def _passes(lay: PlanLayout) -> list[tuple[int, bool, bool, bool]]:
    """FSDP2's passes over the rank's units in a step: (how many, forward, gathers,
    reduce-scatters). Counted (tests/test_param_gather.py): a gather per microbatch's forward
    and backward; m + 1 under a pipeline, whose stages hold the units gathered from a
    backward to the next forward; one a step where they stay gathered. The reduce-scatter
    runs in the last backward."""
    m = lay.microbatches
    if lay.keeps_gathered:
        return [(1, True, True, False), (1, False, False, True)]
    if lay.dims.pp > 1:  # the first forward gathers, then each backward (forwards find them held)
        return [(1, True, True, False), (m - 1, False, True, False), (1, False, True, True)]
    return [(m, True, True, False), (m - 1, False, True, False), (1, False, True, True)]


def fsdp_exposed(forward: float, backward: float, units: int, gather: float, reduce: float,
                 passes: list[tuple[int, bool, bool, bool]]) -> float:
    """Seconds of FSDP2 traffic that do not hide under compute, per-unit overlap.

    In a pass over `units` units the collectives of the next unit overlap the compute of this
    one (FSDP2's prefetch): the first unit's gather waits with nothing to hide under, the last
    unit's reduce-scatter has nothing left to hide under, and a unit whose traffic takes longer
    than its compute (`forward` or `backward` seconds a unit) shows the excess. The link is
    the dp traffic's alone while compute runs: the TP, PP and EP transfers are priced as not
    overlapped, so they hold the link outside that time, and their time is not a window."""
    exposed = 0.0
    for count, is_forward, gathers, reduces in passes:
        traffic = (gather if gathers else 0.0) + (reduce if reduces else 0.0)
        work = forward if is_forward else backward
        exposed += count * (traffic + (units - 1) * max(0.0, traffic - work))
    return exposed


def recompute_flops(cfg, lay: PlanLayout) -> float:
    """Extra FLOPs per token of the forwards recomputed in backward."""
    forward = flops_per_token(cfg, lay.seq_len) / 3
    head = 2 * cfg.dim * cfg.vocab_size  # the head is never recomputed
    blocks = forward - head
    return selective_share(cfg, lay) * blocks


def selective_share(cfg, lay: PlanLayout) -> float:
    """The share of blocks whose forward runs twice: all under `full`, those whose index in
    the whole model is a multiple of `ac_every` under `selective` (activation_checkpoint.py),
    none under `op` (it recomputes no matmul) or `none`."""
    if lay.recompute == "full":
        return 1.0
    if lay.recompute == "selective":
        return len(range(0, cfg.n_layers, lay.ac_every)) / cfg.n_layers
    return 0.0


def op_recompute_bytes(cfg, lay: PlanLayout) -> float:
    """Bytes per token of one rank's blocks (all layers / tp) that op-level recompute reads
    and writes: the elements a block keeps without recompute and not under `op`, once read
    and once written, in the compute dtype."""
    if lay.recompute != "op":
        return 0.0
    return 2 * _op_redone(shape_of(cfg), lay.dims.tp) * COMPUTE[lay.precision]


@lru_cache(maxsize=4096)
def _op_redone(cfg, tp: int) -> float:
    """Elements per token, over all layers, kept under `none` and not under `op`."""
    return sum(_layer_activation(cfg, i, "none", tp) - _layer_activation(cfg, i, "op", tp)
               for i in range(cfg.n_layers))


def step_time(cfg, lay: PlanLayout, machine: Machine, global_batch: int,
              stack: str = OURS) -> StepTime:
    """Predicted step time of `lay` with `global_batch` sequences a step, run by `stack`
    (stacks.yaml: Optimus unless a published run of another is checked)."""
    c = COMPUTE[lay.precision]
    dims = lay.dims
    node = machine.devices_per_node
    tokens_mb = lay.rank_tokens  # one microbatch of one rank (seq_len / cp of a sequence)
    m = lay.microbatches
    model_flops = flops_per_token(cfg, lay.seq_len)
    hw_flops = model_flops + recompute_flops(cfg, lay)
    work = rank_work(cfg, lay, machine)
    compute, memory_s, rate = m * work.compute, m * work.memory, work.attention_rate
    # the busiest pipeline rank's blocks, at most those of the first stage
    share = (max(len(r) for r in stage_layers(cfg.n_layers, dims.stages))
             * dims.virtual_stages / cfg.n_layers) if dims.pp > 1 else 1.0
    recompute_s = (m * tokens_mb * op_recompute_bytes(cfg, lay) * share
                   / (machine.hbm_gbps * 1e9))

    layers_here = cfg.n_layers / dims.pp
    hidden = tokens_mb * cfg.dim * c
    tp_link = machine.intra_gbps if dims.tp <= node else machine.inter_gbps
    per_block = 8 + 4 * selective_share(cfg, lay)  # the recomputed forwards gather again
    tp_comm = m * layers_here * per_block * _ring(dims.tp, hidden, tp_link, machine.latency_us)

    pp_link = machine.intra_gbps if dims.tp * dims.pp <= node else machine.inter_gbps
    pp_comm = 0.0
    if dims.pp > 1:
        pp_comm = m * dims.virtual_stages * 2 * (hidden / dims.tp / (pp_link * 1e9)
                                                 + machine.latency_us * 1e-6)

    ep_comm = 0.0
    moe_layers = sum(is_moe_layer(cfg, i) for i in range(cfg.n_layers)) / dims.pp
    if dims.ep > 1 and moe_layers:
        ep_link = machine.intra_gbps if dims.tp * dims.ep <= node else machine.inter_gbps
        routed = tokens_mb / dims.tp * cfg.moe.top_k * cfg.dim * c
        ep_comm = m * moe_layers * 4 * (dims.ep - 1) / dims.ep * routed / (ep_link * 1e9)

    exposed, hidden = context.exchange(cfg, lay, machine, c, rate, selective_share(cfg, lay))
    cp_comm, cp_hidden = m * layers_here * exposed, m * layers_here * hidden

    factor = get_stack(stack).factor(lay.compiled)
    stack_s = (compute + memory_s + recompute_s) * (1 / factor - 1)
    pipeline_bubble = ((compute + memory_s + recompute_s + stack_s + tp_comm + ep_comm + cp_comm)
                       * bubble(lay.schedule, dims.pp, dims.virtual_stages, m))

    dp_exposed = 0.0
    if lay.shard > 1:
        experts = sum(3 * cfg.dim * cfg.moe.expert_ffn_dim * cfg.moe.experts
                      for i in range(cfg.n_layers) if is_moe_layer(cfg, i))
        # this rank's parameters, unsharded: experts split over ep, the rest over tp
        params = ((matmul_param_count(cfg) - experts) / dims.tp
                  + experts / dims.ep) / dims.pp
        dp_link = machine.intra_gbps if lay.devices <= node else machine.inter_gbps
        # counted (tests/test_param_gather.py): 2 per microbatch; m + 1 under a pipeline,
        # whose stages hold the units gathered from a backward to the next forward
        units = (max(len(r) for r in stage_layers(cfg.n_layers, dims.stages))
                 * dims.virtual_stages) if dims.pp > 1 else cfg.n_layers
        gather = _ring(lay.shard, params * c / units, dp_link, machine.latency_us)
        reduce = _ring(lay.shard, params * GRAD / units, dp_link, machine.latency_us)
        forward = 1 / (3 + selective_share(cfg, lay))  # of each microbatch's compute
        busy = (compute + memory_s) / m  # the device's work a microbatch hides traffic under
        dp_exposed = fsdp_exposed(busy * forward / units, busy * (1 - forward) / units, units,
                                  gather, reduce, _passes(lay))

    result = StepTime(compute, tp_comm, pp_comm, ep_comm, pipeline_bubble, dp_exposed,
                      recompute_s, cp_comm, cp_hidden, memory_s, stack_s)
    tokens = global_batch * lay.seq_len
    per_device = tokens / result.total / lay.devices
    return replace(result, tokens_per_s_per_device=per_device,
                   tflops_per_device=per_device * hw_flops / 1e12,
                   mfu=per_device * model_flops / (machine.peak_tflops * 1e12))
