"""What context parallelism (`parallel.cp`) costs a layout: its memory terms, its exchange,
and the degrees the search tries.

Pure arithmetic, as memory.py and steptime.py, following optimus/parallel/context_parallel.py
and ring_attention.py:

- every rank holds seq_len / cp positions of each sequence, so each per-token term of memory.py
  (activations, logits, backward) counts the rank's tokens: microbatch_size x seq_len / cp;
  FSDP2 shards the weights, their gradients and the optimizer state over dp x cp (the `shard`
  purpose of optimus/runtime/dims.py).
- `alltoall` gathers, for heads / cp of the local heads, q, k and v over the whole sequence
  (key/value heads that do not divide by cp are repeated to the query heads first); its
  attention keeps those gathered copies for backward instead of the local ones, as many
  elements, more where k and v were repeated (`saved_bytes`). One all-to-all of q, k, v and
  one of the output per layer forward, the same in backward: (q + k + v + out) local bytes x
  (cp - 1) / cp each way, not overlapped with compute (the attention waits for its inputs).
- `ring` (ring_attention.py) keeps what the device's attention would (q, k, v, the output, the
  log-sum-exp): nothing beyond memory.py's table. While a layer runs it holds the block in
  flight and, in backward, float32 gradient accumulators of q and of the k, v block, and one
  chunk pair's float32 scores, their softmax and its gradient: 3 x [chunk x chunk] per head,
  chunk = seq_len / (cp x 2) when balanced (`transient_bytes`; the math kernel holds them, the
  flash kernel the CPU runs in bf16 does not, and they are counted for both). The k, v block
  goes around the ring cp - 1 times per layer forward; backward sends it around again with its
  float32 gradient accumulator, and once more the accumulator alone. Each shift is priced as
  running under the attention of the block before it, so only what exceeds that attention shows
  (`exchange`): the ring's design. ring_attention.py waits for each shift before computing the
  block, so until it posts the next shift first, its whole exchange is exposed and `cp_hidden`
  is what that would win.
- the exchange runs on the intra-node link while cp x tp fits a node (cp is the mesh
  dimension just outside tp), else the inter-node one.
- the search tries cp > 1 only from `CP_FROM` positions: shorter sequences fit by the other
  degrees, and cp would only add an exchange.
"""

from __future__ import annotations

from optimus.planner.machines import Machine

CP_FROM = 16384  # sequences shorter than this are planned without context parallelism
FP32 = 4
PIECES = {"balanced": 2, "contiguous": 1}  # runs of positions a rank holds of a sequence


def _widths(cfg, tp: int, cp: int, method: str) -> tuple[float, float]:
    """(query, key) elements per local token as the method moves them: all-to-all repeats a
    key (or value) to the query heads where the key/value heads do not divide by cp; the ring
    sends them as they are."""
    hd = cfg.dim // cfg.n_heads
    q = cfg.n_heads * hd / tp
    kv = max(cfg.n_kv_heads * hd / tp, hd if tp > 1 else 0)
    kv_heads = kv / hd
    repeated = method == "alltoall" and kv_heads % cp
    return q, (q if repeated else kv)


def saved_bytes(cfg, lay, mode: str, c: int) -> float:
    """Bytes per local token one layer keeps for backward beyond memory.py's table, under
    recompute `mode`, `c` bytes an element of the compute dtype: the key and value heads
    all-to-all repeats (a block that recomputes fully keeps its input alone)."""
    cp, tp = lay.dims.cp, lay.dims.tp
    if cp == 1 or mode == "full":
        return 0.0
    k = _widths(cfg, tp, cp, lay.cp_method)[1]
    plain = _widths(cfg, tp, 1, "alltoall")[1]
    return 2 * (k - plain) * c


def transient_bytes(cfg, lay, c: int) -> float:
    """Bytes per local token of one layer's exchange buffers and working memory while it
    runs backward: all-to-all's packed send buffer and what arrives, of q, k, v; the ring's
    k, v block and the one arriving, their float32 gradient accumulators (two, the one in
    hand and the one arriving), the query's, and one chunk pair's float32 scores, softmax and
    gradient."""
    cp = lay.dims.cp
    if cp == 1:
        return 0.0
    q, k = _widths(cfg, lay.dims.tp, cp, lay.cp_method)
    if lay.cp_method == "alltoall":
        return 2 * (q + 2 * k) * c
    pieces = PIECES[lay.cp_split]
    chunk = lay.seq_len / (cp * pieces)
    pair = 3 * FP32 * cfg.n_heads / lay.dims.tp * chunk / pieces  # [chunk x chunk] per head
    return FP32 * q + 2 * 2 * k * c + 2 * 2 * k * FP32 + pair


def exchange(cfg, lay, machine: Machine, c: int, rate: float, recomputed: float
             ) -> tuple[float, float]:
    """(exposed, hidden) seconds of one rank's context-parallel exchange per microbatch and
    layer, `c` bytes an element of the compute dtype. `rate` is the FLOP/s the rank's compute
    runs at; `recomputed` the share of blocks whose forward runs again in backward (their
    exchange runs again too)."""
    cp, tp = lay.dims.cp, lay.dims.tp
    if cp == 1:
        return 0.0, 0.0
    link = machine.intra_gbps if cp * tp <= machine.devices_per_node else machine.inter_gbps
    link *= 1e9
    latency = machine.latency_us * 1e-6
    local = lay.microbatch_size * lay.seq_len / cp  # the rank's tokens of a microbatch
    q, k = _widths(cfg, tp, cp, lay.cp_method)
    passes = 2 + recomputed  # forward, backward, and the recomputed forward
    if lay.cp_method == "alltoall":
        one_way = local * (2 * q + 2 * k) * c * (cp - 1) / cp / link + 2 * latency
        return passes * one_way, 0.0
    forward = local * 2 * k * c / link + latency  # one shift of the k, v block
    backward = local * 2 * k * (c + FP32) / link + latency  # the block and its gradient
    # attention of one step (the queries against one rank's keys) at the price `compute` gives
    # it (steptime.py: the whole square): forward 2 matmuls of 2 FLOPs per multiply-add;
    # backward twice that
    attention = 4 * local * q * (lay.seq_len / cp) / rate
    shown = (cp - 1) * ((1 + recomputed) * max(0.0, forward - attention)
                        + max(0.0, backward - 2 * attention))
    shown += local * 2 * k * FP32 / link + latency  # the last shift: the gradients home
    total = (cp - 1) * ((1 + recomputed) * forward + backward) + local * 2 * k * FP32 / link \
        + latency
    return shown, total - shown


def context_degrees(job, tp: int, most: int) -> list[tuple[int, str]]:
    """(cp, method) pairs the search tries with tensor parallel degree `tp`, up to `most`
    ranks: cp 1, and from `CP_FROM` positions the powers of two that
    optimus/config/context_rules.py accepts (the sequence splits into the job's
    `cp_split` chunks, each rank's slice over tp; all-to-all needs the local query heads to
    divide by cp)."""
    out = [(1, job.parallel.cp_method)]
    seq = job.data.seq_len
    if seq < CP_FROM:
        return out
    cp = 2
    while cp <= most:
        chunks = 2 * cp if job.parallel.cp_split == "balanced" else cp
        if seq % chunks or (seq // cp) % tp:
            break
        if (job.model.n_heads // tp) % cp == 0:
            out.append((cp, "alltoall"))
        out.append((cp, "ring"))
        cp *= 2
    return out
