"""Validation: the loss of held-out tokens, the same value whatever the layout.

The held-out set is `eval.batches` global batches of `data.batch_size` windows of
`data.seq_len + 1` tokens, taken in one fixed shuffled order (keyed by the job's seed, first
epoch only: no window twice) from `eval.path`, or, with synthetic data, from documents past
the end of the training stream. Every validation reads the same windows, so its values compare
across a run. Each global batch is split as a training step's is (microbatches, then a slice per
data-parallel replica), so every layout sums the loss of the same tokens; the sum and the token
count are reduced over the whole world, and every rank returns the same mean. The forward is
training's (`ParallelModel.forward_loss`), in its precision: in bf16 FSDP2's policy casts at
dp > 1 and autocast at dp 1, the cross-entropy taken in fp32 either way.

    optimus eval CHECKPOINT --data DIR     one process, or each rank under torchrun / srun
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from optimus.checkpoint.trust import Trust, key_file_for
from optimus.config import JobConfig
from optimus.data.errors import DataError
from optimus.data.loader import MicrobatchSampler, WindowDataset, build_source
from optimus.data.synthetic import SyntheticCorpus
from optimus.parallel.plan import IGNORE_INDEX, ParallelModel
from optimus.runtime.mesh import LayoutMesh


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy per held-out token, nats
    tokens: int  # held-out tokens it covers, all ranks
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def fields(self) -> dict:
        """What an "eval" line of metrics.jsonl carries (never a "loss" key: readers take the
        lines with one for training steps)."""
        return {"val_loss": self.loss, "perplexity": self.perplexity,
                "eval_tokens": self.tokens, "eval_s": round(self.seconds, 3)}


def held_out_source(job: JobConfig, path: str | None = None):
    """The held-out tokens: `path` (or eval.path), else the synthetic stream's held-out part."""
    path = path or job.eval.path
    if path:
        return build_source("shards", path=path, vocab_size=job.model.vocab_size)
    if job.data.source != "synthetic":
        raise DataError("validation on prepared data needs held-out tokens: set eval.path "
                        "(e.g. the holdout/ folder of `optimus data prepare --holdout`)")
    return SyntheticCorpus(job.model.vocab_size, job.seed).held_out()


class HeldOut:
    """This rank's share of the held-out windows: per global batch, its microbatches."""

    def __init__(self, source, *, seq_len: int, batch_size: int, microbatches: int,
                 batches: int, dp_rank: int, dp_size: int, seed: int, where: str = "eval"):
        self.dataset = WindowDataset(source, seq_len, seed)
        needed = batches * batch_size
        if self.dataset.num_samples < needed:
            raise DataError(
                f"{where} holds {self.dataset.num_samples} windows of {seq_len + 1} tokens, "
                f"fewer than {batches} batch(es) x {batch_size} sequences = {needed}; lower "
                "the number of validation batches or hold out more documents")
        self.batches, self.microbatches = batches, microbatches
        self.sampler_args = dict(batch_size=batch_size, microbatches=microbatches,
                                 dp_rank=dp_rank, dp_size=dp_size)

    def __iter__(self):
        """Each global batch as this rank's list of microbatches (dicts of stacked tensors)."""
        sampler = MicrobatchSampler(**self.sampler_args)
        for _ in range(self.batches):
            batch = []
            for _ in range(self.microbatches):
                items = [self.dataset[g] for g in next(sampler)]
                batch.append({k: torch.stack([it[k] for it in items]) for k in items[0]})
            yield batch


def held_out_for(job: JobConfig, mesh: LayoutMesh, path: str | None = None,
                 batches: int | None = None) -> HeldOut:
    """This rank's held-out windows: its replica's slice (the mesh's "batch")."""
    d = job.data
    return HeldOut(held_out_source(job, path), seq_len=d.seq_len, batch_size=d.batch_size,
                   microbatches=d.microbatches, batches=batches or job.eval.batches,
                   dp_rank=mesh.rank("batch"), dp_size=mesh.size("batch"), seed=job.seed,
                   where=path or job.eval.path or "the synthetic held-out stream")


def evaluate(model: ParallelModel, held_out: HeldOut, device: torch.device,
             mesh: LayoutMesh) -> EvalResult:
    """The mean loss of the held-out tokens, on every rank (a collective: all ranks call it)."""
    started = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    for batch in held_out:
        loss_sum += model.forward_loss(batch, device).double()
        tokens += sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in batch)
    # Ranks holding the last stage have the losses, every tensor-parallel rank of them the
    # same one, each context-parallel rank its slice's: sum one tp rank's loss per replica and
    # slice, and the tokens (counted over whole sequences) once per replica.
    first_tp = mesh.rank("tensor") == 0
    holds_loss = first_tp and model.num_stages - 1 in model.stage_ids
    counted = first_tp and mesh.rank("pipeline") == 0 and mesh.rank("context") == 0
    totals = torch.stack([loss_sum * holds_loss,
                          torch.tensor(float(tokens * counted), dtype=torch.float64,
                                       device=device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    loss, count = totals.tolist()
    return EvalResult(loss / max(count, 1.0), int(count), time.perf_counter() - started)


def evaluate_checkpoint(step_path: Path, *, data: str | None, batches: int,
                        overrides: list[str] = (),
                        trust: Trust | None = None) -> tuple[EvalResult, dict, int]:
    """The validation loss of a committed checkpoint, computed by this process's rank on the
    layout the launch gives (one process, or each rank under torchrun / srun / mpiexec):
    the checkpoint's own job, its layout and settings changed by `overrides`
    ("parallel.tp=2"), its weights loaded (resharded by DCP), the held-out windows of `data`
    (a prepared folder; None: the synthetic held-out stream of a synthetic-data job). Returns
    the result, the checkpoint's manifest (with "untrusted": None, or why the run's key does
    not authenticate it) and this process's rank. Only a checkpoint the run's key
    authenticates is evaluated, or one `trust` (checkpoint/trust.py) accepts; default: the key
    beside its directory."""
    from optimus.checkpoint.saver import Checkpointer
    from optimus.checkpoint.state import ModelState
    from optimus.config import apply_override, resolve_layout, validate_job
    from optimus.parallel.plan import build_parallel_model
    from optimus.runtime import (
        destroy_distributed,
        init_distributed,
        launch_env,
        pick_backend,
        pick_device,
    )
    from optimus.runtime.network import apply_network

    trust = trust or Trust(key_file_for(step_path.parent))
    manifest, untrusted = trust.manifest(step_path)  # on every rank: its config builds the job
    manifest["untrusted"] = untrusted
    raw = json.loads(json.dumps(manifest["config"]))
    if data is None and raw["data"]["source"] != "synthetic":
        raise DataError(f"{step_path} was trained on prepared data: name its held-out tokens "
                        "with --data DIR (e.g. the holdout/ folder of `optimus data prepare`)")
    # The checkpoint's model and data shapes; a layout of this launch's own (data parallel
    # over every rank unless --set says otherwise); nothing of its training run's machinery.
    raw.update(parallel={}, training={"mixed_precision": raw["training"]["mixed_precision"]},
               fault_injection={"faults": []}, eval={"every": 1})
    raw["model"]["init_from"] = None
    for assignment in overrides:
        apply_override(raw, assignment)
    raw["eval"] = {"every": 1, "batches": batches, "path": data}
    env = launch_env()
    job = validate_job(raw, source=f"{step_path}/optimus.json", world=env.world_size)
    layout = resolve_layout(job, env.world_size)
    device = pick_device(job.parallel.device, env.local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        apply_network(job.network)
        init_distributed(env, pick_backend(device, job.parallel.backend), device)
    try:
        mesh = layout.build_mesh(device.type)
        model = build_parallel_model(job, mesh, device)
        loader = Checkpointer(step_path.parent, rank=env.rank, world_size=env.world_size,
                              mode="sync", trust=trust)
        loader.load(step_path, {"model": ModelState(model.state_view())})
        loader.close()
        held_out = held_out_for(job, mesh, path=data, batches=batches)
        return evaluate(model, held_out, device, mesh), manifest, env.rank
    finally:
        if owns_group:
            destroy_distributed()
