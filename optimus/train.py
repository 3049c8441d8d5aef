"""The training loop. One rank's whole life, top to bottom.

Run one rank:       optimus train jobs/tiny-gpt.yaml
Run several ranks:  torchrun --nproc-per-node 2 -m optimus train jobs/tiny-gpt.yaml

The loop is three calls a step: the step's batches (already on the device,
optimus/data/prefetch.py), `train_step` (forward, backward, clip, update: optimus/step.py,
which never waits on the device), and the boundary's hooks (optimus/boundary.py: the step's
figures read and judged, its record, saves, snapshots, validation, the ranks' agreement).

SIGTERM to any rank stops every rank after one same step, with a checkpoint of it (exit 0).
Under an agent, operators pause, resume and checkpoint the ranks the same way: at a step
boundary all ranks agree (optimus/supervision/commands.py), so all act after the same step.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optimus.boundary import Boundary
from optimus.checkpoint.manifest import committed_steps
from optimus.checkpoint.policy import RunCheckpoints, log_resume
from optimus.checkpoint.saver import Checkpointer
from optimus.checkpoint.snapshot import Snapshots, load_agreed, resume_request
from optimus.checkpoint.state import Progress, layout_key, training_state
from optimus.checkpoint.trust import Trust, run_key_file
from optimus.config import JobConfig, resolve_layout
from optimus.contract.env import CPU_BIND, MASTER_PORT
from optimus.data import build_loader, build_source
from optimus.data.prefetch import DeviceBatches
from optimus.evaluate import EvalResult, held_out_for
from optimus.metrics import Laps, MetricsLog, StepMetrics, peak_flops, sample_fingerprint
from optimus.models import flops_per_token
from optimus.optim import build_optimizer, lr_at, set_lr
from optimus.parallel.compile import CompileLog
from optimus.parallel.float8 import float8_message
from optimus.parallel.plan import build_parallel_model
from optimus.parallel.positions import Positions
from optimus.parallel.replica_mode import Healed, ReplicaLaunch, ReplicaSteps
from optimus.runtime import (
    cpu_binding,
    destroy_distributed,
    device_name,
    init_distributed,
    launch_env,
    pick_backend,
    pick_device,
    reset_peak_memory,
)
from optimus.runtime.dist import host_group
from optimus.runtime.network import apply_network
from optimus.runtime.stacks import register_stack_dumps
from optimus.stability import StabilityWatch, rewind_lr, skip_batches, skips_ahead
from optimus.step import StepParts, train_step
from optimus.supervision.commands import Commands
from optimus.supervision.faults import RankFaults
from optimus.supervision.heartbeat import start_heartbeat

# DTensor warns at every clip on a dp x tp mesh that it gathers in two steps; it is expected.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@dataclass
class TrainResult:
    losses: list[float]  # global loss of each logged step
    metrics: list[StepMetrics]
    sample_ids: list[list[int]] = field(default_factory=list)  # this rank's, per step
    state: dict[str, torch.Tensor] | None = None  # full model weights, when asked for
    stopped_at: int | None = None  # the step after which all ranks stopped (SIGTERM), if any
    evals: list[tuple[int, EvalResult]] = field(default_factory=list)  # (step, validation)


def train(job: JobConfig, *, keep_state: bool = False, keep_sample_ids: bool = False,
          quiet: bool = False, trust_checkpoint: bool = False) -> TrainResult:
    """Train `job` as this process's rank; the launch environment says which rank that is.
    `trust_checkpoint`: resume from the newest checkpoint even if this run did not write it."""
    laps = Laps()  # where a generation's start goes (rank 0's "start" event)
    env = launch_env()
    cpus = cpu_binding(os.environ.get(CPU_BIND), env.local_rank)
    if cpus:  # e.g. Aurora's 12 ranks per node, each on its own 8 cores
        os.sched_setaffinity(0, cpus)
    # One replica among several (optimus/parallel/replica_mode.py): this world is its replica's.
    replica = ReplicaLaunch.from_env(job.parallel.replicas)
    ranks = env.world_size * (replica.replicas if replica else 1)
    layout = resolve_layout(job, ranks)
    if replica is not None:
        layout = resolve_layout(replica.world_job(job), env.world_size)
    device = pick_device(job.parallel.device, env.local_rank)
    backend = pick_backend(device, job.parallel.backend)
    # Supervision: SIGTERM asks every rank to stop after one same step; heartbeats to the agent.
    commands = Commands(env.world_size, torch.device("cpu")).listen()  # on the host's group
    heartbeat = start_heartbeat(env, job.supervision.heartbeat_interval_s)
    register_stack_dumps()  # SIGUSR1 from the agent: every thread's stack, for a hang's event
    faults = RankFaults(job.fault_injection, rank=env.rank, generation=env.restart_count)
    owns_group = not dist.is_initialized()
    dropped = []  # what to stop if the generation ends under this rank (see `finally`)
    try:
        with heartbeat.phase("sync"):  # the rendezvous, the mesh's process groups
            if owns_group:
                apply_network(job.network)  # the interface the collectives use, first
                # a replica's world serves its store where its agent said (the quorum's)
                init_distributed(env, backend, device, serve_store=replica is not None
                                 and bool(os.environ.get(MASTER_PORT)))
            laps.lap("rendezvous")
            mesh = layout.build_mesh(device.type)
            host = commands.group = host_group(backend)  # the boundary's: never on the device
            laps.lap("groups")
        torch.manual_seed(job.seed)

        # Model: the same weights on every layout, this rank's share of them, plans applied.
        model = build_parallel_model(job, mesh, device)
        optimizer = build_optimizer(model.state_view(), job.optim, device)
        laps.lap("model")

        log = MetricsLog(
            Path(job.resolved_run_dir) / "metrics.jsonl", total_steps=job.optim.steps,
            flops_per_token=flops_per_token(job.model, job.data.seq_len),
            peak_flops_per_device=peak_flops(device_name(device), job.supervision.peak_tflops),
            world_size=ranks,
            enabled=env.rank == 0 and not quiet)
        dropped.append(log.close)
        logs = log.enabled  # under replicas, the lowest member's rank 0 (ReplicaSteps.roles)
        # Until its first quorum, replica 0 of a new generation; a replica relaunched within
        # one (`launch`) writes nothing before it is let in: its start is no resume of the run
        # (a member heals it), and the run's writer is a member.
        log.enabled = logs and (replica is None or replica.replica == 0 and replica.launch == 0)
        result = TrainResult(losses=[], metrics=log.history)
        compiles = CompileLog(log) if job.training.compile else None
        if job.training.float8 != "off":
            log.event("float8", float8_message(job.training.float8, device.type,
                                               model.float8_skipped),
                      skipped=dict(model.float8_skipped))
        if job.training.float8_experts != "off":
            log.event("float8_experts", f"the experts' grouped GEMMs in float8 "
                      f"({job.training.float8_experts} scales); bf16 is the reference",
                      recipe=job.training.float8_experts)

        # Checkpoints: resume from the in-memory snapshot the agent names when every rank can,
        # else from the newest disk checkpoint that verifies; then save every `interval`, and
        # snapshot into the agent's memory every `memory_every` steps.
        progress = Progress(job.data.batch_size)
        key = layout_key(layout, device)  # a string: a checkpoint holds no object of ours
        state = training_state(model, optimizer, progress, rank=env.rank, layout=key)
        watch = state["stability"] = StabilityWatch(job.stability)  # spikes (stability.py)
        agree_on = torch.device("cpu") if backend == "gloo" else device
        resumed, not_used = None, None
        # A replica relaunched within its generation (`launch`) is healed from a live member
        # when it is let in: it reads nothing from disk first (its peers' cores are spared).
        resume = job.checkpoint.resume == "auto" and not (replica and replica.launch)
        if resume:
            with heartbeat.phase("checkpoint_sync"):
                resumed, not_used = load_agreed(state, resume_request(), rank=env.rank,
                                                layout=key)
        # Under replicas, only replica 0 at its generation's start clears what a crashed one
        # left: a replica relaunched within it would delete the writer's save in flight.
        ckpt = _checkpointer(job, env, heartbeat, trust_checkpoint,
                             clean=replica is None or replica.replica == 0 and not replica.launch)
        if ckpt is not None:
            dropped.append(ckpt.drop)
        if resumed is None and ckpt and resume:
            resumed = ckpt.load_latest(state, job.checkpoint.verify_on_load)
        log_resume(log, ckpt, resumed, not_used)
        # Under replicas, only the writer (the lowest member) takes them (ReplicaSteps.roles).
        snapshots = Snapshots.for_job(
            job.checkpoint.memory_every, rank=env.rank, generation=env.restart_count,
            layout=key, agree_device=agree_on)
        if snapshots is not None:
            dropped.append(snapshots.close)
        if job.model.init_from:  # a Hugging Face start, unless resumed; imported only then:
            # it loads torch.export and the tokenizer's modules, ~0.25 s of every rank's start
            from optimus.hf.load import init_from
            init_from(job, model, resumed, log)
        laps.lap("restore")
        if progress.step >= job.optim.steps:
            log.event("done", f"nothing to train: the checkpoint is at step {progress.step} of "
                      f"{job.optim.steps}; raise optim.steps to train further")

        # Data: each dp replica reads its slice of the global batch, from where it stopped.
        source = build_source(job.data, vocab_size=job.model.vocab_size, seed=job.seed)
        dp_rank, dp_size = mesh.rank("batch"), mesh.size("batch")
        if replica is not None:
            dp_rank, dp_size = replica.batch_slice(dp_rank, dp_size)

        def open_loader(index: int):
            return build_loader(source, seq_len=job.data.seq_len,
                                batch_size=job.data.batch_size,
                                microbatches=job.data.microbatches,
                                dp_rank=dp_rank, dp_size=dp_size,
                                seed=job.seed, start_index=index,
                                num_workers=job.data.num_workers,
                                prefetch_factor=job.data.prefetch_factor,
                                pin_memory=device.type != "cpu")
        loader = open_loader(progress.data_index)
        if job.data.sources:  # each source's realised share, and how often the run reads it
            message, fields = loader.dataset.report(job.optim.steps * job.data.batch_size)
            log.event("mixture", message, **fields)
        batches = DeviceBatches(iter(loader), job.data.microbatches, device)
        # Windows of steps whose batches a rewind skips, ahead of where this generation starts
        # (a checkpoint past a window's start read past it already).
        skips = skips_ahead(progress.step)
        calmer = rewind_lr(job.stability)  # the learning rate's factor after a rewind's window
        # The validation windows, this rank's share.
        held_out = held_out_for(job, mesh) if job.eval.every else None
        if resumed:
            state["rng"].apply()  # making the iterator drew from the RNG; put it back
        laps.lap("data")
        if env.restart_count:  # where a restart's time went (bench/recovery.py reads it)
            log.event("start", f"generation {env.restart_count} ready to train: {laps}",
                      generation=env.restart_count, **laps.fields())
        heartbeat.resumed(progress.step, resumed["step"] if resumed else None,
                          tuple(q["step"] for q in ckpt.quarantined) if ckpt else (),
                          source=resumed.get("source", "disk") if resumed else "disk")

        saves = RunCheckpoints(ckpt, log, job, layout, state, progress)
        parts = StepParts(model, optimizer, job, mesh, device, faults, heartbeat)
        steps = None
        if replica is not None:  # the first quorum holding this replica, healed if behind
            sv = job.supervision
            wait_s = max(sv.startup_timeout_s, sv.hang_timeout_s)  # for a quorum holding it
            steps = parts.replicas = ReplicaSteps(
                replica, position=env.rank, backend=backend, model=model,
                optimizer=optimizer, progress=progress, watch=watch, commands=commands,
                timeout_s=sv.hang_floor_s, wait_s=wait_s, log=log,
                positions=Positions(host, env.world_size, sv.hang_floor_s + wait_s))
            dropped.append(steps.close)
            with heartbeat.phase("standby"):  # the controller lets a relaunched replica in
                steps.join()
            writes = steps.roles(log, saves, ckpt, logs)  # its writer says how it formed
            steps.report(log)
        between = Boundary(job=job, rank=env.rank, log=log, watch=watch, progress=progress,
                           heartbeat=heartbeat, saves=saves,
                           snapshots=snapshots if steps is None or writes else None,
                           commands=commands, result=result, parts=parts, state=state,
                           held_out=held_out, compiles=compiles, host_group=host,
                           on_eval=lambda step, v: _log_validation(
                               log, heartbeat, step, progress.tokens, v, env.rank))
        if steps is not None:  # a command acts in every replica after the same step
            between.across, between.across_now = steps.across, steps.across_now
        # A job paused (or stopped) across a restart stays so: agree before the first step too.
        first = progress.step + 1
        with heartbeat.phase("sync"):
            agreed = commands.start()
        if between.act(agreed, progress.step):
            result.stopped_at, first = progress.step, job.optim.steps + 1  # no step to take

        step = first
        while step <= job.optim.steps:
            if steps is not None:
                if steps.before(step, between.settle):  # healed: on from the state's step
                    step = progress.step + 1
                    batches.replace(iter(open_loader(progress.data_index)))
                    continue
                between.snapshots = snapshots if steps.roles(log, saves, ckpt, logs) else None
            faults.step_start(step)
            if step in skips:
                batches.replace(skip_batches(step, skips[step], progress, job, open_loader, log))
            heartbeat.begin_step(step)
            reset_peak_memory(device)
            lr = lr_at(step, job.optim) * calmer(step)
            set_lr(optimizer, lr)
            with heartbeat.phase("data"):
                microbatches = batches.take()  # on the device already
            faults.poison(step, microbatches, job.model.vocab_size)
            if keep_sample_ids:
                result.sample_ids.append([s for mb in microbatches
                                          for s in mb["sample_ids"].tolist()])
            try:
                out = train_step(parts, step, microbatches, lr=lr,
                                 reduce_loss=between.reduce_loss(step),
                                 before_update=between.before_update)
            except Healed:  # the others applied this step: this rank's state holds it now
                optimizer.zero_grad(set_to_none=True)
                step = progress.step + 1
                batches.replace(iter(open_loader(progress.data_index)))
                continue
            if log.enabled or steps is not None:  # a replica may take the writing over
                out.data = sample_fingerprint(
                    progress.data_index, job.data.batch_size,
                    (mb["sample_ids"] for mb in microbatches),
                    (dp_size, job.data.microbatches))
                if steps is not None:  # whose slices the step trained (optimus data audit)
                    out.data.update(steps.fingerprint(dp_rank))
            with heartbeat.phase("data"):  # the next step's, while the device runs this one
                batches.ahead()
            if steps is not None:
                steps.look()
            if between.after_step(out):
                result.stopped_at = step
                break
            if steps is not None:
                steps.agreed()
                steps.report(log)
            step += 1
        between.settle()
        if steps is not None:  # the members hold the same state: checked
            steps.roles(log, saves, ckpt, logs)
            steps.report(log)
            steps.finish(log)

        # Leaving, in this order, so that nothing this rank started outlives its turn (a warm
        # rank ends in os._exit, a cold one in the interpreter's finalization: a helper still
        # running at either ends the rank with a traceback or an abort, not exit status 0):
        # 1. the last save lands, then the checkpointer stops its commit thread and DCP's
        #    writer process (saves.finish -> Checkpointer.close); 2. the snapshot writer thread
        #    finishes its write; 3. the metrics log closes; 4. all ranks meet, so that none tears
        #    gloo down while a peer is still in a collective; 5. the heartbeat thread stops after
        #    its last beat, "done". Then, on every path (`finally`): the heartbeat, the signal
        #    handlers, the process groups, whose C++ objects are freed at the interpreter's exit.
        with heartbeat.phase("checkpoint"):  # the last step is saved, or this says why
            saves.finish(progress.step, final=first <= progress.step == job.optim.steps)
            if ckpt is not None and saves.ckpt is None:  # a replica that was not writing
                ckpt.close()
            if snapshots is not None:
                snapshots.close()
        log.close()
        dropped.clear()
        with heartbeat.phase("sync"):
            if keep_state:
                result.state = {k: v for part in model.parts
                                for k, v in _full_state(part).items()}
            dist.barrier()  # leave together: a peer tearing down gloo mid-exit can abort another
        heartbeat.finish()
        return result
    finally:
        # A generation that ended under this rank (a peer died mid-collective) leaves nothing
        # running: the rank may go on in process (optimus/supervision/inprocess.py), or it exits.
        for stop in reversed(dropped):
            with contextlib.suppress(Exception):
                stop()
        heartbeat.close()
        commands.close()
        if owns_group:  # abort, not drain, the groups of a generation that failed under us
            destroy_distributed(abort=sys.exc_info()[1] is not None)
            # The groups live on in the device mesh, which sits in a reference cycle: freed only
            # by the cyclic collector, which may first run during the interpreter's finalization,
            # when gloo's worker threads can no longer take the GIL ("terminate called without
            # an active exception"). Collect them at exit, while the interpreter is whole.
            atexit.unregister(gc.collect)  # once per process, however many runs
            atexit.register(gc.collect)


TRUST_HINT = ("if you trust whoever wrote it, pass --trust-checkpoint to `optimus train`, or set "
              "checkpoint.trust_step to its step")


def _checkpointer(job: JobConfig, env, heartbeat, trust_any: bool,
                  clean: bool = True) -> Checkpointer | None:
    """A checkpointer when the job saves, or has checkpoints to resume from; else None. Its
    collectives (the save's agreements, the load) are marked as phase "checkpoint_sync". It
    signs with the run's key and resumes only from what that key authenticates, or what the
    operator trusts (--trust-checkpoint, checkpoint.trust_step)."""
    c = job.checkpoint
    can_resume = c.resume == "auto" and committed_steps(job.resolved_checkpoint_dir)
    if c.interval == 0 and not can_resume:
        return None
    return Checkpointer(job.resolved_checkpoint_dir, rank=env.rank, world_size=env.world_size,
                        keep_last=c.keep_last, keep_every=c.keep_every, mode=c.async_mode,
                        on_overlap=c.on_overlap,
                        collective=lambda: heartbeat.phase("checkpoint_sync"),
                        trust=Trust(run_key_file(job.resolved_run_dir), any=trust_any,
                                    step=c.trust_step, hint=TRUST_HINT), clean=clean)


def _log_validation(log: MetricsLog, heartbeat, step: int, tokens: int,
                    validation: EvalResult, rank: int) -> None:
    """A validation's figures: an "eval" line in metrics.jsonl, rank 0's heartbeat summary."""
    log.event("eval", f"step {step}: validation loss {validation.loss:.4f} (perplexity "
              f"{validation.perplexity:.2f}) on {validation.tokens:,} held-out tokens in "
              f"{validation.seconds:.1f} s", step=step, tokens=tokens, **validation.fields())
    heartbeat.validated(None if rank else {"val_loss": validation.loss, "val_step": step})


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights on CPU, on every rank (for tests and small models)."""
    out = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[name] = value.detach().to("cpu", copy=True)
    return out
