"""The job file's typed sections.

Every field a job can set lives here, with its type, default and range. Checks that need
more than one field (a layout against a world size, heads against tp) live in `checks.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optimus.contract import chaos

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]


class Section(BaseModel):
    # strict: a job file that says `n_layers: "4"` or `lr: true` is refused rather than coerced.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class MoEConfig(Section):
    """Mixture of experts in the feed-forward of every layer past `dense_layers`."""

    experts: NonNegativeInt = Field(0, description="routed experts per MoE layer; 0: dense")
    top_k: PositiveInt = Field(2, description="experts each token is sent to")
    score: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="router scores; sigmoid weights are renormalised over the top k")
    shared_experts: NonNegativeInt = Field(
        0, description="experts every token also goes through (one SwiGLU this many wide)")
    expert_ffn_dim: PositiveInt | None = Field(None, description="None: model.ffn_dim")
    capacity_factor: PositiveFloat | None = Field(
        None, description="None: dropless; else each expert takes at most "
                          "ceil(factor x tokens x top_k / experts) tokens, the rest are dropped")
    balance: Literal["aux_loss", "bias", "none"] = Field(
        "aux_loss", description="aux_loss: a load-balancing loss; bias: loss-free, a per-expert "
                                "bias on the routing scores follows the load")
    aux_loss_coeff: NonNegativeFloat = 0.01
    aux_loss_scope: Literal["global", "sequence"] = Field(
        "global", description="aux_loss: the slot fractions of the step's global batch (all "
                              "ranks, the microbatches so far), or of each sequence alone")
    bias_update_rate: NonNegativeFloat = Field(
        1e-3, description="bias: the step by which an under- or over-loaded expert's bias moves")
    dense_layers: NonNegativeInt = Field(0, description="the first k layers stay dense")
    router_z_loss: NonNegativeFloat = Field(
        0.0, description="ST-MoE's router z-loss: this x the mean over tokens of "
                         "logsumexp(router logits)^2, added to the loss's gradient; 0: off")


class ModelConfig(Section):
    vocab_size: Annotated[int, Field(ge=2)] = 257
    dim: Annotated[int, Field(ge=8)] = 256
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    n_kv_heads: PositiveInt | None = Field(None, description="None: as many as n_heads")
    ffn_dim: PositiveInt | None = Field(None, description="None: Llama's 8/3 x dim rule")
    ffn_multiple_of: PositiveInt = 64
    max_seq_len: PositiveInt = 2048
    rope_theta: PositiveFloat = 10000.0
    norm_eps: PositiveFloat = 1e-5
    init_std: PositiveFloat = 0.02
    qk_norm: bool = Field(
        False, description="RMSNorm on each head's queries and keys before RoPE (as Qwen3 "
                           "does): one learnt weight of head_dim for q, one for k, shared by "
                           "every head")
    moe: MoEConfig = Field(default_factory=MoEConfig)
    init_from: Annotated[str, Field(pattern=r"^hf:.+")] | None = Field(
        None, description='"hf:DIR": start from the Hugging Face model in DIR (its config.json '
                          "must match this model); ignored when the run resumes a checkpoint")

    @model_validator(mode="after")
    def _resolve(self) -> ModelConfig:
        # Filled in place so the model code always sees plain integers.
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.ffn_dim is None:
            hidden = int(2 * 4 * self.dim / 3)
            m = self.ffn_multiple_of
            object.__setattr__(self, "ffn_dim", m * ((hidden + m - 1) // m))
        if self.moe.expert_ffn_dim is None:
            object.__setattr__(self.moe, "expert_ffn_dim", self.ffn_dim)
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class ParallelConfig(Section):
    dp: Annotated[int, Field(ge=-1)] = Field(-1, description="-1: whatever the world leaves")
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    ep: PositiveInt = Field(1, description="expert parallel; borrows its ranks from dp")
    virtual_stages: PositiveInt = Field(1, description="model chunks per pipeline rank")
    cp: PositiveInt = Field(1, description="context parallel: each sequence split over cp ranks")
    replicas: PositiveInt = Field(
        1, description="HSDP: dp is replicas x shard; each replica shards the model over its "
                       "dp / replicas ranks (FSDP2), the gradients are all-reduced across "
                       "replicas")
    cp_method: Literal["alltoall", "ring"] = Field(
        "alltoall", description="how attention spans the context-parallel group: alltoall "
                                "trades sequence for heads and back around the device's own "
                                "attention kernel (heads must divide by cp); ring passes key "
                                "and value blocks around the group (any head count)")
    cp_split: Literal["balanced", "contiguous"] = Field(
        "balanced", description="balanced: each rank holds a chunk from the head and one from "
                                "the tail of every sequence (even causal-attention work; the "
                                "sequence divides by 2 x cp); contiguous: one run of positions")
    schedule: Literal[
        "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
        "zbv_zero_bubble", "dualpipev",
    ] = "1f1b"
    activation_checkpoint: Literal["none", "full", "selective", "op"] = Field(
        "none", description="full: recompute every block; selective: every ac_every-th block; "
                            "op: every block keeps its matmul and attention outputs and "
                            "recomputes only the element-wise ops")
    ac_every: PositiveInt = Field(2, description="selective: checkpoint every n-th block")
    param_gather: Literal["microbatch", "step"] = Field(
        "microbatch", description="microbatch: FSDP2 all-gathers each block's parameters for "
                                  "every microbatch's forward and again for its backward "
                                  "(ZeRO-3, the least memory); step: once a step, kept "
                                  "gathered through the step's microbatches (more memory, "
                                  "one all-gather a step)")
    device: Literal["auto", "cpu", "cuda", "xpu"] = "auto"
    backend: Literal["auto", "gloo", "nccl", "xccl", "ccl"] = "auto"


class TrainingConfig(Section):
    """How a step computes: its precision, compilation and float8 matmuls."""

    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto: bf16 on cuda and xpu, fp32 on cpu; bf16: parameters cast to "
                            "bf16 for compute and all-gather, gradients reduced in fp32, fp32 "
                            "master weights and optimizer state (any device: the cpu then runs "
                            "the accelerators' path)")
    compile: bool = Field(
        False, description="torch.compile each transformer block and the loss on its own")
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="inductor: generated kernels (the fast one); aot_eager and "
                                "eager trace without generating code, to tell a tracing "
                                "problem from a code-generation one")
    float8: Literal["off", "tensorwise", "rowwise"] = Field(
        "off", description="float8 matmuls in the blocks' linear layers (torchao): tensorwise "
                           "or rowwise scales; needs a device with float8 matmuls")
    float8_min_dim: int = Field(
        1024, ge=16, multiple_of=16,
        description="under float8, a block linear narrower than this on either side stays in "
                    "high precision (its scaling and casting would cost more than its faster "
                    "matmul saves); where float8 starts to pay depends on the device")
    float8_experts: Literal["off", "rowwise", "mxfp8"] = Field(
        "off", description="float8 grouped GEMMs in the MoE layers' experts (torchao): rowwise "
                           "scales (CUDA 9.0+: H100, H200) or mxfp8, one scale per 32 values "
                           "(CUDA 10.0: B200); off: bf16, the reference")

    @property
    def float8_asked(self) -> bool:
        """Whether the job asks for any float8 (its device is then checked before ranks start)."""
        return self.float8 != "off" or self.float8_experts != "off"


class OptimConfig(Section):
    steps: PositiveInt = 100
    lr: PositiveFloat = 3e-4
    min_lr: Annotated[float, Field(ge=0)] = 3e-5
    warmup_steps: NonNegativeInt = 10
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: PositiveFloat = 1e-8
    grad_clip: Annotated[float, Field(ge=0)] = Field(1.0, description="0: no clipping")
    fused: bool | None = Field(None, description="None: fused where the device has it")
    z_loss: NonNegativeFloat = Field(
        0.0, description="PaLM's z-loss: this x log(Z)^2 per labelled token (log Z: the "
                         "logsumexp of the output logits), normalised as the cross-entropy; "
                         "in the gradient, not in the logged loss; 0: off")


class DataSource(Section):
    """One prepared folder of a mixture, and its share of the samples."""

    path: str = Field(description="a folder written by `optimus data prepare`")
    weight: PositiveFloat = Field(1.0, description="relative: shares are weight / sum")


class DataConfig(Section):
    source: Literal["synthetic", "shards"] = "synthetic"
    path: str | None = Field(None, description="token shards from `optimus data prepare`")
    sources: list[DataSource] | None = Field(
        None, description="shards: a weighted mixture of prepared folders, instead of path")
    seq_len: PositiveInt = 256
    batch_size: PositiveInt = Field(8, description="sequences per optimizer step, all ranks")
    microbatches: PositiveInt = Field(1, description="per step and data-parallel replica")
    num_workers: NonNegativeInt = 0
    prefetch_factor: PositiveInt = 2


class EvalConfig(Section):
    """Validation: the loss on held-out tokens, every `every` steps and after the last."""

    every: NonNegativeInt = Field(
        0, description="steps between validations (and after the last step); 0: none")
    batches: PositiveInt = Field(
        4, description="global batches of data.batch_size sequences of data.seq_len tokens: "
                       "the same held-out windows at every validation, whatever the layout")
    path: str | None = Field(
        None, description="prepared held-out tokens (the holdout/ folder `optimus data "
                          "prepare --holdout` writes, or any prepared folder); None: with "
                          "synthetic data, documents the training stream never reaches; with "
                          "shards it must be set")


class CheckpointConfig(Section):
    dir: str = Field("{run_dir}/checkpoints", description="{run_dir} and {name} expand")
    interval: NonNegativeInt = Field(0, description="steps between saves; 0: never")
    keep_last: PositiveInt = 3
    keep_every: NonNegativeInt = Field(0, description="also keep every N-th step; 0: none")
    async_mode: Literal["process", "thread", "sync"] = Field(
        "process", description="where the background write runs; sync blocks")
    on_overlap: Literal["skip", "wait"] = Field(
        "skip", description="a save due while one is in flight is skipped, or waits")
    resume: Literal["auto", "never"] = Field(
        "auto", description="auto: continue from the latest good checkpoint in dir")
    verify_on_load: bool = Field(True, description="check every file's sha256 before loading")
    trust_step: NonNegativeInt | None = Field(
        None, description="resume from this step's checkpoint in dir even if this run's key "
                          "does not authenticate it (another run's, or one from before "
                          "checkpoints were signed); None: only the run's own")
    max_failed_saves: NonNegativeInt = Field(
        3, description="stop training after this many failed saves in a row; 0: never")
    memory_every: NonNegativeInt | Literal["auto"] = Field(
        "auto", description="steps between in-memory snapshots under an agent (host memory "
                            "on the node, replicated to a buddy node); auto: as often as "
                            "they cost <= 2% of the step time, measured; 0: none")


class SupervisionConfig(Section):
    log_every: PositiveInt = 1
    peak_tflops: PositiveFloat | None = Field(None, description="override the device table")
    heartbeat_interval_s: PositiveFloat = Field(
        1.0, description="ranks -> agent, and agent -> Redis, once per interval")
    heartbeat_timeout_s: PositiveFloat = Field(
        30.0, description="a rank (or an agent) silent this long is declared lost")
    startup_timeout_s: PositiveFloat = Field(
        300.0, description="from spawn to a rank's first heartbeat")
    max_restarts: NonNegativeInt = Field(10, description="then the job is FAILED")
    restart: Literal["in_process", "process"] = Field(
        "in_process", description="in_process: a rank a fault did not touch stays for the "
        "next generation (optimus/supervision/inprocess.py); process: every rank restarts as a "
        "new one")
    restart_backoff_s: NonNegativeFloat = Field(
        1.0, description="wait before restart n: this x 2^(n-1), capped")
    restart_backoff_max_s: NonNegativeFloat = 60.0
    failure_grace_s: NonNegativeFloat = Field(
        3.0, description="SIGTERM -> SIGKILL for the ranks of a failed generation")
    stop_grace_s: PositiveFloat = Field(
        120.0, description="SIGTERM -> SIGKILL on an operator's stop: time to save")
    hang_timeout_s: PositiveFloat = Field(
        600.0, description="T: the hang bound of what has no history yet (a generation's "
                           "first hang_history timed steps: compiles) and of steps that save "
                           "a checkpoint or evaluate: no step anywhere for max(T, k x p99 "
                           "step time)")
    hang_floor_s: PositiveFloat = Field(
        30.0, description="once a generation has hang_history timed steps, no step anywhere "
                          "for max(this, k x p99 step time) is a hang")
    hang_step_factor: PositiveFloat = Field(10.0, description="k of the hang rule")
    hang_history: PositiveInt = Field(
        8, description="timed steps (heartbeat samples) of a generation before its hang "
                       "bound adapts to its step times")
    straggler_factor: float = Field(
        2.0, gt=1.0, description="a node whose compute time per step exceeds this x the "
                                 "median of the others is a straggler")
    straggler_window: PositiveInt = Field(
        20, description="W: steps (sampled by heartbeats) the straggler median covers")
    straggler_action: Literal["report", "exclude"] = "report"
    flaky_failures: PositiveInt = Field(
        1, description="attributed failures within flaky_window_s that exclude a node")
    flaky_window_s: PositiveFloat = 3600.0
    lost_limit: PositiveInt = Field(
        3, description="a node excluded as lost (its agent went silent) goes back to the spares "
                       "once its agent beats again with no rank running and it passed a health "
                       "check since, unless it was lost this many times within lost_window_s: "
                       "then it stays excluded (1: every lost node stays out)")
    lost_window_s: PositiveFloat = 3600.0
    when_no_spare: Literal["shrink", "wait"] = Field(
        "shrink", description="a node lost and no spare left: shrink: go on on the nodes left "
                              "(down to min_nodes), on the job's layout with a smaller dp or "
                              "the planner's best layout there, and grow back when nodes "
                              "return; wait: wait for a node")
    min_nodes: PositiveInt | None = Field(
        None, description="the fewest nodes a shrunk job runs on; None: half of --nodes, "
                          "rounded up")
    on_replica_loss: Literal["restart", "continue"] = Field(
        "restart", description="a rank lost (dead, hung, its node gone): restart: every rank "
                               "starts a new generation; continue: only its data-parallel "
                               "replica (parallel.replicas) leaves, the others train on at a "
                               "smaller global batch, and it comes back healed from a peer "
                               "(docs/parallelism.md, \"Replicas that carry on\")")
    min_replicas: PositiveInt = Field(
        1, description="with on_replica_loss: continue, the fewest replicas that train on; "
                       "below it a loss restarts the job as under restart")


class NetworkConfig(Section):
    """The ranks' network (optimus/runtime/network.py; docs/deploy.md, "The network")."""

    interface: str | None = Field(
        None, description="the interface the ranks' collectives use (gloo, NCCL, oneCCL, "
                          "libfabric TCP), e.g. hsn0 or ib0; None: each library's own choice. "
                          "A node whose environment already names one keeps its own")
    env: dict[str, str] = Field(
        default_factory=dict, description="more variables for the ranks' collectives "
                                          "(CCL_*, FI_*, NCCL_*); the rank's own environment wins")

    @model_validator(mode="after")
    def _names(self) -> NetworkConfig:
        from optimus.runtime.network import INTERFACE, env_problem

        if self.interface is not None and not INTERFACE.match(self.interface):
            raise ValueError(f"interface {self.interface[:40]!r} is not an interface name "
                             "(up to 15 letters, digits, '_', '.', '-'): give one that "
                             "`ip link` lists, e.g. hsn0")
        for name, value in self.env.items():
            problem = env_problem(name)
            if problem:
                raise ValueError(f"env: {name[:64]!r} is {problem}")
            if len(value) > 4096 or "\0" in value:
                raise ValueError(f"env: {name}'s value is longer than 4096 characters or "
                                 "holds a NUL byte")
        return self


class MonitoringConfig(Section):
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        9780, description="the controller's Prometheus /metrics port; 0: off")
    metrics_host: str = Field("0.0.0.0", description="the address /metrics listens on")
    linger_s: NonNegativeFloat = Field(
        30.0, description="with --exit-when-done, keep serving /metrics this long after the "
                          "job ended, so that Prometheus scrapes its final state")


class StabilityConfig(Section):
    """Loss spikes and divergence: rules over the global loss and gradient norm every rank
    holds, and what the ranks do (optimus/stability.py; docs/operations.md, "Loss spikes")."""

    enabled: bool = True
    window: Annotated[int, Field(ge=4)] = Field(
        50, description="trailing steps the rules compare a step with")
    warmup_steps: NonNegativeInt = Field(
        100, description="steps of a run's history before any rule applies")
    loss_sigma: NonNegativeFloat = Field(
        6.0, description="a spike: loss > mean + this x std of the window (0: off)")
    loss_min_rise: NonNegativeFloat = Field(
        0.1, description="... and at least this fraction of the mean above it")
    grad_ratio: NonNegativeFloat = Field(
        0.0, description="a spike: grad norm > this x the window's median (0: off; the clip "
                         "bounds such a step's update already)")
    divergence_windows: NonNegativeInt = Field(
        4, description="divergence: this many whole windows in a row, each with a higher mean "
                       "loss than the one before (0: off)")
    divergence_min_rise: NonNegativeFloat = Field(
        0.05, description="... rising by at least this fraction of the first one's mean")
    max_skips: PositiveInt = Field(
        5, description="spikes in a row before they count as divergence (a new level)")
    on_spike: Literal["warn", "skip_step", "rewind"] = Field(
        "skip_step", description="warn: an event, training goes on; skip_step: the step's "
                                 "update is not applied, its samples recorded as skipped; "
                                 "rewind: the controller resumes from before the spike and "
                                 "skips its window of batches (optimus run only)")
    on_divergence: Literal["warn", "rewind"] = Field(
        "warn", description="warn: an event; rewind: as on_spike, from before the rise began")
    rewind_skip_before: NonNegativeInt = Field(
        0, description="a rewind skips the batches of the spike's step and of this many steps "
                       "before it ...")
    rewind_skip_after: NonNegativeInt = Field(0, description="... and this many after it")
    rewind_back: NonNegativeInt = Field(
        0, description="a rewind resumes from a point at least this many steps before the "
                       "skipped window (0: the newest one before it)")
    rewind_budget: NonNegativeInt = Field(
        3, description="the controller's rewinds within rewind_budget_steps steps; one more "
                       "pauses the job for an operator (0: every rewind pauses)")
    rewind_budget_steps: PositiveInt = Field(1000, description="... steps the budget spans")
    rewind_lr_factor: Annotated[float, Field(gt=0, le=1)] = Field(
        1.0, description="after a rewind, the learning rate times this ...")
    rewind_lr_steps: NonNegativeInt = Field(
        0, description="... for this many steps from the skipped window's first")


class Fault(Section):
    kind: Literal[chaos.JOB_FILE]  # the contract's kinds that a job file may plan
    step: NonNegativeInt
    rank: NonNegativeInt | None = None
    node: NonNegativeInt | None = None
    generation: NonNegativeInt = Field(0, description="fires only in this generation")
    seconds: NonNegativeFloat = Field(
        0.0, description="stall_rank: the sleep before the gradient reduction; slow_rank: "
                         "the extra time per step from `step` on")
    deaf: bool = Field(
        False, description="hang_rank: the rank also ignores SIGUSR1, as one stuck in the "
                           "kernel runs no signal handler: only py-spy, from outside, reads "
                           "its stack")

    @model_validator(mode="after")
    def _target(self) -> Fault:
        if self.kind == chaos.SPIKE:  # the whole step's batch: every rank poisons its share
            if self.rank is not None or self.node is not None:
                raise ValueError("a spike fault poisons the whole step's batch: give no "
                                 "`rank` or `node`")
            return self
        wants = "node" if self.kind == chaos.KILL_NODE else "rank"
        if getattr(self, wants) is None:
            raise ValueError(f"a {self.kind} fault needs `{wants}`")
        return self


class FaultInjectionConfig(Section):
    faults: list[Fault] = Field(default_factory=list)


class JobConfig(Section):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=64)]
    seed: NonNegativeInt = 1234
    run_dir: str = Field("runs/{name}", description="logs and checkpoints; {name} expands")
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    supervision: SupervisionConfig = Field(default_factory=SupervisionConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)
    stability: StabilityConfig = Field(default_factory=StabilityConfig)
    fault_injection: FaultInjectionConfig = Field(default_factory=FaultInjectionConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    site: str | None = Field(
        None, pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$",
        description="a site profile, jobs/sites/<site>.yaml beside the job file: its "
                    "`network` section is the default of the job's")

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir.format(name=self.name)

    @property
    def resolved_checkpoint_dir(self) -> str:
        return self.checkpoint.dir.format(run_dir=self.resolved_run_dir, name=self.name)
