# The README's two commands:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# This machine has a local CPU build of torch 2.13.0; a looser spec would pull a
# multi-GB CUDA build.  pyproject.toml states the real compatible range for users.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dashboard,wandb,tensorboard,mlflow,test

.PHONY: setup setup-test chromium demo test test-fast bench bench-dashboard clean
setup: $(VENV)/.installed
# the test set-up adds the RL frameworks whose hooks the tests exercise (about 1 min, CPU-only, torch untouched)
setup-test: $(VENV)/.installed $(VENV)/.frameworks chromium

# the dashboard's real-browser test drives Debian's Chromium over the DevTools protocol
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]" "$(TORCH_SPEC)"
	touch $@

$(VENV)/.frameworks: $(VENV)/.installed requirements-frameworks.txt scripts/install_frameworks.sh
	TORCH_SPEC="$(TORCH_SPEC)" bash scripts/install_frameworks.sh $(BIN)/python
	touch $@

# the short study: uncorrected NVFP4 sampler vs TRIAGE, side by side (docs/study.md); run again, it starts afresh
# (--force: the previous runs are moved to runs/demo/runs/<arm>-s<seed>.replaced-<time>, one line each says so)
demo: setup
	$(BIN)/triage-monitor study --quick --jobs 2 --out runs/demo --force

test: setup-test
	$(BIN)/ruff check triage_monitor hooks dashboards benchmarks tests scripts
	$(BIN)/mypy triage_monitor
	$(BIN)/python -m pytest -q

# the fast tests only (no study runs, frameworks, browser or spawned processes): a few minutes
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not framework and not browser and not multiprocess"

bench: setup
	$(BIN)/python benchmarks/bench_core.py

bench-dashboard: setup chromium
	$(BIN)/python benchmarks/bench_dashboard.py

# wheels the GPU kit carries (scripts/gpu_kit.sh, docs/metrics.md#the-gpu-kit): the GPU machine has no package
# registry and no plotly, which only the optional study.html needs.  Pure Python, the version the tests use here,
# into .whl/ (git-ignored: name it in the device call's carry); the kit installs it with pip --no-index
.PHONY: gpu-wheels
gpu-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "plotly==7.1.0"
	du -sh .whl

clean:
	rm -rf $(VENV) runs build *.egg-info
