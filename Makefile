# Two commands set everything up on a fresh machine:
#   make run   - create the virtual environment and run the main job on the embedded Gemma
#   make test  - create the virtual environment and run the tests
# The first Python 3.10+ found (python3.13 ... python3.10, then python3; arm64 on macOS) builds it,
# unless PYTHON is given.
OUT ?= results/run
# Backend extra: cpu on Linux (mlx[cpu]); nothing on macOS (Metal ships with mlx).
# On a Linux machine with an NVIDIA GPU: `make BACKEND=cuda13 ...` (CUDA 13 driver, R580+) or
# `make BACKEND=cuda12 ...` (CUDA 12 driver); BACKEND=cuda is cuda13. Each backend has its own
# virtual environment (.venv for cpu and Metal, .venv-cuda12, .venv-cuda13): the mlx-cpu and
# mlx-cuda wheels both install mlx/lib/libmlx.so, so they must never share one.
ifeq ($(shell uname -s),Linux)
BACKEND ?= cpu
override BACKEND := $(if $(filter cuda,$(BACKEND)),cuda13,$(BACKEND))
ifeq ($(filter cpu cuda12 cuda13,$(BACKEND)),)
$(error BACKEND=$(BACKEND) is not a backend: use cpu, cuda12 or cuda13 (cuda is cuda13))
endif
EXTRAS := $(BACKEND),test,bench
else
override BACKEND := metal
EXTRAS := test,bench
endif
VENV ?= $(if $(filter cpu metal,$(BACKEND)),.venv,.venv-$(BACKEND))
BIN := $(VENV)/bin
# asv: the CUDA matrix pins mlx-cuda-13 or mlx-cuda-12 wheels (asv.conf.json pins mlx-cpu on Linux).
ASV_CONFIG := $(if $(filter cuda12,$(BACKEND)),asv.cuda12.conf.json,$(if $(filter cuda13,$(BACKEND)),asv.cuda.conf.json,asv.conf.json))

# The interpreter must be 3.10+ (pyproject's requires-python) and, on macOS, arm64: mlx has no wheel
# for an x86_64 (Rosetta) Python, and a stock Mac's /usr/bin/python3 is 3.9. pyenv shims of versions
# that are not active fail this check, so they are skipped.
PY_OK := import platform, sys; sys.exit(sys.version_info < (3, 10) or (sys.platform == "darwin" and platform.machine() != "arm64"))
PYTHONS := python3.13 python3.12 python3.11 python3.10 python3
# Looked up once, on first use (not for `make clean`).
PYTHON ?= $(eval PYTHON := $(shell for p in $(PYTHONS); do $$p -c '$(PY_OK)' >/dev/null 2>&1 && { echo $$p; break; }; done))$(PYTHON)
# mlx-metal has wheels for macOS 14 and later only (0.29.3 is the last for macOS 13).
MAC_OK := import platform, sys; sys.exit(sys.platform == "darwin" and int(platform.mac_ver()[0].split(".")[0] or 0) < 14)
# mlx-cuda loads the NVIDIA driver's libcuda.so.1 when mlx is imported: without it, a CUDA backend's environment (about
# 2.8 GB of wheels) could never run, so BACKEND=cuda12/cuda13 is refused before anything is built or downloaded.
CUDA_OK := import ctypes; ctypes.CDLL("libcuda.so.1")

# uv installs the same packages as pip in about a third of the time (19 s against 55 s from a fresh clone here).
# uv reads no pip.conf: behind a private index set UV_INDEX_URL (or UV_EXTRA_INDEX_URL), or install with pip
# (`make INSTALLER=pip ...`); where uv fails, pip installs.
INSTALLER ?= uv
ifeq ($(filter uv pip,$(INSTALLER)),)
$(error INSTALLER=$(INSTALLER) is not an installer: use uv or pip)
endif
PIP_INSTALL = $(BIN)/python -m pip install --quiet --upgrade pip && $(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"

.PHONY: run test env bench golden docs clean changelog history-run asv-mlx-lm asv-mlx

$(BIN)/.installed-$(EXTRAS): pyproject.toml
	@test -n "$(PYTHON)" && $(PYTHON) -c '$(PY_OK)' 2>/dev/null || { echo "make: no Python 3.10+$(if $(filter metal,$(BACKEND)), for arm64,) found (tried $(or $(PYTHON),$(PYTHONS))); install one, or give it as PYTHON=..." >&2; exit 2; }
	@$(PYTHON) -c '$(MAC_OK)' || { echo "make: mlx needs macOS 14 or later on Apple silicon" >&2; exit 2; }
	@$(if $(filter cuda12 cuda13,$(BACKEND)),$(PYTHON) -c '$(CUDA_OK)' 2>/dev/null || { echo "make: BACKEND=$(BACKEND) needs an NVIDIA driver and this machine has none (libcuda.so.1 does not load): use BACKEND=cpu here" >&2; exit 2; },:)
	$(PYTHON) -m venv $(VENV)
	@if [ "$(INSTALLER)" = uv ]; then \
	    echo "$(BIN)/uv pip install -e \".[$(EXTRAS)]\""; \
	    $(BIN)/python -m pip install --quiet uv && $(BIN)/uv pip install --python $(BIN)/python --quiet -e ".[$(EXTRAS)]" \
	        || { echo "make: installing with uv failed; installing with pip" >&2; $(PIP_INSTALL); }; \
	else echo "pip install -e \".[$(EXTRAS)]\""; $(PIP_INSTALL); fi
	touch $@

env: $(BIN)/.installed-$(EXTRAS)

# uv compiles no bytecode: the commands below write it as they import (where PYTHONDONTWRITEBYTECODE is set, as
# on the CI machines, every process would otherwise compile from source each module it imports, gemmdrift's own).
unexport PYTHONDONTWRITEBYTECODE

run: env
	$(BIN)/gemmdrift run --out $(OUT)

# Two test processes (pytest-xdist), each test file whole in one of them: most tests compute on one core
# (the reference BLAS is single-threaded), so one process left the second core idle. TEST_WORKERS=0: one process.
# The files go out in collection order, the longest first (tests/conftest.py LONG_FILES), not by test count.
TEST_WORKERS ?= 2
test: env
	$(BIN)/python -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

bench: env
	$(BIN)/asv machine --config $(ASV_CONFIG) --yes
	$(BIN)/asv run --config $(ASV_CONFIG) --show-stderr

# The whole history (docs/tracking.md): every Linux entry of asv.conf.json, one uv-built environment each, at one
# gemmdrift commit, into benchmarks/reference/reference-linux-cpu-tier; resumable (run it again after Ctrl-C).
history-run: env
	$(BIN)/python -m gemmdrift.history.releases $(HISTORY_ARGS)

# asv over mlx-lm's own commits (docs/bisect.md): asv.mlx-lm.conf.json, whose repo is .asv/mlx-lm.git (a clone of
# ml-explore/mlx-lm), each commit built with uv and installed --no-deps over this .venv (mlx and the rest), the tier's
# benchmarks from this checkout. ASV_MLX_LM: the asv command and its range or benchmark, e.g.
#   make asv-mlx-lm ASV_MLX_LM='run --bench bench_tier.TierState.track_state_bugs v0.31.2..v0.31.3'
#   make asv-mlx-lm ASV_MLX_LM='find --invert v0.31.2..v0.31.3 bench_tier.TierState.track_state_bugs'
ASV_MLX_LM ?= run --bench bench_tier.TierState.track_state_bugs v0.31.2..v0.31.3
TIER_PARTS ?= state
asv-mlx-lm: env
	@test -d .asv/mlx-lm.git || { echo "make asv-mlx-lm: no .asv/mlx-lm.git: git clone --bare <a clone of ml-explore/mlx-lm> .asv/mlx-lm.git" >&2; exit 2; }
	$(BIN)/asv machine --config asv.mlx-lm.conf.json --yes
	PATH="$(CURDIR)/$(BIN):$$PATH" GEMMDRIFT_TIER_PARTS=$(TIER_PARTS) MLX_ENABLE_TF32=0 \
	GEMMDRIFT_BASE_SITE="$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" \
	$(BIN)/asv $(ASV_MLX_LM) --config asv.mlx-lm.conf.json --show-stderr

# asv over mlx's own commits (asv.mlx.conf.json, docs/bisect.md): each commit built by YOUR command (MLX_BUILD, as
# `gemmdrift bisect --build`: it builds $$GEMMDRIFT_SRC into $$GEMMDRIFT_PYTHON's environment; gemmdrift ships no
# recipe that builds mlx), run with one mlx-lm release (MLX_LM), the tier parts MLX_TIER_PARTS only.
#   make asv-mlx MLX_BUILD=~/build-mlx.sh ASV_MLX='run --bench bench_tier.TierDecodeVsVerify.track_flips v0.30.0^!'
ASV_MLX ?= run --bench bench_tier.TierDecodeVsVerify.track_flips v0.29.4..v0.30.0
MLX_LM ?= 0.30.2
MLX_TIER_PARTS ?= decode
asv-mlx: env
	@test -d .asv/mlx.git || { echo "make asv-mlx: no .asv/mlx.git: git clone --bare <a clone of ml-explore/mlx> .asv/mlx.git" >&2; exit 2; }
	@test -n "$(MLX_BUILD)" || { echo "make asv-mlx: give MLX_BUILD=CMD, a command that builds \$$GEMMDRIFT_SRC into \$$GEMMDRIFT_PYTHON's environment (see docs/bisect.md)" >&2; exit 2; }
	$(BIN)/asv machine --config asv.mlx.conf.json --yes
	PATH="$(CURDIR)/$(BIN):$$PATH" GEMMDRIFT_TIER_PARTS=$(MLX_TIER_PARTS) MLX_ENABLE_TF32=0 \
	GEMMDRIFT_MLX_BUILD='$(MLX_BUILD)' GEMMDRIFT_MLX_LM=$(MLX_LM) \
	GEMMDRIFT_BASE_SITE="$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" \
	$(BIN)/asv $(ASV_MLX) --config asv.mlx.conf.json --show-stderr

# The shipped golden logits (src/gemmdrift/data/golden/linux-cpu): the embedded Gemma in bfloat16 over the
# built-in essay and prompt set, decode and verify:2. Run on the Linux CPU backend with the mlx it records.
GOLDEN ?= src/gemmdrift/data/golden/linux-cpu
golden: env
	$(BIN)/gemmdrift logits --schedule decode --out $(GOLDEN)/decode.npz
	$(BIN)/gemmdrift logits --schedule verify:2 --out $(GOLDEN)/verify-2.npz

# The flag tables of docs/commands.md, regenerated from the CLI's parsers (tests/test_docs.py checks them).
docs: env
	$(BIN)/python -m gemmdrift.cli.doc docs/commands.md

clean:
	rm -rf .venv .venv-cuda12 .venv-cuda13 .asv results

# The numerics changelog's shipped pages (docs/changelog/) from the shipped inputs: the reference results, the
# release comparisons of ops (benchmarks/release_ops/) and the replayed envelopes' cache (docs/changelog/replayed.json).
# Pages of pairs that no longer exist (the releases present changed) are removed first; the cache is kept.
changelog: env
	rm -f docs/changelog/*.md docs/changelog/*.html docs/changelog/timeline.png
	$(BIN)/gemmdrift changelog --results benchmarks/reference --out docs/changelog
