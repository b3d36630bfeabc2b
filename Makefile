# Two entry points: `make demo` (train + evaluate + sample on JapaneseVowels) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN ?= runs/japanese_vowels

.PHONY: install demo test test-reliability test-slow lint docs

$(BIN)/.installed: setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -c constraints.txt -e ".[test]"
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/iresflow train --data japanese_vowels --out $(RUN) --overwrite
	$(BIN)/iresflow evaluate $(RUN)
	$(BIN)/iresflow sample $(RUN) --num 16 --out $(RUN)/samples.npz
	$(BIN)/iresflow info $(RUN)

test: $(BIN)/.installed
	$(BIN)/python -m pytest

# Multi-process checks (DDP, torchrun on one and two simulated nodes, SIGKILL-and-resume,
# sharded evaluation) and the README example: slower, run in CI too.
test-reliability: $(BIN)/.installed
	$(BIN)/python -m pytest -m slow tests/test_distributed.py tests/test_fault_tolerance.py \
		tests/test_scaleout.py tests/test_readme.py

test-slow: $(BIN)/.installed
	$(BIN)/python -m pytest -m slow

lint: $(BIN)/.installed
	$(BIN)/ruff check iresflow tests benchmarks examples

docs: $(BIN)/.installed
	$(BIN)/mkdocs build --strict -d site
