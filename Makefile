# Two commands set everything up on a fresh machine:
#   make run   - create .venv and run the main job on the embedded Gemma
#   make test  - create .venv and run the tests
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
OUT ?= results/run
# Backend extra: cpu on Linux (mlx[cpu]); nothing on macOS (Metal ships with mlx).
# Use `make BACKEND=cuda ...` on a Linux machine with an NVIDIA GPU.
ifeq ($(shell uname -s),Linux)
BACKEND ?= cpu
EXTRAS := $(BACKEND),test,bench
else
EXTRAS := test,bench
endif

.PHONY: run test env bench clean

$(BIN)/.installed-$(EXTRAS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

env: $(BIN)/.installed-$(EXTRAS)

run: env
	$(BIN)/gemmdrift run --out $(OUT)

test: env
	$(BIN)/python -m pytest

bench: env
	$(BIN)/asv machine --yes
	$(BIN)/asv run --show-stderr

clean:
	rm -rf $(VENV) .asv results
