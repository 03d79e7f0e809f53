# gpuobj developer entry points. README.md names `make demo` and `make test`;
# both set everything up on a fresh machine (shared virtualenv, control-plane binaries).
PYTHON ?= python3
VENV := .venv/bin/python
TOOLS ?= etcd kubernetes helm prometheus kwok

.PHONY: setup demo test test-unit lint toolchain images dev-cluster-up dev-cluster-down bench bench-scale dashboard gpu-wheels clean

setup:
	@PYTHONPATH=dev $(PYTHON) -m gpuobj_dev.pyenv
	@PYTHONPATH=dev $(PYTHON) -m gpuobj_dev.toolchain ensure $(TOOLS)

demo: setup
	@$(VENV) -m gpuobj_dev.cli demo $(DEMO_ARGS)

# pytest exits 5 when it collects nothing: say so rather than fail obscurely. The images are built
# (first run: ~15 min, cached after) and the node's containerd and crictl (~15 min) before pytest,
# so no test's time limit pays for a first build.
test: setup
	@$(VENV) -m ruff check .
	@$(VENV) -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
	@$(VENV) -m mypy
	@$(VENV) -m gpuobj_dev.images --when-possible
	@$(VENV) -m gpuobj_dev.node prepare --when-possible
	@$(VENV) -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

test-unit: setup
	@$(VENV) -m pytest -m "not cluster and not nixl and not node" $(PYTEST_ARGS)

lint: setup
	@$(VENV) -m ruff check .
	@$(VENV) -m ruff format --check .

toolchain:
	@PYTHONPATH=dev $(PYTHON) -m gpuobj_dev.toolchain ensure $(TOOLS)

# The Dockerfile's targets built with buildah against local stand-in bases (needs root; see README).
images: setup
	@$(VENV) -m gpuobj_dev.images $(IMAGES)

dev-cluster-up: setup
	@$(VENV) -m gpuobj_dev.cli dev-cluster up

dev-cluster-down:
	@$(VENV) -m gpuobj_dev.cli dev-cluster down

# Benchmarks print tables with ratios against baselines (raw NIXL, memcpy, Ray RDT). Ray is large and
# only a baseline: it goes into its own cached folder, on PYTHONPATH for the benchmarks alone.
RAY_DIR := $(HOME)/.cache/gpuobj/bench/ray-2.60.0
bench: setup
	@test -f $(RAY_DIR)/.complete || ($(VENV) -m pip --version >/dev/null 2>&1 && PIP="$(VENV) -m pip" || PIP="$$(PYTHONPATH=dev $(PYTHON) -m gpuobj_dev.pyenv --print-shared)/bin/python -m pip"; \
	  $$PIP install --quiet --target $(RAY_DIR) "ray==2.60.0" && touch $(RAY_DIR)/.complete)
	@PYTHONPATH=$(RAY_DIR) $(VENV) bench/fetch_throughput.py
	@PYTHONPATH=$(RAY_DIR) $(VENV) bench/lifecycle.py
	@PYTHONPATH=$(RAY_DIR) $(VENV) bench/weight_sync.py

# The operator at cluster scale (docs/scale.md): kwok nodes, an agent fleet at their pod IPs, every
# scenario of one run; needs root (the pod CIDR becomes a local route). BENCH_SCALE_ARGS adds options.
bench-scale: setup
	@PYTHONPATH=dev $(PYTHON) -m gpuobj_dev.toolchain ensure kwok
	@$(VENV) bench/scale.py $(BENCH_SCALE_ARGS)

# Regenerate the committed dashboard JSON and alert rules from Python (tests check they are current).
dashboard: setup
	@$(VENV) -m gpuobj_dev.observability.dashboard --write
	@$(VENV) -m gpuobj_dev.observability.rules --write

# The wheels the GPU check (dev/gpu_check.sh, docs/gpu.md) installs on a bare GPU machine that has no network;
# prints their sizes and the total with the working tree, which must stay within the 64 MiB the device tool carries.
gpu-wheels: setup
	@$(VENV) -m gpuobj_dev.gpu_wheels $(GPU_WHEELS_ARGS)

clean:
	rm -rf .venv .pytest_cache .ruff_cache
