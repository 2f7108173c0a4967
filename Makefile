# Two entry points: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-long clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# The CPU build of torch 2.13.0 (a plain `torch` would pull a multi-GB CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	# Real Horovod for tests/frontends/test_horovod.py, where ../shared/wheels holds the wheel (CI does);
	# without it those tests skip. Its deps (cloudpickle, psutil, pyyaml, packaging, cffi) never touch torch.
	if ls ../shared/wheels/horovod-*.whl >/dev/null 2>&1; then \
	  $(PY) -m pip install -q ../shared/wheels/horovod-*.whl; fi
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gradzip bench --preset demo

# CI's run: two workers (a test file stays on one, so its module fixtures run once), the tests
# marked `long` left out, and the 15 slowest printed so that the budget (4 minutes) stays visible.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --durations=15

test: $(STAMP)
	$(PYTEST) -m "not long"

# What CI's budget leaves out: the AOT compile of every kernel, the GPU suite's smoke run,
# 8-rank trainings, the bench's accuracy runs and the larger property runs.
test-long: $(STAMP)
	$(PYTEST) -m long

clean:
	rm -rf $(VENV) build dist *.egg-info bench_out
