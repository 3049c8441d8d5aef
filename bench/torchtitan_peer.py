"""The torchtitan peer of bench/mfu.py: torchtitan 0.3.0's llama3 at the same shape, one device.

The figure: Optimus's tokens/s over torchtitan's in bench/mfu.py's compiled bf16 mode (Mula-1B,
2048 x 4 tokens a step, no activation recompute), target >= 1.00, with torchtitan's own
tokens/s, TFLOP/s and MFU beside it (the same FLOPs per token and peak table as bench/mfu.py).

torchtitan's side is its own pieces, put together as its Trainer does on one device: the llama3
model (`Llama3Model`) with Mula-1B's dimensions, its config made with torchtitan's config
helpers (fused qkv, FlexAttention with the block-causal mask from the tokens' positions, RoPE
theta 5e5: torchtitan's llama3 defaults; no weight tying, as Mula-1B has none), built on the
meta device; `parallelize_llama` (torch.compile of each block and of the loss, then FSDP2 on a
one-device mesh with torchtitan's mixed precision: bf16 parameters, fp32 reduction); `to_empty`
and `init_weights`; its cross-entropy (summed, over the step's token count), fused AdamW
(`default_adamw`) and gradient clipping. The loop is the project's plain one
(`bench/mfu_reference.run_steps`): bench/mfu.py's batches, window and sync count.

Not torchtitan's Trainer itself: its data loaders read a Hugging Face dataset and a tokenizer's
files, which the device machine neither holds nor can fetch, and would feed other batches. Nor
its ChunkedLossWrapper (its llama3 configs' loss, for memory): Optimus and the plain loop make
the whole logits, and so does this.

On the device image's torch 2.11, torchtitan 0.3.0 does not import as it is: it imports
`torch.distributed.fsdp.DataParallelMeshDims` (torch 2.12+) by name, and uses it only on
meshes of more than one device. The script puts a stand-in of that name in place where torch
lacks it and says so (`shims` in its JSON); `bench/gpu_check.py` tries the same import.

Optimus's figure comes from bench/mfu.py's JSON of the same command (`--mfu-json`: its
compiled-bf16-none mode); without it, the ratio is n/a.

    python bench/torchtitan_peer.py --device cuda --mfu-json DIR/mfu.json --out DIR/tt.json
    python bench/torchtitan_peer.py --device cpu --tiny     # a check that it runs (3 steps)
"""

from __future__ import annotations

import argparse
import functools
import json
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.mfu import SMALL, Bench, Mode, fresh, header_shape, peak_memory  # noqa: E402
from bench.mfu_reference import batches, run_steps  # noqa: E402
from bench.mfu_report import flop_rate  # noqa: E402
from bench.mfu_window import syncs_text  # noqa: E402
from optimus.config import validate_job  # noqa: E402
from optimus.models import flops_per_token, param_count  # noqa: E402
from optimus.runtime import device_name  # noqa: E402
from optimus.runtime.peaks import peak_flops  # noqa: E402

VERSION = "0.3.0"
RATIO_TARGET = 1.00  # Optimus / torchtitan tokens/s
MODE = "compiled-bf16-none"  # bench/mfu.py's mode this is set beside


def import_torchtitan() -> tuple[SimpleNamespace, list[str]]:
    """torchtitan's pieces this uses, and the stand-ins put into torch for it (see above)."""
    import torch.distributed.fsdp as fsdp

    shims = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {
            "__doc__": "bench/torchtitan_peer.py's stand-in: torch < 2.12 lacks the name"})
        shims.append(f"torch {torch.__version__} lacks torch.distributed.fsdp."
                     "DataParallelMeshDims: a stand-in name (used on meshes of 2+ devices only)")
    import torchtitan
    import torchtitan.components.loss as loss
    import torchtitan.components.optimizer as optimizer
    import torchtitan.config as config
    import torchtitan.distributed as distributed
    import torchtitan.distributed.utils as distributed_utils
    import torchtitan.models.common as common
    import torchtitan.models.common.config_utils as config_utils
    import torchtitan.models.llama3 as llama3
    import torchtitan.models.llama3.model as llama3_model
    import torchtitan.models.llama3.sharding as llama3_sharding

    return SimpleNamespace(
        version=getattr(torchtitan, "__version__", "unknown"),
        CrossEntropyLoss=loss.CrossEntropyLoss, default_adamw=optimizer.default_adamw,
        CompileConfig=config.CompileConfig, ParallelismConfig=config.ParallelismConfig,
        TrainingConfig=config.TrainingConfig, ParallelDims=distributed.ParallelDims,
        clip_grad_norm_=distributed_utils.clip_grad_norm_, ComplexRoPE=common.ComplexRoPE,
        Embedding=common.Embedding, Linear=common.Linear, RMSNorm=common.RMSNorm,
        ScaledDotProductAttention=common.ScaledDotProductAttention,
        get_attention_config=config_utils.get_attention_config,
        make_ffn_config=config_utils.make_ffn_config,
        make_gqa_config=config_utils.make_gqa_config, Llama3Model=llama3.Llama3Model,
        parallelize_llama=llama3.parallelize_llama,
        set_llama3_sharding_config=llama3_sharding.set_llama3_sharding_config,
        Llama3TransformerBlock=llama3_model.Llama3TransformerBlock), shims


def flex_problem(device: torch.device) -> str | None:
    """Why torchtitan's FlexAttention path cannot run on this torch and device, or None."""
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    if device.type == "cpu":
        return "FlexAttention has no backward on a CPU"
    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        return (f"torch {torch.__version__}'s create_block_mask lacks separate_full_blocks, "
                "which torchtitan 0.3.0's block masks pass (torch 2.12+)")
    return None


def inner_attention(tt, attention: str):
    """torchtitan's attention module config: its ScaledDotProductAttention (causal; the kernel
    Optimus and the plain loop use) or its FlexAttention (llama3's default: the block-causal
    mask of the tokens' positions)."""
    if attention == "sdpa":
        return tt.ScaledDotProductAttention.Config()
    return tt.get_attention_config("flex")


def llama3_config(tt, model, seq_len: int, attention: str):
    """A `Llama3Model.Config` of `model`'s dimensions (the job's model section)."""
    std = functools.partial(torch.nn.init.trunc_normal_, std=0.02)
    linear, ones = {"weight": std}, {"weight": torch.nn.init.ones_}
    head_dim = model.dim // model.n_heads
    rope = tt.ComplexRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=model.rope_theta)

    def norm():
        return tt.RMSNorm.Config(normalized_shape=model.dim, eps=model.norm_eps,
                                 param_init=ones)

    layers = [tt.Llama3TransformerBlock.Config(
        attention_norm=norm(), ffn_norm=norm(),
        attention=tt.make_gqa_config(
            dim=model.dim, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,
            wqkv_param_init=linear, wo_param_init=linear,
            inner_attention=inner_attention(tt, attention), fuse_qkv=True, rope=rope),
        feed_forward=tt.make_ffn_config(dim=model.dim, hidden_dim=model.ffn_dim,
                                        w1_param_init=linear, w2w3_param_init=linear),
    ) for _ in range(model.n_layers)]
    return tt.Llama3Model.Config(
        dim=model.dim, vocab_size=model.vocab_size, layers=layers, norm=norm(),
        tok_embeddings=tt.Embedding.Config(num_embeddings=model.vocab_size,
                                           embedding_dim=model.dim, param_init=linear),
        lm_head=tt.Linear.Config(in_features=model.dim, out_features=model.vocab_size,
                                 param_init=linear))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_device_group(tt, device: torch.device):
    """A process group of this one process, and torchtitan's `ParallelDims` over it.

    torchtitan's `init_distributed` picks its backend from the accelerator it assumes (its
    device type falls back to "cuda" where there is none), so the group is made here: nccl on
    a GPU, gloo on a CPU, with the one setting of torchtitan's own: no multithreaded autograd
    (its spmd_types backend keeps the mesh in thread-local state)."""
    torch.autograd.set_multithreading_enabled(False)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # torch 2.11 refuses a bare "cuda"
    if not torch.distributed.is_initialized():
        store = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             store=store, rank=0, world_size=1)
    if device.type == "cpu":  # torchtitan builds its mesh on its own device type
        import torchtitan.distributed.parallel_dims as parallel_dims
        parallel_dims.device_type = "cpu"
    dims = tt.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    dims.build_mesh()
    return dims


def build(tt, job, device: torch.device, compile: bool, attention: str, dims, tmp: str):
    """The model, loss and optimizer, the way torchtitan's Trainer makes them on one device."""
    parallelism = tt.ParallelismConfig()
    training = tt.TrainingConfig(local_batch_size=job.data.batch_size,
                                 seq_len=job.data.seq_len, max_norm=job.optim.grad_clip)
    compile_config = tt.CompileConfig(enable=compile)
    config = llama3_config(tt, job.model, job.data.seq_len, attention)
    # What `update_from_config` does to a dense llama3 on one device; called directly, since
    # that method imports torchtitan's Trainer module for a type check, and with it the
    # Hugging Face `datasets` stack, which the device image lacks.
    tt.set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    params = sum(p.numel() for p in model.parameters())
    if params != param_count(job.model):
        raise SystemExit(f"torchtitan's model has {params:,} parameters, Optimus's "
                         f"{param_count(job.model):,}: not the same model")
    model = tt.parallelize_llama(model, parallel_dims=dims, training=training,
                                 parallelism=parallelism, compile_config=compile_config,
                                 ac_config=None, dump_folder=tmp)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = tt.CrossEntropyLoss.Config(global_vocab_size=job.model.vocab_size).build(
        compile_config=compile_config)
    o = job.optim
    optimizer = tt.default_adamw(lr=o.lr).build(model_parts=[model])
    return model, loss_fn, optimizer, training, params


def peer_side(bench: Bench, compile: bool, attention: str) -> dict:
    """torchtitan's steps in bench/mfu.py's window: its figures, the first loss, memory."""
    import tempfile

    tt, shims = import_torchtitan()
    mode = Mode(compile, "bf16", "none")
    job = validate_job(bench.job(mode, "unused"), world=1)
    fresh(bench.device)
    dims = one_device_group(tt, bench.device)
    with tempfile.TemporaryDirectory(prefix="bench-tt-") as tmp:
        model, loss_fn, optimizer, training, n_params = build(
            tt, job, bench.device, compile, attention, dims, tmp)
    device = bench.device
    b, s = job.data.batch_size, job.data.seq_len
    # FlexAttention's mask comes from the tokens' positions (one document a row here, as
    # torchtitan's loader gives them); causal SDPA needs none, and RoPE then takes 0..s-1.
    positions = torch.arange(s, device=device).expand(b, s) if attention == "flex" else None
    params = [p for p in model.parameters()]

    def train_step(batch) -> torch.Tensor:
        tokens = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        masks = None if positions is None else model.get_attention_masks(positions=positions)
        pred = model(tokens, positions=positions, attention_masks=masks)
        tokens_in_step = (labels != -100).sum()  # torchtitan's IGNORE_INDEX
        loss, _ = loss_fn(pred, labels, tokens_in_step)
        del pred
        loss.backward()
        tt.clip_grad_norm_(params, training.max_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    with bench.window() as window:
        first_loss = run_steps(batches(job), train_step, window)
    figures = {**window.figures(), "first_loss": first_loss,
               "max_memory_bytes": peak_memory(device), "shims": shims, "attention": attention,
               "torchtitan": tt.version, "params": n_params}
    torch.distributed.destroy_process_group()
    return figures


def optimus_figure(path: Path | None, shape: dict) -> tuple[float | None, str]:
    """Optimus's tokens/s in bench/mfu.py's JSON at `MODE` and this shape, or why not."""
    if path is None:
        return None, "no --mfu-json"
    if not path.exists():
        return None, f"{path} does not exist (bench/mfu.py did not run, or not to the end)"
    info = json.loads(path.read_text())
    if info.get("shape") != shape:
        return None, f"{path} measured another shape ({info.get('shape')})"
    entry = info.get("modes", {}).get(MODE)
    if entry is None:
        why = info.get("failed", {}).get(MODE) or info.get("skipped", {}).get(MODE)
        return None, f"{path} has no {MODE} figure" + (f" ({why})" if why else "")
    return entry["optimus"]["tokens_per_s"], f"bench/mfu.py's {MODE}, {path.name}"


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    on_gpu = args.device == "cuda"
    compile = on_gpu if args.compile is None else args.compile
    model = SMALL if args.tiny else yaml.safe_load(
        (REPO / "jobs" / "mula-1b.yaml").read_text())["model"]
    seq, batch = (256, 4) if args.tiny else (2048, 4)
    steps = args.steps or (10 if on_gpu else 3)
    warmup = (3 if on_gpu else 1) if args.warmup is None else args.warmup
    bench = Bench(device=torch.device(args.device), model=model, seq_len=seq, batch=batch,
                  steps=steps, warmup=warmup, recipe="tensorwise", num_workers=0,
                  log_every=args.log_every)
    cfg = validate_job(bench.job(Mode(compile, "bf16", "none"), "unused"), world=1).model
    flops = flops_per_token(cfg, seq)
    name = device_name(bench.device)
    peak = peak_flops(name, args.peak_tflops, "bf16")
    shape = header_shape(bench)
    print(f"torchtitan {VERSION} peer on {name}, torch {torch.__version__}: "
          f"{'compiled' if compile else 'eager'} bf16, {args.attention} attention, "
          f"{cfg.n_layers} layers of {cfg.dim}, "
          f"seq {seq} x batch {batch}; {steps} steps, first {warmup} dropped, the last closes "
          "the window", flush=True)

    if args.attention == "flex" and flex_problem(bench.device):
        raise SystemExit(f"--attention flex: {flex_problem(bench.device)}")
    side = peer_side(bench, compile, args.attention)
    step = side["step_s"]
    tokens_per_s = bench.tokens_per_step / step
    achieved = flops * tokens_per_s
    mfu = achieved / peak if peak else None
    for line in side["shims"]:
        print(f"shim: {line}")
    print(f"torchtitan's model: {side['params']:,} parameters, as Optimus's", flush=True)
    print(f"torchtitan: {tokens_per_s:,.0f} tok/s, {flop_rate(achieved / 1e12)}, MFU "
          + (f"{mfu:.1%} of {peak / 1e12:.0f} TFLOP/s" if mfu else "n/a (no peak for this "
             "device)") + f"; step {step * 1e3:.1f} ms; first loss {side['first_loss']:.4f}; "
          f"synchronisations per unlogged step {syncs_text(side['syncs'])}", flush=True)
    ours, source = optimus_figure(args.mfu_json, shape)
    ratio = ours / tokens_per_s if ours else None
    if ratio is None:
        print(f"Optimus / torchtitan: n/a ({source})")
    else:
        judged = (f"target >= {RATIO_TARGET:.2f}: {'met' if ratio >= RATIO_TARGET else 'MISSED'}"
                  if on_gpu else "on a CPU recorded, not judged")
        print(f"Optimus / torchtitan: {ratio:.3f} (Optimus {ours:,.0f} tok/s from {source}; "
              f"{judged})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "version": VERSION, "torch": torch.__version__, "device": name, "shape": shape,
            "mode": MODE if compile else "eager-bf16-none", "flops_per_token": flops,
            "peak_bf16_tflops": peak / 1e12 if peak else None, "tokens_per_s": tokens_per_s,
            "tflops": achieved / 1e12, "mfu": mfu, "optimus_tokens_per_s": ours,
            "optimus_from": source, "ratio": ratio, "ratio_target": RATIO_TARGET,
            **side}, indent=1) + "\n")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="bench/mfu.py's small shape (dim 256, "
                   "4 layers, 4 x 256 tokens a step): for a CPU")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="torch.compile the blocks and the loss (default: on cuda only)")
    p.add_argument("--attention", choices=["sdpa", "flex"], default="sdpa",
                   help="torchtitan's ScaledDotProductAttention (causal: the kernel Optimus "
                   "uses; default) or its FlexAttention (llama3's own default; torch 2.12+)")
    p.add_argument("--steps", type=int, help="steps a run (default 10 cuda, 3 cpu)")
    p.add_argument("--warmup", type=int, help="first steps dropped (default 3 cuda, 1 cpu)")
    p.add_argument("--log-every", type=int, default=3, help="the loss read every N steps, "
                   "as bench/mfu.py does")
    p.add_argument("--mfu-json", type=Path, help="bench/mfu.py's JSON: Optimus's figure")
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads on a CPU")
    p.add_argument("--peak-tflops", type=float, help="override the peak table")
    p.add_argument("--out", type=Path, help="JSON of every figure")
    return p.parse_args()


if __name__ == "__main__":
    main()
