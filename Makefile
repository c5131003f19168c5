# Two commands on a fresh clone: `make bench` and `make test`. Both set themselves up first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch is installed first and pinned for every later install, so pip can never swap in another build.
TORCH  := torch==2.13.0

.PHONY: setup test bench bench-quick perf faults-report mutation lint clean

setup: $(VENV)/.installed

$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH)
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(PIP) install --quiet -c $(VENV)/constraints.txt -e '.[dev]'
	touch $@

test: setup
	$(PY) -m pytest -n auto --dist loadgroup -q

# The main job: every fault x 3 seeds plus the clean matrix, scored; writes results/ (cached per case).
bench: setup
	$(PY) -m harness bench

bench-quick: setup
	$(PY) -m harness bench --quick --out results/quick

perf: setup
	$(PY) -m benchmarks.perf
	$(PY) -m benchmarks.dist_startup
	$(PY) -m benchmarks.detector_overhead

# Every fault's manifest, run and tabulated with its evidence: results/faults.md.
faults-report: setup
	$(PY) -m harness.fault_report

# Not part of CI: the unit tests once per fault, injected; writes results/mutation.md.
mutation: setup
	$(PY) -m harness.mutation

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
