# Tessel Planner: `make run` sets everything up and runs the main job; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TESSEL := $(VENV)/bin/tessel
STAMP := $(VENV)/.tessel-installed

.PHONY: setup browser run serve demo test lint bench clean

setup: $(STAMP)

# torch is installed first from the pinned constraint so no other package can pull a CUDA build.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# Debian's Chromium for the browser tests (playwright cannot download a browser here).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian chromium for browser tests"; \
	  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
	  echo "warning: could not install chromium; browser tests will be skipped"; }

# the main job: the planner app on GPT-2 in the browser; without a display (SSH, CI) the headless
# demo instead (plan GPT-2 on 4 CPU ranks, launch it on Ray actors, report predicted vs measured)
run: setup browser
	@if [ -n "$$DISPLAY$$WAYLAND_DISPLAY" ] || [ "$$(uname)" = Darwin ]; then \
	  $(TESSEL) serve --open; else echo "no display: running the headless demo (\`make serve\` starts the app)"; $(TESSEL) demo; fi

serve: setup
	$(TESSEL) serve --open

demo: setup
	$(TESSEL) demo

# The suite in two parts: TEST_WORKERS processes (pytest-xdist), each test file on one of them
# (its module fixtures, a Ray cluster or a process pool, built once), then the `serial` tests
# alone (they compare measured times or load the machine on purpose). Plain `pytest` runs everything
# in one process.
TEST_WORKERS ?= 2
test: setup browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=30
	$(PY) -m pytest -q -m serial

# ruff (pyflakes, pycodestyle, isort, bugbear), mypy on engine/ and runtime/, the layering
# contracts (import-linter; pyproject.toml [tool.importlinter]), and the structure checks
# (tools/check_structure.py: functions of at most 150 lines, function-local imports only to
# defer a heavy dependency).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) tools/check_structure.py

bench: setup
	$(PY) benchmarks/engine_bench.py

clean:
	rm -rf $(VENV) out .pytest_cache
