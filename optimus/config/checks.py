"""Checks across fields, and the layout a job gets on a given world size.

Each check names the key to change and a value that would work, so a refused job can be
mended without reading code. All of it runs before any process starts.
"""

from __future__ import annotations

from optimus.config.context_rules import context_problems
from optimus.config.schedule_rules import schedule_problem
from optimus.config.schema import JobConfig
from optimus.runtime.dims import ParallelDims


class ConfigError(ValueError):
    """A job the user must change: one or more (key, what is wrong, how to fix it)."""

    def __init__(self, source: str, what: str = "", fix: str = "",
                 problems: list[tuple[str, str, str]] | None = None):
        self.source = source
        self.problems = problems if problems is not None else [("", what, fix)]
        super().__init__(str(self))

    def __str__(self) -> str:
        lines = []
        for key, what, fix in self.problems:
            head = f"{key}: " if key else ""
            lines.append(f"{head}{what}" + (f" — fix: {fix}" if fix else ""))
        if len(lines) == 1:
            return f"{self.source}: {lines[0]}"
        return f"{self.source}: {len(lines)} problems\n" + "\n".join(f"  {s}" for s in lines)


# training.float8_experts: the multiple its kernels need of the experts' dims, and to which
# each expert's rows are padded: 16 for rowwise float8 GEMMs, the 32-value block of mxfp8.
FLOAT8_EXPERTS_MULTIPLE = {"rowwise": 16, "mxfp8": 32}


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _job_problems(job: JobConfig) -> list[tuple[str, str, str]]:
    """What is wrong whatever the world and the layout resolved on it."""
    m, p, d, o = job.model, job.parallel, job.data, job.optim
    out = []
    if m.dim % m.n_heads:
        out.append(("model.n_heads", f"dim={m.dim} is not divisible by n_heads={m.n_heads}",
                    f"use n_heads among {_divisors(m.dim)}"))
    elif m.head_dim % 2:
        out.append(("model.dim", f"head dim {m.head_dim} (dim / n_heads) is odd; RoPE rotates "
                    "pairs", "make dim / n_heads even"))
    if m.n_heads % m.n_kv_heads:
        out.append(("model.n_kv_heads", f"n_heads={m.n_heads} is not a multiple of "
                    f"n_kv_heads={m.n_kv_heads}", f"use n_kv_heads among {_divisors(m.n_heads)}"))
    moe = m.moe
    if moe.experts:
        if moe.top_k > moe.experts:
            out.append(("model.moe.top_k", f"{moe.top_k} is more than experts={moe.experts}",
                        f"use top_k <= {moe.experts}"))
        if moe.dense_layers >= m.n_layers:
            out.append(("model.moe.dense_layers", f"{moe.dense_layers} leaves no MoE layer of "
                        f"n_layers={m.n_layers}", f"use dense_layers < {m.n_layers}, or "
                        "experts: 0 for a dense model"))
        if moe.experts % p.ep:
            out.append(("parallel.ep", f"{moe.experts} experts do not split over ep={p.ep}",
                        f"use ep among {_divisors(moe.experts)}"))
    elif p.ep > 1:
        out.append(("parallel.ep", f"ep={p.ep} needs experts to shard",
                    "set model.moe.experts, or ep: 1"))
    if moe.router_z_loss and not moe.experts:
        out.append(("model.moe.router_z_loss", f"{moe.router_z_loss} is set on a dense model: "
                    "it is a loss on the MoE layers' routers", "set model.moe.experts, or "
                    "remove router_z_loss (optim.z_loss is the output logits' z-loss)"))
    if job.training.float8 != "off" and p.tp > 1:
        out.append(("training.float8", f"{job.training.float8} float8 with tensor parallel "
                    f"(tp={p.tp}) is not supported: the tp plan's sequence-parallel inputs and "
                    "its kv-head copies have no float8 counterpart here",
                    "set parallel.tp: 1 (shard with dp instead), or training.float8: off"))
    out += _float8_experts_problems(job)
    if d.seq_len > m.max_seq_len:
        out.append(("data.seq_len", f"{d.seq_len} is longer than model.max_seq_len="
                    f"{m.max_seq_len}", f"use seq_len <= {m.max_seq_len}"))
    if d.source == "shards" and not d.path and not d.sources:
        out.append(("data.path", "source `shards` needs the directory of token shards",
                    "run `optimus data prepare` and set data.path to its --out (or "
                    "data.sources to several, with weights)"))
    for key, value in (("data.path", d.path), ("data.sources", d.sources)):
        if d.source == "synthetic" and value:
            out.append((key, "is only read when data.source is `shards`",
                        f"remove {key} or set data.source: shards"))
    if d.path and d.sources:
        out.append(("data.sources", "is set together with data.path",
                    "keep data.path for one prepared folder, or data.sources for a mixture"))
    if d.sources is not None:
        paths = [s.path for s in d.sources]
        if not paths:
            out.append(("data.sources", "is an empty list",
                        "name at least one {path, weight}, or remove it"))
        elif len(set(paths)) < len(paths):
            twice = sorted({p for p in paths if paths.count(p) > 1})
            out.append(("data.sources", f"names {', '.join(twice)} more than once",
                        "list each folder once, with the sum of its weights"))
    if job.eval.every and not job.eval.path and d.source != "synthetic":
        out.append(("eval.path", "validation (eval.every > 0) on prepared data needs held-out "
                    "tokens", "set eval.path to the holdout/ folder `optimus data prepare "
                    "--holdout` wrote (or another prepared folder), or eval.every: 0"))
    if job.eval.path and not job.eval.every:
        out.append(("eval.path", "is only read when eval.every > 0",
                    "set eval.every (steps between validations) or remove eval.path"))
    if d.batch_size % d.microbatches:
        out.append(("data.batch_size", f"{d.batch_size} is not divisible by microbatches="
                    f"{d.microbatches}", "make batch_size a multiple of microbatches"))
    if o.warmup_steps > o.steps:
        out.append(("optim.warmup_steps", f"{o.warmup_steps} is more than steps={o.steps}",
                    f"use warmup_steps <= {o.steps}"))
    if o.min_lr > o.lr:
        out.append(("optim.min_lr", f"{o.min_lr} is above lr={o.lr}", f"use min_lr <= {o.lr}"))
    st, ck = job.stability, job.checkpoint
    rewinds = [k for k in ("on_spike", "on_divergence") if getattr(st, k) == "rewind"]
    if rewinds and st.enabled and not ck.interval and ck.memory_every in (0, "0"):
        out.append((f"stability.{rewinds[0]}", "rewind goes back to a checkpoint or memory "
                    "snapshot, and this job keeps neither: every rewind would start from scratch",
                    "set checkpoint.interval (or checkpoint.memory_every), or on_spike: "
                    "skip_step"))
    sv = job.supervision
    if sv.when_no_spare == "wait" and sv.min_nodes is not None:
        out.append(("supervision.min_nodes", f"{sv.min_nodes} is a floor for shrinking, and "
                    "when_no_spare: wait never shrinks", "drop min_nodes, or when_no_spare: "
                    "shrink"))
    if sv.on_replica_loss == "continue" and job.parallel.replicas < 2:
        out.append(("supervision.on_replica_loss", "continue lets the other data-parallel "
                    f"replicas train on when one is lost, and parallel.replicas is "
                    f"{job.parallel.replicas}: there is no other", "set parallel.replicas >= 2 "
                    "(dp = replicas x shard), or on_replica_loss: restart"))
    elif sv.on_replica_loss == "continue" and sv.min_replicas > job.parallel.replicas:
        out.append(("supervision.min_replicas", f"{sv.min_replicas} is more than "
                    f"parallel.replicas={job.parallel.replicas}: every loss would restart",
                    f"use min_replicas <= {job.parallel.replicas}"))
    for key, template, names in (("run_dir", job.run_dir, {"name"}),
                                 ("checkpoint.dir", job.checkpoint.dir, {"name", "run_dir"})):
        try:
            template.format(**{n: "" for n in names})
        except (KeyError, IndexError, ValueError):
            out.append((key, f"{template!r} has a placeholder other than "
                        f"{', '.join('{' + n + '}' for n in sorted(names))}",
                        "use only those, or none"))
    return out


def _float8_experts_problems(job: JobConfig) -> list[tuple[str, str, str]]:
    """training.float8_experts against the model: experts to convert, and dims its kernels
    take. Whether the device can run it is asked on the machine, before any rank starts
    (optimus/parallel/float8.py `check_float8_here`)."""
    recipe, m = job.training.float8_experts, job.model
    if recipe == "off":
        return []
    off = "set training.float8_experts: off"
    if not m.moe.experts:
        return [("training.float8_experts", f"{recipe} needs model.moe.experts > 0: a dense "
                 "model has no grouped experts (training.float8 converts its linears)", off)]
    multiple = FLOAT8_EXPERTS_MULTIPLE[recipe]
    dims = {"model.dim": m.dim, "model.moe.expert_ffn_dim": m.moe.expert_ffn_dim}
    odd = [f"{key}={value}" for key, value in dims.items() if value % multiple]
    if odd:
        return [("training.float8_experts", f"{recipe} float8 grouped GEMMs need the experts' "
                 f"dims in multiples of {multiple}, not {' and '.join(odd)}",
                 f"use multiples of {multiple}, or {off}")]
    return []


def _fit(job: JobConfig, world: int) -> tuple[int | None, list[tuple[str, str, str]]]:
    """The data-parallel degree on `world` ranks, or why dp x tp x pp (x cp) cannot make
    `world`."""
    p = job.parallel
    cells = p.tp * p.pp * p.cp
    names = "tp x pp" + (" x cp" if p.cp > 1 else "")
    degrees = f"{p.tp} x {p.pp}" + (f" x {p.cp}" if p.cp > 1 else "")
    if p.dp == -1:
        if world % cells:
            return None, [("parallel", f"{names} = {degrees} = {cells} does not divide "
                           f"the world size {world}", f"use {names} among {_divisors(world)}")]
        dp = world // cells
    elif p.dp * cells != world:
        return None, [("parallel.dp", f"dp x {names} = {p.dp} x {degrees} = "
                       f"{p.dp * cells} but the world has {world} ranks",
                       f"set parallel.dp to {world // cells}" if world % cells == 0
                       else f"set parallel.dp: -1 and pick {names} dividing the world")]
    else:
        dp = p.dp
    return dp, []


def _layout_problems(job: JobConfig, dp: int) -> list[tuple[str, str, str]]:
    """What is wrong with a layout that fits its world (the job's degrees, `dp` resolved):
    the model and the batch against it."""
    m, d, p = job.model, job.data, job.parallel
    tp, pp, ep, virtual_stages = p.tp, p.pp, p.ep, p.virtual_stages
    world = dp * tp * pp * p.cp
    out = []
    if m.n_heads % tp:
        out.append(("parallel.tp", f"n_heads={m.n_heads} is not divisible by tp={tp}",
                    f"use tp among {_divisors(m.n_heads)}"))
    elif m.n_kv_heads % tp and tp % m.n_kv_heads:
        out.append(("parallel.tp", f"n_kv_heads={m.n_kv_heads} neither splits over tp={tp} "
                    "nor replicates evenly across it", "use a tp that divides n_kv_heads or "
                    f"is a multiple of it, e.g. {_divisors(m.n_kv_heads)}"))
    if m.ffn_dim % tp:
        out.append(("parallel.tp", f"ffn_dim={m.ffn_dim} is not divisible by tp={tp}",
                    f"use tp among {_divisors(m.ffn_dim)}"))
    if m.vocab_size % tp:
        padded = -(-m.vocab_size // tp) * tp
        out.append(("model.vocab_size", f"{m.vocab_size} does not split over tp={tp} "
                    "(the embedding and the loss are vocab-parallel)",
                    f"pad it to {padded}; ids past the tokenizer's are never used"))
    stages = pp * virtual_stages
    if m.n_layers < stages:
        out.append(("parallel.pp", f"{m.n_layers} layers cannot fill pp x virtual_stages = "
                    f"{stages} pipeline stages", f"use at most {m.n_layers} stages in all, or "
                    "more layers"))
    if d.seq_len % tp:
        out.append(("data.seq_len", f"{d.seq_len} does not split over tp={tp} (sequence "
                    "parallel gives each tp rank an equal slice of the sequence)",
                    f"use a multiple of {tp}"))
    if pp == 1 and virtual_stages > 1:
        out.append(("parallel.virtual_stages", f"{virtual_stages} needs a pipeline",
                    "set parallel.pp > 1, or virtual_stages: 1"))
    elif pp > 1:
        problem = schedule_problem(p.schedule, pp, virtual_stages, d.microbatches)
        if problem:
            out.append(("parallel.schedule", *problem))
    if dp % p.replicas:
        out.append(("parallel.replicas", f"{p.replicas} does not divide dp={dp}: each replica "
                    "holds dp / replicas ranks", f"use replicas among {_divisors(dp)}"))
    shard = max(1, dp // p.replicas)  # a replica's data-parallel ranks, experts borrow from
    of = f"dp={dp}" if p.replicas == 1 else f"a replica's dp (dp / replicas)={shard}"
    if p.cp > 1:
        out += context_problems(job)
    elif shard % ep:
        out.append(("parallel.ep", f"ep={ep} does not divide {of}; experts borrow "
                    "their ranks from dp", f"use ep among {_divisors(shard)}"))
    if p.cp > 1 and ep > 1 and not ep % p.cp and shard % (ep // p.cp):
        out.append(("parallel.ep", f"ep={ep} takes ep / cp = {ep // p.cp} data-parallel "
                    f"ranks, which does not divide {of}", "use ep among "
                    + ", ".join(str(n * p.cp) for n in range(1, shard + 1) if shard % n == 0)))
    per_step = d.microbatches * dp
    if d.batch_size % per_step:
        nearest = max(per_step, round(d.batch_size / per_step) * per_step)
        out.append(("data.batch_size", f"{d.batch_size} is not divisible by microbatches x dp"
                    f" = {d.microbatches} x {dp} = {per_step}", f"use a multiple of {per_step}"
                    f", e.g. {nearest}"))
    for i, fault in enumerate(job.fault_injection.faults):
        if fault.rank is not None and fault.rank >= world:
            out.append((f"fault_injection.faults.{i}.rank", f"rank {fault.rank} does not "
                        f"exist in a world of {world}", f"use a rank below {world}"))
    return out


def check_job(job: JobConfig, world: int | None = None,
              source: str = "job") -> ParallelDims | None:
    """Raise ConfigError listing every problem; return the layout when `world` is given.

    The layout's fit to the world is named first, and what depends on the layout (heads and
    the vocabulary over tp, layers over pp, ep over dp, the batch over dp) is checked only once
    it fits: a fix of the fit changes those degrees. Without a world, only what holds on every
    world is checked; the layout waits for the world it runs on.
    """
    problems, dp = [], None
    if world is not None:
        dp, problems = _fit(job, world)
    problems += _job_problems(job)
    if dp is not None:
        problems += _layout_problems(job, dp)
    if problems:
        raise ConfigError(source, problems=problems)
    return None if dp is None else ParallelDims.of(job.parallel, dp=dp)


def check_replica_nodes(job: JobConfig, nodes: int, source: str = "job") -> None:
    """Replicas that carry on are launched a world each on nodes of their own: the node count
    must split into them (ConfigError if not)."""
    replicas = job.parallel.replicas
    if job.supervision.on_replica_loss == "continue" and nodes % replicas:
        raise ConfigError(source, problems=[(
            "supervision.on_replica_loss", f"continue runs each of parallel.replicas="
            f"{replicas} replicas on nodes of its own, and {nodes} nodes do not split into "
            f"{replicas}", f"use a node count that is a multiple of {replicas}")])


def resolve_layout(job: JobConfig, world: int, source: str = "job") -> ParallelDims:
    """The layout `job` runs on a world of `world` ranks (ConfigError if none)."""
    layout = check_job(job, world=world, source=source)
    assert layout is not None
    return layout
