# Every target but `setup` uses the virtual environment that `setup` makes in .venv/.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# On a machine without a GPU the CPU build of torch is installed first, so that `torch>=2.4`
# in pyproject.toml is already met and pip does not fetch a multi-GB CUDA build. Elsewhere, point
# TORCH_CPU at another spec or add an index, e.g.
#   make setup PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_CPU      ?= torch==2.13.0
PIP_TORCH_ARGS ?=
CONFIG ?= configs/tiny.yaml

.PHONY: setup test test-fast demo chat-demo lint format bench clean

setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "torch already installed in $(VENV)"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: torch comes from pyproject (torch>=2.4)"; \
	else \
		echo "no GPU: installing the CPU build $(TORCH_CPU) first"; \
		$(BIN)/python -m pip install -q $(PIP_TORCH_ARGS) "$(TORCH_CPU)"; \
	fi
	$(BIN)/python -m pip install -q -e ".[dev,serve]"
	touch $@

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

demo: setup
	$(BIN)/minillm tokenize $(CONFIG)
	$(BIN)/minillm train $(CONFIG)
	$(BIN)/minillm eval --ckpt runs/tiny
	$(BIN)/minillm eval --ckpt runs/tiny --task data/shakespeare_next_line.jsonl
	$(BIN)/minillm sample --ckpt runs/tiny --prompt "ROMEO:" --max-new-tokens 200

# The chat demo: a small model trained on the shipped copy/reverse chat set (regenerate it with
# scripts/gen_chat_data.py), then its exact match on 200 held-out conversations and one reply.
chat-demo: setup
	$(BIN)/minillm tokenize configs/tiny-chat.yaml
	$(BIN)/minillm train configs/tiny-chat.yaml
	$(BIN)/minillm eval --ckpt runs/tiny-chat --task data/tiny_chat_test.jsonl
	$(BIN)/minillm chat --ckpt runs/tiny-chat --message "Reverse: m a k"

lint: setup
	$(BIN)/ruff check minillm tests scripts
	$(BIN)/ruff format --check minillm tests scripts
	$(BIN)/lint-imports

format: setup
	$(BIN)/ruff format minillm tests scripts
	$(BIN)/ruff check --fix minillm tests scripts

bench: setup
	$(BIN)/python scripts/bench_train.py
	$(BIN)/python scripts/bench_sample.py
	$(BIN)/python scripts/bench_tokenize.py

clean:
	rm -rf $(VENV) runs data/tokens hf .pytest_cache
