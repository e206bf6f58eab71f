# The project's entry points. `make demo` runs the main job on the embedded default (the cpu
# target with the generated model); `make test` runs every test, as CI does.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TARGET ?=
BASE ?=
STAMP := $(VENV)/.installed

.PHONY: venv engine image demo demo-model up down smoke release test test-fast flakes fuzz lint schema derived clean help

help:
	@$(PY) build.py --help 2>/dev/null || echo "run 'make venv' first"

# The orchestrator's dependencies: exactly requirements.lock (made from requirements.in by `build.py lock
# --host-tool`), every file checked against its hashes.
$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

# A Docker engine and Compose v2; idempotent, about a second when all is there. Base images are made
# by the build that needs them.
engine: $(STAMP)
	$(PY) build.py engine

image: engine
	$(PY) build.py $(if $(BASE),--base $(BASE),) image $(if $(TARGET),--target $(TARGET),)

# The main job on the embedded default: the cpu image, the generated model, the default profile,
# its smoke checks and a report under reports/latest/.
demo: engine
	$(PY) build.py run --target cpu --profile default

# Train the shipped demo model (docker/demo-model) again, in the cpu image; builds never train it.
demo-model: engine
	$(PY) build.py demo-model

up: engine
	$(PY) build.py up $(or $(PROFILE),default) $(if $(TARGET),--target $(TARGET),)

down: $(STAMP)
	$(PY) build.py down

smoke: $(STAMP)
	$(PY) build.py smoke $(or $(PROFILE),default) $(if $(TARGET),--target $(TARGET),)

release: $(STAMP)
	$(PY) build.py release $(if $(TARGET),--target $(TARGET),)

schema: $(STAMP)
	$(PY) build.py schema > images.schema.json

# What docs/profiles.md and compose/ derive from images.yaml and the knob table (a test keeps them current).
derived: $(STAMP)
	$(PY) build.py derive

# Parallel workers (pytest-xdist): each module is one worker's (its module-wide server boots once), each worker has
# its own Compose project and port, and builds of one tag wait for each other machine-wide. WORKERS=0: one process.
WORKERS ?= 2
XDIST = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadgroup)

# The rerun rule (tests/summary_lines.py): a failed test runs once more; one that passes only then ends the run with a
# FLAKY: line (a bug to fix next) and the run passes; one that fails twice fails it. RERUNS=0: none.
RERUNS ?= 1

# --durations: CI's log names the 25 slowest tests, what to look at first when the run nears its 35 minutes.
test: lint
	$(PY) build.py engine --test-tools
	$(PY) -m pytest --durations=25 --reruns $(RERUNS) $(XDIST)

# test-fast's tests wait on subprocesses, sockets and deadlines more than they compute: four workers even on two cores
# (measured on a machine of two: 87 s with two workers, 61 s with four). FAST_WORKERS=2 for two.
FAST_WORKERS ?= 4
test-fast: lint
	$(PY) -m pytest -m "not slow" --reruns $(RERUNS) $(if $(filter 0,$(FAST_WORKERS)),,-n $(FAST_WORKERS) --dist loadgroup)

# The flake finder: TESTS (default: the whole suite) ROUNDS times in a row, the last LOADED of them beside stress-ng,
# no reruns; prints every test that ever failed, with its failure (bench/flakes.py).
TESTS ?=
ROUNDS ?= 3
LOADED ?= 1
flakes: $(STAMP)
	$(PY) build.py engine --test-tools
	$(PY) bench/flakes.py --rounds $(ROUNDS) --loaded $(LOADED) --workers $(WORKERS) $(TESTS)

# The fuzz suite's long profile (bench/fuzz.py): tests/test_fuzz.py with fresh random inputs, round after round, for
# MINUTES; prints each finding with the input it shrank to. `make test` runs the same targets on fixed inputs.
MINUTES ?= 10
fuzz: $(STAMP)
	$(PY) bench/fuzz.py --minutes $(MINUTES)

# The whole tree through ruff and mypy (pyproject.toml configures both); the Dockerfile through hadolint in the tests.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

clean:
	rm -rf .cache logs reports
