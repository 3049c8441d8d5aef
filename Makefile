# The quick start: `make demo` trains the tiny job end to end, `make test` runs the tests.
# Both build .venv from nothing on first use: torch 2.13.0 from the machine's local CPU build
# (never a CUDA build), then Optimus itself with its dev extras; `make test` also installs
# promtool (Debian's prometheus package) and Slurm (slurmctld, slurmd, munge) when missing.

VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin

.PHONY: venv promtool slurm demo test lint bench gpu-wheels clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/python -c "import torch, sys; sys.exit('a CUDA build of torch was installed; remove .venv and install torch==2.13.0 (CPU)' if torch.version.cuda else 0)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

demo: venv
	rm -rf runs/tiny-gpt   # a fresh run each time, rather than resuming the last one
	$(BIN)/optimus run jobs/tiny-gpt.yaml --nodes 2 --ranks-per-node 1 --spares 1

# promtool checks the alert rules (tests/test_monitoring.py): Debian's prometheus package.
promtool:
	@command -v promtool >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && \
	    $$SUDO apt-get install -y --no-install-recommends prometheus >/dev/null; }; }
	@command -v promtool >/dev/null || { echo "promtool is missing: apt-get install prometheus"; exit 1; }

# A real Slurm for tests/test_slurm.py, which runs a private single-host cluster (three slurmd):
# Debian's slurmctld, slurmd, slurm-client and munge. The packages' own services stay unused.
SLURM_BINS := slurmctld slurmd sbatch munged
slurm:
	@for b in $(SLURM_BINS); do command -v $$b >/dev/null || missing=1; done; \
	[ -z "$$missing" ] || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); PKGS="slurmctld slurmd slurm-client munge"; \
	  $$SUDO apt-get install -y --no-install-recommends $$PKGS >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && \
	    $$SUDO apt-get install -y --no-install-recommends $$PKGS >/dev/null; }; }
	@for b in $(SLURM_BINS); do command -v $$b >/dev/null || \
	  { echo "$$b is missing: apt-get install slurmctld slurmd slurm-client munge"; exit 1; }; done

test: venv promtool slurm
	$(BIN)/ruff check .
	$(BIN)/pytest -q

bench: venv
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/moe.py

# Wheels for bench/gpu.sh on a device machine (CPython 3.12, manylinux x86-64, no network there):
# the packages Optimus needs that its image lacks (/work/.library/device/KINDS.md lists what it
# has: torch, numpy, pyyaml, click, rich and its deps, prometheus-client). Versions as in .venv.
GPU_WHEELS := torchao==0.18.0 hiredis==3.5.0 redis==8.1.0 tenacity==9.2.1 pydantic==2.14.3 \
	pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 torchdata==0.11.0
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
	manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64

gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) -d .whl $(GPU_WHEELS)
	@ls .whl; du -sh .whl

clean:
	rm -rf $(VENV) runs .pytest_cache
