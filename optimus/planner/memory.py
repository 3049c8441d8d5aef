"""Bytes per rank of one training step of a layout: the memory model the planner and
`optimus config check` share.

Pure arithmetic on the model config and the layout; no process, no tensor. Every term follows
what the code that runs the layout does (optimus/parallel/), and its coefficients were counted
from the tensors autograd saves, then checked against `PeakMemory` (optimus/planner/measure.py)
on real gloo ranks (tests/test_planner.py):

- state: parameters, gradients and AdamW's two moments in fp32 (in bf16 mixed precision the
  master weights and optimizer state stay fp32, data_parallel.py). FSDP2 shards all of it over
  dp x cp (context parallel ranks join the shard group); experts shard over ep, then over
  edp = dp / ep, i.e. over dp too. Tensor parallel splits attention, the dense feed-forward,
  the embedding and the head; norms, routers, experts and shared experts stay whole on every
  tp rank (tensor_parallel.py).
- gradients accumulate unsharded, in the compute dtype, while several microbatches (or a
  pipeline) run before the one reduce-scatter; with one microbatch each block's gradient is
  reduce-scattered at once and only the fp32 shard stays.
- FSDP2 transients: the root unit (embedding, final norm, head) stays gathered through the
  forward; the block in compute and the one prefetched are gathered too. The zero-bubble
  schedules keep every block gathered from forward to backward (pipeline.py), and so does
  `parallel.param_gather: step` through the whole step (data_parallel.py): the rank's whole
  share of the model in the compute dtype; at dp 1 in bf16 the whole model is one unit kept
  in bf16.
- activations: per token per layer (the `_layer_activation` table below), times the rank's
  tokens of a microbatch (its seq_len / cp positions of each sequence under context parallel,
  whose attention adds its own terms: context.py), times the microbatches each stage holds
  at the rank's worst moment under its schedule (schedules.py, from torch's own action
  lists); the last stage adds the vocab-parallel loss's logits, the first the embedding's
  output. The loss is float32 in either precision (`LOSS`: the logits are upcast, so in bf16
  it holds twice the bytes of the compute dtype's logits). `model.qk_norm` adds its norms'
  inputs and outputs to a block that does not recompute; `optim.z_loss` adds a float32
  [tokens, vocab / tp] to the loss's logits, measured where the loss is the step's peak.
- backward: while a block runs backward its recomputed activations (full, selective, op) and
  the gradients of its activations exist besides.
- slack: `SLACK` of the rest, for what no formula here follows (communication buffers,
  allocator rounding and fragmentation on a GPU, small buffers). The test's predictions
  include it. On a GPU the caching allocator's reserve sits above `max_memory_allocated`,
  which this model does not predict: the machine profile's `headroom_gib` keeps room for it
  (and for the context and the collectives' buffers) when the planner decides what fits.

docs/planner.md has the per-token table of `_layer_activation` and the measured errors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import NamedTuple

from optimus.config.schedule_rules import SPLIT_BACKWARD, stage_ids, stage_layers, stage_style
from optimus.models.counts import is_moe_layer
from optimus.planner import context
from optimus.planner.schedules import in_flight
from optimus.runtime.dims import ParallelDims

SLACK = 0.05
# Bytes per vocabulary entry (of the rank's vocab / tp) per token of the loss at its peak, in
# either precision: the loss upcasts the logits (`F.cross_entropy(logits.float())`,
# parallel/loss.py), so its softmax, the softmax's saved output and its gradient are float32
# even in bf16: 3 x 4 bytes (the bf16 logits are freed by then). Measured with `PeakMemory`
# on the loss alone (tests/test_planner_calibration.py): 12.0 bytes in bf16 and in fp32.
# A pipeline's last stage keeps each other held microbatch's float32 softmax output (4 bytes);
# the z-loss adds one more float32 [tokens, vocab / tp] (its exp, measured in a whole step).
LOSS, LOSS_HELD, Z_LOSS = 12, 4, 4
# Bytes per element: fp32 master weights, gradients (reduced in fp32) and AdamW's two moments.
MASTER, GRAD, OPTIM = 4, 4, 8
COMPUTE = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class PlanLayout:
    """One candidate of a job: its layout (the degrees the trainer would run), schedule, batch
    shape, recompute, precision."""

    dims: ParallelDims = ParallelDims()
    schedule: str = "1f1b"
    microbatches: int = 1
    microbatch_size: int = 1  # sequences per microbatch per dp replica
    seq_len: int = 2048
    recompute: str = "none"  # none, full, selective, op
    ac_every: int = 2
    precision: str = "bf16"  # fp32, or bf16 compute with fp32 master weights
    param_gather: str = "microbatch"  # or "step": FSDP2 parameters kept gathered a whole step
    z_loss: bool = False  # optim.z_loss > 0: the loss keeps more of the logits (module text)
    cp_method: str = "alltoall"  # or "ring": attention across the cp ranks (context.py)
    cp_split: str = "balanced"  # or "contiguous": the runs of positions a cp rank holds
    compiled: bool = False  # training.compile: element-wise work fused (planner/compute.py)
    float8: bool = False  # training.float8: the blocks' dense linears at a table's float8 rates

    @property
    def keeps_gathered(self) -> bool:
        """Whether the rank's parameters stay gathered from a forward to its backward and
        across microbatches: `param_gather: step`, or a zero-bubble schedule (pipeline.py)."""
        return self.param_gather == "step" or (self.dims.pp > 1
                                                and self.schedule in SPLIT_BACKWARD)

    @property
    def devices(self) -> int:
        return self.dims.world_size

    @property
    def shard(self) -> int:
        """Ranks FSDP2 shards the weights over: data and context parallel ones (dims.py)."""
        return self.dims.size("shard")

    @property
    def rank_tokens(self) -> float:
        """Tokens of one microbatch on one rank: its share of the positions under cp."""
        return self.microbatch_size * self.seq_len / self.dims.cp

    def fields(self) -> dict:
        """Every field, the degrees among them, by the names `optimus plan -o json` prints."""
        out = {k: v for k, v in asdict(self.dims).items() if k != "virtual_stages"}
        out["v"] = self.dims.virtual_stages
        return out | {k: v for k, v in asdict(self).items() if k != "dims"}

    def label(self) -> str:
        d = self.dims
        out = f"tp{d.tp}.pp{d.pp}.dp{d.dp}"
        if d.ep > 1:
            out += f".ep{d.ep}"
        if d.cp > 1:
            out += f".cp{d.cp}.{self.cp_method}"
        if d.pp > 1:
            v = d.virtual_stages
            out += f".{self.schedule}" + (f".v{v}" if v > 1 else "")
        out += f".mb{self.microbatch_size}x{self.microbatches}.{self.recompute}"
        return out + (".gathered" if self.param_gather == "step" else "")


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank at its step's peak, by term."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    gathered: float  # FSDP2 / bf16 copies of parameters in compute
    backward: float  # recompute and activation gradients of the block in backward
    slack: float
    pp_rank: int = 0

    @property
    def total(self) -> float:
        return (self.parameters + self.gradients + self.optimizer + self.activations
                + self.logits + self.gathered + self.backward + self.slack)

    def terms(self) -> dict[str, float]:
        out = asdict(self)
        out.pop("pp_rank")
        return out

    def largest(self) -> tuple[str, float]:
        return max(self.terms().items(), key=lambda kv: kv[1])


class _MoEShape(NamedTuple):
    experts: int
    top_k: int
    expert_ffn_dim: int
    shared_experts: int
    dense_layers: int


class Shape(NamedTuple):
    """What the memory model reads of a model config; hashable, so per-layer terms cache."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    moe: _MoEShape
    qk_norm: bool = False


def shape_of(cfg) -> Shape:
    if isinstance(cfg, Shape):
        return cfg
    m = cfg.moe
    return Shape(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                 cfg.ffn_dim, _MoEShape(m.experts, m.top_k, m.expert_ffn_dim or cfg.ffn_dim,
                                        m.shared_experts, m.dense_layers), cfg.qk_norm)


def _kv_local(cfg, tp: int) -> float:
    """Key (or value) width per rank: heads split over tp, or one head replicated past it."""
    hd = cfg.dim // cfg.n_heads
    return max(cfg.n_kv_heads * hd / tp, hd if tp > 1 else 0)


@lru_cache(maxsize=65536)
def _layer_params(cfg, layer: int, tp: int, ep: int) -> tuple[float, float]:
    """(elements of layer `layer` on one rank outside experts, inside experts)."""
    hd = cfg.dim // cfg.n_heads
    attention = 2 * cfg.dim * cfg.n_heads * hd / tp + 2 * cfg.dim * _kv_local(cfg, tp)
    norms = 2 * cfg.dim + (2 * hd if cfg.qk_norm else 0)  # whole on every tp rank
    if not is_moe_layer(cfg, layer):
        return attention + norms + 3 * cfg.dim * cfg.ffn_dim / tp, 0.0
    m = cfg.moe
    # MoE parameters stay whole on every tp rank; experts split over ep.
    other = cfg.dim * m.experts + 3 * cfg.dim * m.expert_ffn_dim * m.shared_experts
    return attention + norms + other, 3 * cfg.dim * m.expert_ffn_dim * m.experts / ep


@lru_cache(maxsize=65536)
def _layer_activation(cfg, layer: int, mode: str, tp: int) -> float:
    """Elements saved for backward per token of the microbatch, by one layer, under `mode`.

    Counted from the tensors the block's autograd graph keeps (fp32; see the module text) and
    measured: without recompute a dense block keeps its two gathered norm outputs (full width
    under sequence parallel), q, q after RoPE, the attention output and its reshaped copy,
    the residual after attention and the block output (the last two on the local sequence),
    k and v (and k after RoPE, in part), the softmax statistics, and the SwiGLU's four
    ffn-wide tensors; with QK-norm, two more of q and of k (the norm's normalised input and its
    output) and their per-head statistics. `op` keeps the matmul and attention outputs and the
    block input (the q/k norms are recomputed); `full` the block input alone. An MoE
    feed-forward keeps, per routed slot (top_k per token), the dispatched token, its padded copy
    and the expert's three hidden tensors.
    """
    d, h = cfg.dim, cfg.n_heads
    kv = _kv_local(cfg, tp) if tp > 1 else cfg.n_kv_heads * (d // h)  # per rank
    if mode == "full":
        return d / tp
    moe = is_moe_layer(cfg, layer)
    m = cfg.moe
    if mode == "op":
        # q, the attention output and the block input on local heads / sequence; wo's matmul
        # output before its reduce-scatter is full width, and so are the reduce-scatters'
        # outputs kept under tp.
        attention = 3 * d / tp + d + 2 * kv + h / tp + (2 * d / tp if tp > 1 else 0)
        if moe:
            return attention + m.top_k * (d + 2 * m.expert_ffn_dim) + m.experts
        return attention + d + 2 * cfg.ffn_dim / tp
    gathered = 2 * d  # the norm outputs all-gathered to the full sequence (tp > 1), or not
    attention = gathered + 6 * d / tp + 2 * kv + (h + 2) / tp
    if cfg.qk_norm:
        attention += 2 * (d / tp + kv) + h / tp + kv / (d // h)
    if moe:
        return attention + m.top_k * (5 * d + 3 * m.expert_ffn_dim) + 2 * m.experts
    return attention + 4 * cfg.ffn_dim / tp


def _block_mode(lay: PlanLayout, layer: int) -> str:
    """What recompute does to block `layer`: selective checkpoints every ac_every-th block by
    its index in the whole model (activation_checkpoint.py), fully."""
    if lay.recompute == "selective":
        return "full" if layer % lay.ac_every == 0 else "none"
    return lay.recompute


def _first_moe(cfg) -> int:
    """The index of the first MoE layer (n_layers for a dense model)."""
    m = getattr(cfg, "moe", None)
    return m.dense_layers if m is not None and m.experts else cfg.n_layers


@lru_cache(maxsize=256)
def _per_layer(cfg, lay: PlanLayout) -> tuple[tuple[float, float], ...]:
    """(bytes kept under the layout's recompute, bytes kept under none) per token, by layer:
    layers differ only in being MoE and being recomputed, so one of each kind is computed."""
    kinds: dict[tuple[bool, str], tuple[float, float]] = {}
    out = []
    first_moe = _first_moe(cfg)
    for i in range(cfg.n_layers):
        key = (i >= first_moe, _block_mode(lay, i))
        if key not in kinds:
            kinds[key] = (_layer_bytes(cfg, lay, i, key[1]), _layer_bytes(cfg, lay, i, "none"))
        out.append(kinds[key])
    return tuple(out)


def _layer_bytes(cfg, lay: PlanLayout, layer: int, mode: str) -> float:
    """Bytes per token one layer keeps: its elements at the compute dtype's size, plus, in
    bf16 without recompute, what stays in fp32 there (measured: the float copies RMSNorm and
    RoPE save, about 4 d-wide tensors, and an MoE layer's fp32 combine of its top_k
    outputs), plus what attention across context-parallel ranks keeps (context.py). Layers
    differ only in being MoE or dense: one of each kind is computed (and kept) per layout."""
    tp, c = lay.dims.tp, COMPUTE[lay.precision]
    out = _layer_activation(cfg, layer, mode, tp) * c + context.saved_bytes(cfg, lay, mode, c)
    if c < 4 and mode == "none":
        out += 8 * cfg.dim / tp
        if is_moe_layer(cfg, layer):
            out += 4 * cfg.moe.top_k * cfg.dim
    return out


@dataclass
class _Stage:
    layers: range
    first: bool
    last: bool


def _stage_ids(lay: PlanLayout, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds."""
    d = lay.dims
    return stage_ids(pp_rank, d.pp, d.virtual_stages, stage_style(lay.schedule)) \
        if d.pp > 1 else [0]


def _stages(cfg, lay: PlanLayout, pp_rank: int) -> list[_Stage]:
    n = lay.dims.stages
    ranges = stage_layers(cfg.n_layers, n)
    return [_Stage(ranges[i], i == 0, i == n - 1) for i in _stage_ids(lay, pp_rank)]


def rank_memory(cfg, lay: PlanLayout, pp_rank: int = 0) -> Memory:
    """Peak bytes of one rank at pipeline position `pp_rank` (every dp/tp rank alike)."""
    cfg = shape_of(cfg)
    c = COMPUTE[lay.precision]
    tp, shard = lay.dims.tp, lay.shard
    stages = _stages(cfg, lay, pp_rank)
    # Parameters per rank before FSDP: (outside experts, experts), and per block for transients.
    dense = experts = root = 0.0
    blocks: list[float] = []
    first_moe = _first_moe(cfg)
    for st in stages:  # layers differ only in being MoE: count each kind
        moe = max(0, st.layers.stop - max(st.layers.start, first_moe))
        for count, i in ((len(st.layers) - moe, st.layers.start), (moe, first_moe)):
            if count:
                a, e = _layer_params(cfg, i, tp, lay.dims.ep)
                dense, experts = dense + count * a, experts + count * e
                blocks += [a + e] * min(count, 2)  # the two largest are all that is asked
        if st.first:
            root += cfg.vocab_size * cfg.dim / tp
        if st.last:
            root += cfg.vocab_size * cfg.dim / tp + cfg.dim
    dense += root
    local = dense + experts
    sharded = local / shard  # over the shard group, dp x cp (experts too)
    params = MASTER * sharded
    optimizer = OPTIM * sharded
    accumulate = lay.microbatches > 1 or lay.dims.pp > 1
    if shard > 1 and accumulate:  # unsharded, in compute, until the step's one reduce-scatter
        grads = c * local + (GRAD * sharded if c != GRAD else 0)
    else:
        grads = GRAD * sharded
    # Parameters gathered for compute.
    if shard > 1:
        if lay.keeps_gathered:
            gathered = c * local  # never resharded between forward and backward
        else:
            big = sorted(blocks, reverse=True)[:2]
            gathered = c * (root + sum(big)) - c * (root + sum(big)) / shard
            if not accumulate:  # a block's unsharded gradient before its reduce-scatter
                gathered += c * (big[0] if big else 0)
    else:
        gathered = c * local if c != MASTER else 0.0
    # Activations: each stage's per microbatch, times the microbatches held at the peak.
    tokens = lay.rank_tokens
    held = in_flight(lay.schedule, lay.dims.pp, lay.dims.virtual_stages,
                     lay.microbatches)[pp_rank] if lay.dims.pp > 1 else {0: 1.0}
    ids = _stage_ids(lay, pp_rank)
    kept = _per_layer(cfg, lay)
    acts = logits = 0.0
    layers = []  # this rank's layers in the order its forward runs them
    for sid, st in zip(ids, stages, strict=True):
        layers += list(st.layers)
        per_mb = sum(kept[i][0] for i in st.layers)
        if st.first:
            per_mb += cfg.dim / tp * c  # the embedding's output
        acts += held.get(sid, 0.0) * per_mb * tokens
        if lay.dims.pp > 1:
            # torch's PipelineStage allocates a receive buffer per microbatch, for the inputs
            # of every stage but the first and the gradients of every stage but the last.
            acts += (2 - st.first - st.last) * lay.microbatches * cfg.dim / tp * tokens * c
        if st.last:  # the head's input and the vocab-parallel loss's logits and softmax
            # (a pipeline computes the loss in the last stage's forward: the softmax of each
            # microbatch held stays too)
            logits = (cfg.dim / tp * c + LOSS * cfg.vocab_size / tp
                      + max(held.get(sid, 0.0) - 1, 0.0) * LOSS_HELD * cfg.vocab_size / tp
                      ) * tokens
            if lay.z_loss:  # float32 whatever the compute dtype (module text)
                logits += Z_LOSS * cfg.vocab_size / tp * tokens
    backward = (_recompute_extra(cfg, lay, layers) + 4 * cfg.dim / tp * c
                + context.transient_bytes(cfg, lay, c)) * tokens
    if layers and max(layers) >= first_moe:
        # an MoE layer's backward: the padded expert inputs' and hidden states' gradients
        backward += 2 * cfg.moe.top_k * (cfg.dim + cfg.moe.expert_ffn_dim) / tp * tokens * c
    if lay.dims.pp == 1 and not accumulate:
        # One microbatch: gradients appear as the backward frees activations, so the peak is
        # below the sum of both. Walk the backward block by block.
        grads, acts = _one_pass_peak(cfg, lay, stages[0], grads, acts, tokens)
    subtotal = params + grads + optimizer + acts + logits + gathered + backward
    return Memory(params, grads, optimizer, acts, logits, gathered, backward,
                  SLACK * subtotal, pp_rank)


def _recompute_extra(cfg, lay: PlanLayout, layers: list[int]) -> float:
    """Bytes per token that a recomputing block adds in backward, at the worst block.

    Backward runs from the top: when block i recomputes (what it did not keep: `none` minus
    what `mode` kept), the blocks above it have already freed theirs."""
    worst, above = 0.0, 0.0
    table = _per_layer(cfg, lay)
    for i in reversed(layers):
        kept, none = table[i]
        worst = max(worst, none - kept - above)
        above += kept
    return worst


def _one_pass_peak(cfg, lay, stage, grads, acts, tokens) -> tuple[float, float]:
    """(gradients, activations) at the worst moment of a single forward-backward: backward
    runs from the last block, freeing its activations as its gradients are made."""
    per_layer = [_per_layer(cfg, lay)[i][0] * tokens for i in stage.layers]
    grad_layer = [sum(_layer_params(cfg, i, lay.dims.tp, lay.dims.ep)) / lay.shard * GRAD
                  for i in stage.layers]
    head = grads - sum(grad_layer)  # embedding, head and final norm
    best = (grads, acts, -1.0)
    remaining, made = acts, head
    for i in reversed(range(len(per_layer))):
        if remaining + made > best[2]:
            best = (made, remaining, remaining + made)
        made += grad_layer[i]
        remaining -= per_layer[i]
    return best[0], best[1]


def peak_memory(cfg, lay: PlanLayout) -> Memory:
    """The largest rank's memory over the pipeline positions."""
    cfg = shape_of(cfg)
    return max((rank_memory(cfg, lay, r) for r in range(lay.dims.pp)), key=lambda m: m.total)
