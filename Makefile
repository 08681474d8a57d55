# Two commands on a fresh machine:  make demo   and   make test
# Both create the virtual environment .venv on first use (CPU torch from local disk).
PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.installed-v1
# torch and triton pinned to the builds on local disk; every other dependency comes from
# pyproject.toml (the package with all extras and the test tools).
PINS      := torch==2.13.0 triton==3.7.1
# The peers are test-only cross-checks, installed last: --no-deps keeps their heavy, GPU-only
# requirements out (and pip's resolver quiet about them); PEER_DEPS adds the light ones their
# CPU paths import.
PEERS     := xlstm==2.0.6 mlstm-kernels==2.0.6 flash-linear-attention==0.6.0 fla-core==0.6.0
PEER_DEPS := einops pyyaml
PIP       := $(VPY) -m pip install -q --disable-pip-version-check

.PHONY: demo test test-all bench-cpu venv clean

venv: $(STAMP)

$(STAMP): Makefile pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) $(PINS) $(PEER_DEPS) 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) --no-build-isolation -e '.[all,test]' 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) --no-deps $(PEERS) 2>&1 | grep -v "is ignored: it is neither" || true
	$(VPY) -c "import torch, triton, xlstm_kit.cli, xlstm_kit.model"
	touch $(STAMP)

# Default suite: CPU only, Triton kernels under the interpreter. Slow/GPU checks are opt-in.
# One worker per core (-n auto): on CI's 2 cores 8.6 min instead of 14.1 in one process.
test: $(STAMP)
	TRITON_INTERPRET=1 $(VPY) -m pytest -n auto -m "not slow and not gpu" --timeout=900 --durations=15

test-all: $(STAMP)
	TRITON_INTERPRET=1 $(VPY) -m pytest -m "not gpu" --timeout=1800

demo: $(STAMP)
	$(VPY) -m xlstm_kit demo

# CPU tables of every suite, ours against the installed peers; writes benchmarks/results/DATE-cpu-all.md
bench-cpu: $(STAMP)
	$(VPY) -m xlstm_kit bench --device cpu --peers

clean:
	rm -rf $(VENV) .pytest_cache
