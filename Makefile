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

.PHONY: run test env bench golden clean

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

# The shipped golden logits (src/gemmdrift/data/golden/linux-cpu): the embedded Gemma in bfloat16 over the
# built-in essay and prompt set, decode and verify:2. Run on the Linux CPU backend with the mlx it records.
GOLDEN ?= src/gemmdrift/data/golden/linux-cpu
golden: env
	$(BIN)/gemmdrift logits --schedule decode --out $(GOLDEN)/decode.npz
	$(BIN)/gemmdrift logits --schedule verify:2 --out $(GOLDEN)/verify-2.npz

clean:
	rm -rf $(VENV) .asv results
