# Two commands: `make lab` sets up .venv and opens the lessons; `make test` runs every check.
# notebooks/ holds the student copies (exercises unsolved); solutions/ the instructor copies.
PYTHON ?= python3
# A bare torch requirement may pull a CUDA build of several GB; CI passes TORCH=torch==2.13.0 (a CPU build).
TORCH ?= torch>=2.2
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: lab teach check test bench notebooks student present clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[lab,serve,test]"
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

# The instructor copies: every exercise solved, every check-yourself answered.
teach: $(STAMP)
	$(VENV)/bin/jupyter lab solutions/

# Unit and property tests, the instructor copies under strict nbval, then the student copies
# run top to bottom (their answers unsolved, so outputs are not compared).
# Everyday work: the unit and property tests, in under a minute (no lessons, servers or browsers).
check: $(STAMP)
	$(PY) -m pytest tests -q -m "not integration"

test: $(STAMP)
	$(PY) -m pytest
	$(PY) -m pytest --nbval-lax notebooks/

bench: $(STAMP)
	$(PY) benchmarks/bench_simulate.py
	$(PY) benchmarks/bench_engine.py
	$(PY) benchmarks/fit_engine_cost.py
	$(PY) benchmarks/bench_twin.py
	$(PY) benchmarks/bench_peers.py
	$(PY) benchmarks/bench_host.py
	$(PY) benchmarks/bench_multiplier.py
	$(PY) benchmarks/bench_flood.py
	$(PY) benchmarks/bench_servers.py

# After editing a lesson in solutions/: execute the instructor copies, then write the student copies.
notebooks: $(STAMP)
	$(PY) tools/run_notebooks.py
	$(PY) tools/make_student.py

# The student copies (notebooks/) from the instructor copies (solutions/), without executing.
student: $(STAMP)
	$(PY) tools/make_student.py

# Lesson 01 as a Voilà dashboard (outputs only, widgets live) for projecting in class.
$(VENV)/.present: $(STAMP)
	$(PY) -m pip install --quiet -e ".[present]"
	touch $@

present: $(VENV)/.present
	$(VENV)/bin/voila notebooks/01_static_vs_continuous.ipynb --no-browser

clean:
	rm -rf $(VENV) build *.egg-info
