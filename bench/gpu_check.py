"""What of bench/gpu.sh can run on this machine's torch and GPU, asked before anything runs.

    python bench/gpu_check.py DIR

The GPU machines' image carries its own torch (2.11 when this was written), not the 2.13 the
project pins. Rather than trust a version table, each piece a part needs is tried here, on the
device, in a few seconds: the imports of the training path, the names it takes from torch
(some private, some newer than 2.11), a float8 matmul, a compiled kernel, the grouped GEMM and
its rowwise float8 form (training.float8_experts), DCP's async stager and writer process, the
memory tracker, torch's sync debug mode (that it warns on a known synchronisation, or
bench/mfu.py's counts would read 0), a quorum group of replicas that carry on on NCCL (one
member: a step summed in the device's memory, a heal's checksum there), and the torchtitan
peer's import
(bench/torchtitan_peer.py, with its stand-ins for torch 2.11). It prints one line per part (or
mfu mode) that cannot run and why, then one line per fallback taken, and writes for gpu.sh:

    DIR/mfu_modes.txt     the runnable modes of bench/mfu.py, comma-separated (empty: none)
    DIR/skip_parts.txt    one part name a line: the parts gpu.sh leaves out
    DIR/check.json        every probe's outcome, for gpu-results.json

It always exits 0 once it has written these: a part that cannot run is a finding, not a crash.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

PINNED = "2.13"
PARTS = ("mfu", "moe", "checkpoint", "planner_memory")  # the training path's parts
PEER = "torchtitan"  # not the training path: tried on a CUDA machine only

# The names the training path takes from torch that are private or recent: (module, attribute,
# the parts that cannot run without it). A public name torch has had since 2.4 is not listed;
# tests/test_torch_compat.py asserts every listed name is found in torch 2.13.
NAMES = [
    ("torch.distributed.fsdp", "fully_shard", PARTS),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy", PARTS),
    ("torch.distributed.tensor", "distribute_module", PARTS),
    ("torch.nn.utils", "get_total_norm", PARTS),
    ("torch.nn.utils", "clip_grads_with_norm_", PARTS),
    ("torch.accelerator", "current_accelerator", PARTS),
    ("torch.utils.checkpoint", "create_selective_checkpoint_contexts", ("mfu",)),
    ("torch.distributed.checkpoint.state_dict_saver", "AsyncCheckpointerType", ("checkpoint",)),
    ("torch.distributed.checkpoint.staging", "DefaultStager", ("checkpoint",)),
    ("torch.distributed.checkpoint.staging", "StagingOptions", ("checkpoint",)),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo", ("checkpoint",)),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", ("checkpoint",)),
    ("torch.distributed._tools.mem_tracker", "MemTracker", ("planner_memory",)),
    ("torch.distributed.pipelining.schedules", "OVERLAP_F_B", ()),  # pipelines: not on 1 GPU
]


def tail(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[-1][:200] if text else type(e).__name__


def missing_names() -> dict[str, str]:
    """'module.attr' -> why, for each listed name this torch lacks."""
    gone = {}
    for module, attr, _ in NAMES:
        try:
            if not hasattr(importlib.import_module(module), attr):
                gone[f"{module}.{attr}"] = "absent"
        except Exception as e:  # noqa: BLE001 - any import failure is the finding
            gone[f"{module}.{attr}"] = tail(e)
    return gone


def probe_float8() -> str | None:
    """None if a float8 matmul runs here, else why not."""
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"float8 needs compute capability 8.9+ (this GPU is {major}.{minor})"
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torchao.float8 does not import: {tail(e)}"
    try:
        a = torch.randn(16, 32, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(16, 32, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device="cuda")
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return f"torch._scaled_mm fails: {tail(e)}"
    return None


def probe_compile() -> str | None:
    """None if torch.compile builds and runs a kernel on the GPU (Inductor + Triton)."""
    try:
        fn = torch.compile(lambda x: torch.sin(x) * 2 + 1)
        x = torch.ones(64, device="cuda")
        ok = torch.allclose(fn(x), torch.sin(x) * 2 + 1)
        torch.cuda.synchronize()
        return None if ok else "a compiled kernel computed a wrong value"
    except Exception as e:  # noqa: BLE001
        return f"torch.compile fails: {tail(e)}"


def probe_grouped_mm() -> str | None:
    """None if the native grouped GEMM runs; else why (MoE then takes its padded bmm path)."""
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm is absent"
    if torch.cuda.get_device_capability() < (9, 0):
        return "torch._grouped_mm needs sm90+"
    try:
        x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4, 32, 16, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([16, 32, 48, 64], device="cuda", dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return f"torch._grouped_mm fails: {tail(e)}"
    return None


def probe_quorum_group(backend: str = "nccl", device: str = "cuda") -> str | None:
    """None if a quorum group of one member (optimus/parallel/quorum_group.py, as replicas that
    carry on make theirs on `backend`) sums a step's gradients and figures in the device's
    memory, and a heal's checksum computed there equals the same arithmetic on the host; else
    why. (One GPU holds one NCCL rank: a group of two needs two devices.)"""
    try:
        import torch.distributed as dist

        from optimus.contract.records import Quorum
        from optimus.parallel.heal import checksum, device_checksum
        from optimus.parallel.quorum_group import QuorumGroup
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        quorum = Quorum(id=3, members=[0], store_addr="127.0.0.1", store_port=store.port)
        group = QuorumGroup(quorum, replica=0, position=0, backend=backend, timeout_s=60,
                            store=store)
        grads = [torch.full((3,), 0.5, device=device), torch.full((2, 2), -1.0, device=device)]
        reduced = group.reduce(grads, torch.tensor(4.0, device=device),
                               torch.tensor(10.0, device=device), seen=3,
                               word=(1, 0)).apply()
        summed = [float(grads[0][0]), float(grads[1][1, 1]), reduced.tokens(), reduced.loss(),
                  reduced.newest()]
        raw = torch.arange(13, dtype=torch.uint8)
        here = checksum(raw.to(device)).cpu()
        group.close()
    except Exception as e:  # noqa: BLE001
        return f"a quorum group on {backend} fails: {tail(e)}"
    if summed != [0.5, -1.0, 4.0, 2.5, 3]:
        return f"a quorum group on {backend} summed {summed}, not [0.5, -1.0, 4.0, 2.5, 3]"
    if device != "cpu" and not torch.equal(here, device_checksum(raw)):
        return f"a heal's checksum on {device} differs from the host's arithmetic"
    return None


def probe_float8_grouped_mm() -> str | None:
    """None if the rowwise float8 grouped GEMM of training.float8_experts runs here, forward and
    backward, within float8's error of bf16's; else why (the experts then stay in bf16)."""
    try:
        from optimus.models.moe import grouped_mm
        from optimus.parallel.float8_experts import Float8GroupedMM, float8_experts_problem
    except Exception as e:  # noqa: BLE001
        return f"optimus/parallel/float8_experts.py does not import: {tail(e)}"
    problem = float8_experts_problem("rowwise", torch.device("cuda"))
    if problem:
        return problem
    try:
        counts = torch.tensor([40, 0, 70, 18], device="cuda")  # uneven, one expert empty
        x = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = Float8GroupedMM("rowwise")(x, w, counts)
        out.float().square().sum().backward()
        ref = grouped_mm(x.detach(), w.detach(), counts).float()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return f"the rowwise float8 grouped GEMM fails: {tail(e)}"
    error = float((out.detach().float() - ref).norm() / ref.norm())
    if error > 0.1 or w.grad[1].abs().max() != 0:  # e4m3 rounding: about 4% of the norm
        return f"the rowwise float8 grouped GEMM is wrong: {error:.1%} from bf16's"
    return None


def probe_torchtitan() -> tuple[str | None, list[str]]:
    """None if bench/torchtitan_peer.py's torchtitan imports here (else why not), and the
    stand-ins it put into torch for that."""
    try:
        from bench.torchtitan_peer import VERSION, import_torchtitan
        tt, shims = import_torchtitan()
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return f"torchtitan does not import: {tail(e)}", []
    if tt.version != VERSION:
        return f"torchtitan {tt.version} here; the peer is written against {VERSION}", shims
    return None, shims


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "bench" / "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    cannot: dict[str, str] = {}  # part or part/mode -> why
    fallbacks: list[str] = []
    probes: dict[str, str | None] = {}

    version = torch.__version__.split("+")[0]
    if not version.startswith(PINNED):
        fallbacks.append(f"torch {torch.__version__} here; the project pins {PINNED} "
                         "(pyproject): each piece below was tried on this one")
    if not torch.cuda.is_available():
        for part in PARTS:
            cannot[part] = f"torch {torch.__version__} sees no CUDA device"
    else:
        try:
            import optimus.checkpoint.saver  # noqa: F401
            import optimus.train  # noqa: F401
        except Exception as e:  # noqa: BLE001
            for part in PARTS:
                cannot[part] = f"the training path does not import: {tail(e)}"
        gone = missing_names()
        probes["missing_names"] = json.dumps(gone) if gone else None
        for module, attr, parts in NAMES:
            why = gone.get(f"{module}.{attr}")
            for part in parts if why else ():
                cannot.setdefault(part, f"torch lacks {module}.{attr} ({why})")
        if "mfu" not in cannot:
            probes["float8"], probes["compile"] = probe_float8(), probe_compile()
            try:
                from bench.mfu_window import sync_warning_problem
                probes["sync_warnings"] = sync_warning_problem()
            except Exception as e:  # noqa: BLE001
                probes["sync_warnings"] = tail(e)
            if probes["sync_warnings"]:
                fallbacks.append(f"mfu: no synchronisation count: {probes['sync_warnings']}")
        probes["torchtitan"], shims = probe_torchtitan()
        if probes["torchtitan"]:
            cannot[PEER] = probes["torchtitan"]
        elif probes.get("compile"):
            cannot[PEER] = probes["compile"]
        fallbacks += [f"{PEER}: {line}" for line in shims]
        probes["grouped_mm"] = probe_grouped_mm()
        if probes["grouped_mm"]:
            fallbacks.append(f"moe: {probes['grouped_mm']}; the experts take the padded bmm "
                             "path (slower; bench/moe.py's grouped-GEMM figure says so)")
        probes["float8_grouped_mm"] = probe_float8_grouped_mm()
        if probes["float8_grouped_mm"]:
            fallbacks.append(f"moe: no float8 experts: {probes['float8_grouped_mm']}; "
                             "training.float8_experts is refused here")
        probes["quorum_group"] = probe_quorum_group()
        if probes["quorum_group"]:
            fallbacks.append(f"replicas: {probes['quorum_group']} (supervision.on_replica_loss: "
                             "continue cannot run on nccl here)")
        try:
            from optimus.checkpoint import writer_process
            if writer_process._executor is None:
                fallbacks.append("checkpoint: DCP's writer process lacks the private names "
                                 "Optimus quiets it with; it runs as torch has it")
        except Exception:  # noqa: BLE001 - the import failure is already a line above
            pass

    try:
        from bench.mfu import gpu_modes
        all_modes = gpu_modes()
    except Exception as e:  # noqa: BLE001 - bench/mfu.py imports the training path
        all_modes = []
        cannot.setdefault("mfu", f"bench/mfu.py does not import: {tail(e)}")
    modes = []
    for mode in all_modes:
        why = cannot.get("mfu")
        if not why and mode.precision == "float8":
            why = probes.get("float8")
        if not why and mode.compile:
            why = probes.get("compile")
        if why and "mfu" not in cannot:
            cannot[f"mfu/{mode.name}"] = why
        elif not why:
            modes.append(mode.name)
    if not modes:
        cannot.setdefault("mfu", "no mode of it can run")

    for what, why in cannot.items():
        print(f"cannot run: {what}: {why}")
    for line in fallbacks:
        print(f"fallback: {line}")
    parts = PARTS + ((PEER,) if torch.cuda.is_available() else ())
    runnable = [p for p in parts if p not in cannot]
    print(f"runs: {', '.join(runnable) or 'nothing'}"
          + (f" (mfu modes: {', '.join(modes)})" if "mfu" in runnable else ""))
    (out / "mfu_modes.txt").write_text(",".join(modes) + "\n")
    (out / "skip_parts.txt").write_text("".join(f"{p}\n" for p in parts if p in cannot))
    (out / "check.json").write_text(json.dumps(
        {"torch": torch.__version__, "cannot": cannot, "fallbacks": fallbacks,
         "probes": probes, "mfu_modes": modes}, indent=1) + "\n")


if __name__ == "__main__":
    main()
