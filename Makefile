# Two commands on a fresh machine: `make demo` and `make test` (both install first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dpsweep-installed
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: install demo test test-fast lint data chromium bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dpsweep demo

# Two xdist workers: the system tier's modules mostly wait (for Ray, for a sweep's processes)
# while the unit and contract modules are one busy core; tests/conftest.py keeps each module on
# one worker and the fault chain's modules, which share session state, together.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
		--durations=15

# The fast loop while editing: the unit tier alone (no process, no Ray, no sweep; enforced by
# tests/tiers.py), stopping at the first failure, in under 3 minutes on 2 cores. `make test`
# (every tier) is the check before a commit and what CI runs (docs/design.md, "Test tiers").
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup \
		--no-loadscope-reorder --durations=5 tests/unit

lint: $(STAMP)
	$(BIN)/ruff check .

# Full Fashion-MNIST from Debian (60k/10k) into /usr/share/datasets/fashion-mnist.
data:
	@if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then \
		echo "fashion-mnist: already in /usr/share/datasets/fashion-mnist"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q dataset-fashion-mnist; \
	else \
		echo "no apt-get: fashion-mnist will be downloaded by torchvision on first use"; \
	fi

# Debian's chromium, for the report's browser test (tests/contract/test_report_chromium.py,
# which fails in CI without it and skips elsewhere).
chromium:
	@if command -v chromium >/dev/null 2>&1; then \
		echo "chromium: already installed"; \
	else \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; \
	fi

# Every benchmark, one after another, each writing bench/results/<name>.json (about 2 hours on
# 2 cores; see README "Benchmarks"). Fashion-MNIST benches need `make data`.
BENCHES := step_time epoch_time accountant_time sweep_overhead demo_phases search_ranges audit_fmnist canary_fmnist faults two_node
bench: $(STAMP)
	@for b in $(BENCHES); do echo "== bench/$$b"; $(BIN)/python -m bench.$$b || exit 1; done

# What bench/gpu_check.sh carries to a lent GPU machine, both git-ignored (bench/gpu_check.py):
# the pure-Python wheels its checks import there, at the versions installed here (PyTorch,
# numpy, scipy, pandas, pyarrow and scikit-learn are there already), and Fashion-MNIST's IDX
# files from `make data`. Then: carry=["bench/wheels", "bench/data"].
GPU_WHEELS := opacus prv-accountant dp-accounting absl-py attrs tomli-w opt-einsum
.PHONY: gpu-carry
gpu-carry: $(STAMP) data
	mkdir -p bench/wheels bench/data/fashion-mnist
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --dest bench/wheels \
		$$($(BIN)/python -c 'import sys; from importlib.metadata import version; \
			print(*(f"{n}=={version(n)}" for n in sys.argv[1:]))' $(GPU_WHEELS))
	cp /usr/share/datasets/fashion-mnist/*-ubyte.gz bench/data/fashion-mnist/
	du -sh bench/wheels bench/data

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
