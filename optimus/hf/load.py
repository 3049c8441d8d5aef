"""Start a run from a Hugging Face checkpoint: `model.init_from: "hf:DIR"`.

For continued pretraining from an exported model, or from any Llama (or matching MoE family)
checkpoint whose `config.json` describes the job's model. The check comes first and names the
first setting that differs, with both values (`families.check_hf_config`).

The model is built and sharded as usual (`build_parallel_model`), then every rank fills its own
shards: for each tensor this rank holds, it reads the full tensor from the safetensors files,
converts it (`tensors.py`) and keeps its part (`distribute_tensor` without communication, as
`init_weights` does). So it works the same under tensor, pipeline (a stage reads only its own
layers), data (FSDP2) and expert parallelism, and no rank holds more than one full tensor at a
time beyond its shards.

The trainer calls `init_from` once, after the resume decision: a run that resumed from its own
checkpoint continues from that, and the `init_from` event says which happened.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from optimus.checkpoint.manifest import CheckpointError
from optimus.hf.export import INDEX
from optimus.hf.families import Family, check_hf_config
from optimus.hf.tensors import from_hf, pieces
from optimus.models.gpt import canonical_name

PREFIX = "hf:"


def init_from(job, model, resumed: dict | None, log) -> None:
    """Apply `model.init_from` to this rank's model chunks, unless the run resumed."""
    spec = job.model.init_from
    if not spec:
        return
    if resumed:
        log.event("init_from", f"{spec} not used: the run resumed from its checkpoint of step "
                  f"{resumed['step']}, which already continues from it", applied=False,
                  step=resumed["step"])
        return
    path = Path(spec.removeprefix(PREFIX))
    family, count = load_hf(path, job.model, model.parts)
    log.event("init_from", f"weights from {path} ({family.architecture}); this rank filled "
              f"{count} tensors", applied=True, path=str(path), family=family.model_type)


def read_config(path: Path) -> dict:
    config = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"model.init_from: {path} is not a directory: give hf:DIR, the "
                              "folder of a Hugging Face model (config.json, *.safetensors)")
    try:
        return json.loads(config.read_text())
    except OSError as e:
        raise CheckpointError(f"model.init_from: cannot read {config} ({e.strerror}): a Hugging "
                              "Face model folder has one") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"model.init_from: {config} is not valid JSON ({e})") from None


class SafetensorsFolder:
    """The tensors of a model folder, by name, read one at a time (`safe_open` maps files)."""

    def __init__(self, path: Path, config: dict, stack: ExitStack):
        from safetensors import safe_open

        self.path, self._open, self._stack = path, safe_open, stack
        index = path / INDEX
        if index.is_file():
            self.files = {name: path / file
                          for name, file in json.loads(index.read_text())["weight_map"].items()}
        elif (path / "model.safetensors").is_file():
            with safe_open(path / "model.safetensors", framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), path / "model.safetensors")
        else:
            raise CheckpointError(f"model.init_from: {path} has neither {INDEX} nor "
                                  "model.safetensors")
        # A model with tied embeddings stores no head: the head starts as the embedding.
        if "lm_head.weight" not in self.files and config.get("tie_word_embeddings"):
            self.files["lm_head.weight"] = self.files.get("model.embed_tokens.weight")
            self.aliases = {"lm_head.weight": "model.embed_tokens.weight"}
        else:
            self.aliases = {}
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"model.init_from: {self.path} has no tensor {name}")
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(self._open(file, framework="pt"))
        return self._handles[file].get_tensor(self.aliases.get(name, name))


def load_hf(path: Path, cfg, parts: list[torch.nn.Module]) -> tuple[Family, int]:
    """Fill every parameter (and the loss-free bias) of `parts` from the model in `path`."""
    config = read_config(path)
    family = check_hf_config(config, cfg, f"model.init_from: {path}/config.json")
    mine = {canonical_name(n): t for part in parts
            for n, t in [*part.named_parameters(), *part.named_buffers()]}
    params = {canonical_name(n) for part in parts for n, _ in part.named_parameters()}
    filled = set()
    with ExitStack() as stack:
        folder = SafetensorsFolder(path, config, stack)
        for piece in pieces(cfg, family):
            if piece.ours is not None and piece.ours not in mine:
                continue  # another pipeline stage holds it
            full = from_hf(piece, [folder.get(n) for n in piece.hf], f"model.init_from: {path}")
            if full is None:
                continue
            if (piece.ours.endswith("expert_bias") and cfg.moe.balance != "bias"
                    and full.count_nonzero()):
                raise CheckpointError(
                    f"model.init_from: {path}: {piece.hf[0]} is not zero, but the job's "
                    f"model.moe.balance is {cfg.moe.balance!r}, which chooses experts without "
                    "it: set model.moe.balance: bias to keep the routing the model learned")
            target = mine[piece.ours]
            if tuple(full.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"model.init_from: {path}: {', '.join(piece.hf[:1])} gives {piece.ours} "
                    f"the shape {tuple(full.shape)}, the job's model has {tuple(target.shape)}")
            _fill(target, full)
            filled.add(piece.ours)
    if missing := sorted(params - filled):  # a mapping that forgot a parameter is a bug
        raise CheckpointError(f"model.init_from: nothing in {path} fills {missing[:3]}")
    return family, len(filled)


@torch.no_grad()
def _fill(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` into `target` (a plain tensor or a DTensor shard)."""
    full = full.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
    target.copy_(full)
