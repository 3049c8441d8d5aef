#!/usr/bin/env bash
# Every benchmark that needs a GPU (MFU and its peer, the MoE layer, checkpoints, the planner's
# memory), on one H100 or H200, in one command of at most 9 minutes (a device machine allows 10
# a command, and 15 of device time a lease, the machine's start included).
#
# First, bench/gpu_check.py tries on this machine each piece the parts need (the training
# path's imports and the private or recent torch names it uses, a float8 matmul, a compiled
# kernel, the grouped GEMM, DCP's stager, the memory tracker, the sync debug mode, torchtitan's
# import: the image's torch is 2.11, the project pins 2.13) and prints one line per part or mfu
# mode that cannot run, and why; the rest then run, the key figures' parts first:
#
#   part                                          time limit  what it holds
#   bench/gpu_check.py                                  60 s   a compile of one tiny kernel
#   mfu: bench/mfu.py --device cuda, compiled          210 s   key: bf16 and float8, no
#        bf16 and float8 (no recompute)                        recompute; 4 runs of 10 steps
#                                                               (Optimus and the plain loop),
#                                                               their syncs per step counted;
#                                                               3 draws of the 1.1B weights on
#                                                               the CPU (~5 s each); 4 compiles
#                                                               (~40 s the first, less after)
#   torchtitan: bench/torchtitan_peer.py               150 s   the peer: torchtitan 0.3.0's
#                                                               llama3 at the same shape,
#                                                               compiled bf16, 10 steps; its
#                                                               ratio to mfu's Optimus figure
#   gemm_sweep: bench/gemm_sweep.py                     90 s   the planner's matmul rates:
#                                                               729 shapes (m, n, k from 128
#                                                               to 32,768) in bf16 and float8,
#                                                               attention at the job files'
#                                                               lengths; rates.json, the table
#                                                               a machine profile loads
#   profile: bench/gpu_profile.py, compiled bf16       100 s   where the trainer's step differs
#                                                               from the plain loop's (profiler)
#   moe: bench/moe.py --device cuda                     90 s   Mula-7B-A1B's MoE layer (4,096
#                                                               tokens, bf16) after, before,
#                                                               torchtitan's, dense: time, bytes,
#                                                               ops, memory; EP 2/4 all-to-all
#                                                               bytes (4 gloo CPU processes); a
#                                                               4-layer training step, bf16 and
#                                                               float8 experts (2 runs of 10)
#   mfu_rest: bench/mfu.py, the six other modes        300 s   issue 16: recompute op, eager
#   checkpoint: bench/checkpoint.py --rounds 1          75 s   ~300 MB of state, 25 timed writes
#   planner_memory: bench/planner_memory.py             40 s   7 one-step layouts of a 170M
#                                                               model: the planner's memory
#                                                               prediction vs max_memory_allocated
#   pip install, nvidia-smi, versions                  ~15 s
#
# The limits add up to more than 9 minutes: the command keeps to GPU_DEADLINE_S (525 s from its
# start, default) by cutting each part's limit to the time left, and leaves out (recorded as
# such) a part that would have under 30 s. In 15 minutes of device time, one full call (with
# the machine's start) and a short second one for what it left out (GPU_PARTS="mfu_rest checkpoint
# planner_memory", say) fit.
#
# A part that runs past its limit is stopped and the rest still run; bench/mfu.py writes its
# JSON after every mode, so a cut run keeps the modes it finished.
#
# Output, in DIR (the first argument, else $OUT, else bench/gpu-out): gpu-results.json (every
# figure: the key figures in "key", mfu.py's JSONs, the peer's, the other parts' logs, versions,
# each part's exit status and time), gpu.log (all of stdout and stderr), parts.tar (each
# part's NAME.log, mfu.json, mfu_rest.json, torchtitan.json, tests.log), profile-traces.tar
# and rates.json (the GEMM sweep's table: copy it beside machines.yaml and point the profile's
# `rates:` at it, docs/planner.md): five files, within the 8 a device call returns. Without a GPU,
# `python bench/planner_memory.py --device cpu` runs the planner part's CPU fallback (the same
# layouts on a small model, the tracked peak), and `python bench/torchtitan_peer.py --device
# cpu --tiny` the peer's path.
#
# Python packages. The device machines' image already has torch, numpy, pyyaml, click, rich
# (markdown-it-py, mdurl, pygments) and prometheus-client (/work/.library/device/KINDS.md);
# the rest travel as wheels in .whl/, made here, on a machine with pip and a network, by
#     make gpu-wheels
# which runs, for CPython 3.12 on manylinux x86-64:
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#       --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#       torchao==0.18.0 hiredis==3.5.0 redis==8.1.0 tenacity==9.2.1 pydantic==2.14.3 \
#       pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 torchdata==0.11.0 \
#       torchtitan==0.3.0 spmd-types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0
# (the last four: the torchtitan peer's import path, bench/torchtitan_peer.py; the image has
# the rest of it, triton included)
# This script installs whatever is in .whl/ into /tmp/site (no index, no dependencies) and puts
# it and the repo on PYTHONPATH; nothing is installed into the image's own environment.
#
# Run on the device machine, with .whl carried:
#     OPTIMUS_COMMIT=<this checkout's commit> [GPU_TESTS=1] bash bench/gpu.sh
# (the copy there has no .git, so the commit is passed in to be recorded).

set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-${OUT:-$REPO/bench/gpu-out}}
WITH_TESTS=${GPU_TESTS:-0}
# GPU_PARTS: which parts run (default all, in this order); e.g. GPU_PARTS="checkpoint profile"
# re-runs two.
PARTS=" ${GPU_PARTS:-mfu torchtitan gemm_sweep profile moe mfu_rest checkpoint planner_memory} "
DEADLINE=${GPU_DEADLINE_S:-525}  # seconds from the start by which every part has ended
KEY_MODES=",compiled-bf16-none,compiled-float8-none,"  # the mfu part's; the rest: mfu_rest
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-$REPO/.whl}  # the carried wheels (a test points this at an empty folder)
mkdir -p "$DIR"
cd "$REPO" || exit 1
exec > >(tee -a "$DIR/gpu.log") 2>&1

die() {
  echo "gpu.sh: $*" >&2
  exit 1
}

install_wheels() {
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    local count
    count=$(find "$WHEELS" -type f -name '*.whl' | wc -l)
    echo "installing $count wheels from $WHEELS into /tmp/site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$WHEELS"/*.whl || die "pip could not install the wheels in $WHEELS"
    export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "no .whl folder: using the packages this Python already has"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  fi
}

check_gpu() {
  command -v nvidia-smi >/dev/null || die "no nvidia-smi: this machine has no NVIDIA GPU"
  # One line per part (or mfu mode) that cannot run on this torch and GPU, and why; the rest run.
  if ! timeout -k 5 60 "$PYTHON" bench/gpu_check.py "$DIR"; then
    echo "bench/gpu_check.py failed (above): every part and mode is tried"
    echo "compiled-bf16-none,compiled-float8-none,compiled-bf16-op,compiled-float8-op,eager-bf16-none,eager-float8-none,eager-bf16-op,eager-float8-op" >"$DIR/mfu_modes.txt"
    : >"$DIR/skip_parts.txt"
    echo '{"failed": true}' >"$DIR/check.json"
  fi
}

# part NAME LIMIT_S COMMAND...: run one part under a time limit (cut to what is left before
# DEADLINE), its log in $DIR/NAME.log.
part() {
  local name=$1 limit=$2
  shift 2
  [[ $PARTS == *" $name "* ]] || return 0
  if grep -qx "$name" "$DIR/skip_parts.txt"; then
    echo
    echo "=== $name: left out (bench/gpu_check.py says why, at the top)"
    echo "$name skipped 0" >>"$DIR/parts.txt"
    return
  fi
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo
    echo "=== $name: left out: ${left} s left of GPU_DEADLINE_S=${DEADLINE} (GPU_PARTS=$name runs it)"
    echo "$name notime 0" >>"$DIR/parts.txt"
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo
  echo "=== $name (limit ${limit} s): $*"
  local started=$SECONDS
  PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$@" 2>&1 | tee "$DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - started)) s"
  echo "$name $rc $((SECONDS - started))" >>"$DIR/parts.txt"
}

install_wheels
rm -f "$DIR/parts.txt" "$DIR/mfu.json" "$DIR/mfu_rest.json" "$DIR/torchtitan.json" "$DIR/rates.json"
check_gpu
nvidia-smi | tee "$DIR/nvidia-smi.txt"

MODES= REST=
IFS=, read -ra RUNNABLE <<<"$(tr -d '\n' <"$DIR/mfu_modes.txt")"
for mode in "${RUNNABLE[@]}"; do
  if [[ $KEY_MODES == *",$mode,"* ]]; then MODES+=${MODES:+,}$mode; else REST+=${REST:+,}$mode; fi
done
[ -n "$MODES" ] || echo "mfu" >>"$DIR/skip_parts.txt"
[ -n "$REST" ] || echo "mfu_rest" >>"$DIR/skip_parts.txt"
# The peer's ratio needs Optimus's compiled bf16 figure: without the mfu part, no ratio.
[[ $PARTS != *" torchtitan "* || $MODES == *compiled-bf16-none* ]] ||
  echo "torchtitan: no Optimus figure to set it beside (mfu's compiled-bf16-none cannot run)"
# GPU_TESTS=1: the training path's CPU tests on this machine's torch, beside the parts, on the
# second half of the cores (the parts keep the first half); tests.log holds the outcome. This is
# how the torch 2.11 differences in docs/gpu.md were found. It loads the machine: the
# parts' figures are then a first reading, not a quiet-machine measurement.
TESTS_PID=
if [ "$WITH_TESTS" = 1 ] && command -v taskset >/dev/null; then
  half=$(( $(nproc) / 2 ))
  CUDA_VISIBLE_DEVICES= timeout -k 5 450 taskset -c "$half-$(( $(nproc) - 1 ))" "$PYTHON" -m pytest \
    -p no:cacheprovider -o addopts= -n "$half" -q -rfE --tb=short --timeout 200 \
    tests/test_model.py tests/test_train.py tests/test_parallel_matrix.py tests/test_pipeline.py \
    tests/test_tensor_parallel.py tests/test_moe.py tests/test_precision.py \
    tests/test_recompute.py tests/test_param_gather.py tests/test_checkpoint_resume.py \
    tests/test_hf.py tests/test_eval.py tests/test_memory_snapshots.py tests/test_clean_exit.py \
    tests/test_float8.py tests/test_planner.py tests/test_runtime.py tests/test_config.py \
    tests/test_data.py tests/test_mixture.py tests/test_torch_compat.py tests/test_stability.py \
    tests/test_z_loss.py >"$DIR/tests.log" 2>&1 &
  TESTS_PID=$!
  taskset -pc "0-$(( half - 1 ))" $$ >/dev/null
  echo "GPU_TESTS=1: the training path's CPU tests run on cores $half and up (tests.log)"
fi

part mfu 210 "$PYTHON" bench/mfu.py --device cuda --steps 10 --warmup 3 --modes "$MODES" \
  --out "$DIR/mfu.json"
part torchtitan 150 "$PYTHON" bench/torchtitan_peer.py --device cuda --steps 10 --warmup 3 \
  --mfu-json "$DIR/mfu.json" --out "$DIR/torchtitan.json"
part gemm_sweep 90 "$PYTHON" bench/gemm_sweep.py --device cuda --out "$DIR/rates.json"
part profile 100 "$PYTHON" bench/gpu_profile.py --device cuda --modes compiled-bf16-none \
  --trace "$DIR/traces"
if [ -d "$DIR/traces" ]; then  # one file back, not two (a device call returns at most 8)
  tar -cf "$DIR/profile-traces.tar" -C "$DIR" traces && rm -rf "$DIR/traces"
fi
part moe 90 "$PYTHON" bench/moe.py --device cuda
part mfu_rest 300 "$PYTHON" bench/mfu.py --device cuda --steps 10 --warmup 3 --modes "$REST" \
  --out "$DIR/mfu_rest.json"
part checkpoint 75 "$PYTHON" bench/checkpoint.py --device cuda --rounds 1
part planner_memory 40 "$PYTHON" bench/planner_memory.py --device cuda

if [ -n "$TESTS_PID" ]; then
  wait "$TESTS_PID"
  echo "tests (GPU_TESTS=1): $(tail -1 "$DIR/tests.log")"
fi

"$PYTHON" - "$DIR" <<'EOF'
"""Gather every part into one JSON: the key figures first, mfu.py's and the peer's JSONs,
the other parts' logs, the versions."""
import json
import os
import sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
sys.path.insert(0, os.getcwd())
from bench.mfu_report import key_figures  # noqa: E402

parts = {}
for line in (out / "parts.txt").read_text().splitlines():
    name, rc, seconds = line.split()
    left_out = rc in ("skipped", "notime")
    parts[name] = {"exit": None if left_out else int(rc), "seconds": int(seconds),
                   "skipped": left_out, "why": {"skipped": "bench/gpu_check.py",
                                                "notime": "no time left"}.get(rc)}


def read(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None


mfu, peer = read("mfu.json"), read("torchtitan.json")
try:  # the key figures; the rest is written whatever happens here
    key = key_figures(mfu or {})
    key.update({"optimus_over_torchtitan": peer and peer["ratio"],
                "torchtitan_tokens_per_s": peer and peer["tokens_per_s"],
                "torchtitan_mfu": peer and peer["mfu"]})
except Exception as e:  # noqa: BLE001
    key = {"error": f"{type(e).__name__}: {e}"}
results = {
    "key": key,
    "torch": torch.__version__, "cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version(),
    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
    "commit": os.environ.get("OPTIMUS_COMMIT", "unknown"),
    "nvidia_smi": (out / "nvidia-smi.txt").read_text(), "parts": parts,
    "check": json.loads((out / "check.json").read_text()),
    "mfu": mfu, "mfu_rest": read("mfu_rest.json"), "torchtitan": peer,
    "rates": read("rates.json"),
    **{f"{n}_log": (out / f"{n}.log").read_text() for n in ("torchtitan", "moe", "checkpoint", "planner_memory", "profile", "gemm_sweep")
       if (out / f"{n}.log").exists()},
}
(out / "gpu-results.json").write_text(json.dumps(results, indent=1) + "\n")
print(f"\nwrote {out / 'gpu-results.json'}: " + ", ".join(
    (f"{n} left out ({p['why']})" if p["skipped"] else f"{n} exit {p['exit']} in {p['seconds']} s")
    for n, p in parts.items()))
print("key: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in key.items()))
EOF
rm -f "$DIR/parts.txt" "$DIR/nvidia-smi.txt" "$DIR/mfu_modes.txt" "$DIR/skip_parts.txt" \
  "$DIR/check.json"
# gpu-results.json holds every figure and log; the parts' own files go back as one tar beside it
# (a device call returns at most 8 files).
loose=()
for f in "$DIR"/*.log "$DIR"/*.json; do
  case ${f##*/} in gpu.log | gpu-results.json | rates.json) ;; *) [ -e "$f" ] && loose+=("${f##*/}") ;; esac
done
if [ ${#loose[@]} -gt 0 ]; then
  tar -cf "$DIR/parts.tar" -C "$DIR" "${loose[@]}" && (cd "$DIR" && rm -f "${loose[@]}")
fi
