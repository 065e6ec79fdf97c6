# Two commands: `make lab` sets up .venv and opens the lessons; `make test` runs every check.
# notebooks/ holds the student copies (exercises unsolved); solutions/ the instructor copies.
PYTHON ?= python3
# A bare torch requirement may pull a CUDA build of several GB; CI passes TORCH=torch==2.13.0 (a CPU build).
TORCH ?= torch>=2.2
# PyTorch's own index of CPU wheels, for a machine without a GPU: make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# JupyterLab and Voilà refuse to run as root unless told to (lab images and cloud VMs often run as root).
JUPYTER_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
# One lesson to re-run with `make notebooks`: its number, e.g. LESSON=03 (empty: every lesson).
LESSON ?=
LESSON_FILES := $(if $(LESSON),$(wildcard solutions/$(LESSON)_*.ipynb))
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: lab teach check test bench notebooks student present vllm guidellm clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e ".[lab,serve,test]"
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/ $(JUPYTER_ROOT)

# The instructor copies: every exercise solved, every check-yourself answered.
teach: $(STAMP)
	$(VENV)/bin/jupyter lab solutions/ $(JUPYTER_ROOT)

# Everyday work: the unit and property tests (no lessons, servers, browsers or transformers), in
# under a minute on a 2-core machine (README.md, "Testing", states the time measured).
check: $(STAMP)
	$(PY) -m pytest tests -q -m "not integration"

# Unit and property tests, the instructor copies under strict nbval, then the student copies
# run top to bottom (their answers unsolved, so outputs are not compared). Both halves run
# and report before `make` fails with the first failing half's status.
test: $(STAMP)
	@status=0; \
	$(PY) -m pytest || status=$$?; \
	$(PY) -m pytest --nbval-lax notebooks/ || { s=$$?; [ $$status -ne 0 ] || status=$$s; }; \
	exit $$status

bench: $(STAMP)
	$(PY) benchmarks/bench_simulate.py
	$(PY) benchmarks/bench_engine.py
	$(PY) benchmarks/fit_engine_cost.py
	$(PY) benchmarks/bench_twin.py
	$(PY) benchmarks/bench_peers.py
	$(PY) benchmarks/bench_host.py
	$(PY) benchmarks/bench_multiplier.py
	$(PY) benchmarks/bench_flood.py
	$(PY) benchmarks/bench_bodies.py
	$(PY) benchmarks/bench_servers.py

# After editing a lesson in solutions/: execute the instructor copies, then write the student copies.
# `make notebooks LESSON=03` re-runs lesson 03 alone; a re-run that changes a checked line says so.
notebooks: $(STAMP)
	$(if $(LESSON),$(if $(LESSON_FILES),,$(error LESSON=$(LESSON): no solutions/$(LESSON)_*.ipynb)))
	$(PY) tools/run_notebooks.py $(LESSON_FILES)
	$(PY) tools/make_student.py $(LESSON_FILES)

# The student copies (notebooks/) from the instructor copies (solutions/), without executing.
student: $(STAMP)
	$(PY) tools/make_student.py

# Lesson 01 as a Voilà dashboard (outputs only, widgets live) for projecting in class; the
# template in present/ keeps each run that answers a prediction behind a reveal.
$(VENV)/.present: $(STAMP)
	$(PY) -m pip install --quiet -e ".[present]"
	touch $@

present: $(VENV)/.present
	JUPYTER_PATH=$(CURDIR)/present $(VENV)/bin/voila notebooks/01_static_vs_continuous.ipynb --template=labkit --no-browser

# vLLM's CPU build in a venv of its own (.venv-vllm; 5.6 minutes on this 2-core machine and 3.4 GB), with the repairs it needs here.
vllm: .venv-vllm/bin/vllm
.venv-vllm/bin/vllm:
	tools/install_vllm.sh .venv-vllm

# guidellm 0.8 (the benchmark vLLM's project ships) in a venv of its own, for tests/test_guidellm.py.
guidellm: .venv-guidellm/bin/guidellm
.venv-guidellm/bin/guidellm:
	python3 -m venv .venv-guidellm && .venv-guidellm/bin/pip install -q "guidellm==0.8.1"

clean:
	rm -rf $(VENV) build *.egg-info
