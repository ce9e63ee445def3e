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
# Overrides for a quick look: `make demo STEPS=200` trains 200 steps; ARGS="--set K=V ..." goes to
# tokenize and train (e.g. ARGS="--set train.lr=1e-3"). RUN is the run directory eval, sample
# and chat read: set it too when ARGS moves train.out_dir.
STEPS ?=
ARGS  ?=
SETS   = $(if $(STEPS),--set train.max_steps=$(STEPS)) $(ARGS)
RUN   ?= runs/tiny
CHAT_RUN ?= runs/tiny-chat
LORA_RUN ?= runs/tiny-lora
# A published model's Hugging Face folder (`make published-demo`): a stand-in the demo builds
# when it is absent; PUBLISHED=path/to/your/folder fine-tunes yours (a ChatML chat model for
# the demo's data and config).
PUBLISHED ?= models/standin-chatml
PUBLISHED_RUN ?= runs/published-lora

.PHONY: setup interop llama-server test test-fast demo chat-demo lora-demo published-demo rl-demo rl-dpo-demo \
	lint format bench clean

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
	@# setuptools says "Editable installation. !! Please be careful with folders ... !!" as a
	@# warning, which pip >= 25 prints even with -q: a note with nothing to act on, filtered by
	@# its first words (after a user's own PYTHONWARNINGS, so that this filter wins).
	PYTHONWARNINGS="$${PYTHONWARNINGS:+$$PYTHONWARNINGS,}ignore:Editable installation" \
		$(BIN)/python -m pip install -q -e ".[dev,serve]"
	touch $@

# llama-cpp-python, which tests/test_gguf.py uses to load `minillm export --format gguf` files in
# llama.cpp itself. It is built from its PyPI source package (cmake and a C++ compiler needed):
# LLAMA_BUILD_MIN minutes on 2 cores, once per machine, since pip caches the built wheel in
# ~/.cache/pip and a later install (a fresh .venv, CI) takes seconds. Skipped when llama_cpp
# already imports. GGML_NATIVE=OFF: a portable build, not one tuned to (and only running on)
# this CPU. Without it the GGUF tests skip and say why; nothing else needs it.
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF

interop: setup
	@if $(BIN)/python -c "import llama_cpp" 2>/dev/null; then \
		echo "llama_cpp already installed in $(VENV)"; \
	else \
		echo "building $(LLAMA_CPP_PYTHON) from source (minutes; pip caches the wheel)"; \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q \
			--no-binary llama-cpp-python "$(LLAMA_CPP_PYTHON)"; \
	fi

# llama.cpp's own C++ server, for `scripts/bench_serve.py --llama-server build/llama.cpp/bin/
# llama-server` (parallel slots, continuous batching): built from the llama.cpp sources inside
# the same llama-cpp-python source package (pip downloads it), the same portable flags. About
# 9 minutes on 2 cores; nothing else needs it, and no test uses it.
LLAMA_SERVER_DIR ?= build/llama.cpp

llama-server: setup
	@test -x $(LLAMA_SERVER_DIR)/bin/llama-server && echo "$(LLAMA_SERVER_DIR)/bin/llama-server exists" || { \
		set -e; mkdir -p $(LLAMA_SERVER_DIR); \
		$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $(LLAMA_SERVER_DIR) \
			"$(LLAMA_CPP_PYTHON)"; \
		tar xzf $(LLAMA_SERVER_DIR)/llama_cpp_python-*.tar.gz -C $(LLAMA_SERVER_DIR); \
		src=$$(echo $(LLAMA_SERVER_DIR)/llama_cpp_python-*/vendor/llama.cpp); \
		cmake -S $$src -B $(LLAMA_SERVER_DIR) -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
			-DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release $(LLAMA_CMAKE_ARGS) >/dev/null; \
		cmake --build $(LLAMA_SERVER_DIR) --target llama-server -j2; }

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

demo: setup
	$(BIN)/minillm tokenize $(CONFIG) $(SETS)
	$(BIN)/minillm train $(CONFIG) $(SETS)
	$(BIN)/minillm eval --ckpt $(RUN)
	$(BIN)/minillm eval --ckpt $(RUN) --task data/shakespeare_next_line.jsonl
	$(BIN)/minillm sample --ckpt $(RUN) --prompt "ROMEO:" --max-new-tokens 200

# The chat demo: a small model trained on the shipped copy/reverse chat set (regenerate it with
# scripts/gen_chat_data.py), then its exact match on 200 held-out conversations and one reply.
chat-demo: setup
	$(BIN)/minillm tokenize configs/tiny-chat.yaml $(SETS)
	$(BIN)/minillm train configs/tiny-chat.yaml $(SETS)
	$(BIN)/minillm eval --ckpt $(CHAT_RUN) --task data/tiny_chat_test.jsonl
	$(BIN)/minillm chat --ckpt $(CHAT_RUN) --message "Reverse: m a k"

# LoRA (after `make demo`, which it runs first when RUN has no checkpoint): rank-8 adapters on the
# demo's Shakespeare model, trained on the chat demo's data with the base frozen, then scored,
# exported merged and as peft. configs/tiny-lora.yaml says why each setting; it has no model
# section (the model and tokenizer are init_from's), so nothing in it goes unused. RUN and
# LORA_RUN move the base and the run.
LORA_SETS = --set train.init_from=$(RUN) --set train.out_dir=$(LORA_RUN)
lora-demo: setup
	test -d $(RUN)/checkpoints || $(MAKE) demo
	$(BIN)/minillm tokenize configs/tiny-lora.yaml $(LORA_SETS) $(SETS)
	$(BIN)/minillm train configs/tiny-lora.yaml $(LORA_SETS) $(SETS)
	$(BIN)/minillm eval --ckpt $(LORA_RUN) --task data/tiny_chat_test.jsonl
	$(BIN)/minillm chat --ckpt $(LORA_RUN) --message "Reverse: m a k"
	$(BIN)/minillm export --ckpt $(LORA_RUN) --out hf/tiny-lora --force
	$(BIN)/minillm export --ckpt $(LORA_RUN) --format gguf --out gguf/tiny-lora.gguf --force
	$(BIN)/minillm export --ckpt $(LORA_RUN) --format peft --out hf/tiny-lora-peft --force

# A published model (README, "Fine-tune a published model"): its held-out exact match on the chat
# demo's task, LoRA SFT in its own chat template (configs/published-lora.yaml), scored again,
# a reply, and exports to Hugging Face and GGUF that keep its tokenizer and template.
PUBLISHED_SETS = --set train.init_from=$(PUBLISHED) --set train.out_dir=$(PUBLISHED_RUN)
published-demo: setup
	test -d $(PUBLISHED) || $(BIN)/python scripts/make_published_folder.py $(PUBLISHED)
	$(BIN)/minillm info --ckpt $(PUBLISHED)
	$(BIN)/minillm eval --ckpt $(PUBLISHED) --task data/tiny_chat_test.jsonl
	$(BIN)/minillm tokenize configs/published-lora.yaml $(PUBLISHED_SETS) $(SETS)
	$(BIN)/minillm train configs/published-lora.yaml $(PUBLISHED_SETS) $(SETS)
	$(BIN)/minillm eval --ckpt $(PUBLISHED_RUN) --task data/tiny_chat_test.jsonl
	$(BIN)/minillm chat --ckpt $(PUBLISHED_RUN) --message "Reverse: m a k"
	$(BIN)/minillm export --ckpt $(PUBLISHED_RUN) --out hf/published-lora --force
	$(BIN)/minillm export --ckpt $(PUBLISHED_RUN) --format gguf --out gguf/published-lora.gguf \
		--force

# The RL demo (README, "Preference tuning and RL"): a brief SFT on the shipped sort task
# (scripts/gen_rl_data.py; STEPS and ARGS go to it), its held-out exact match greedy and sampled
# (8 replies each at temperature 1: mean and pass@8), then GRPO from it, scored the same way.
RL_TEST  = data/rl_sort_test.jsonl
rl-demo: setup
	$(BIN)/minillm tokenize configs/rl-sft.yaml $(SETS)
	$(BIN)/minillm train configs/rl-sft.yaml $(SETS)
	$(BIN)/minillm eval --ckpt runs/rl-sft --task $(RL_TEST)
	$(BIN)/minillm eval --ckpt runs/rl-sft --task $(RL_TEST) --temperature 1 --samples 8
	$(BIN)/minillm tokenize configs/rl-grpo.yaml
	$(BIN)/minillm train configs/rl-grpo.yaml
	$(BIN)/minillm eval --ckpt runs/rl-grpo --task $(RL_TEST)
	$(BIN)/minillm eval --ckpt runs/rl-grpo --task $(RL_TEST) --temperature 1 --samples 8

# DPO on the shipped pairs (sorted vs two letters swapped) from the RL demo's SFT run (trained
# first when missing): held-out reward accuracy is val/reward_accuracy, then greedy exact match.
rl-dpo-demo: setup
	test -d runs/rl-sft/checkpoints || ($(BIN)/minillm tokenize configs/rl-sft.yaml && \
		$(BIN)/minillm train configs/rl-sft.yaml)
	$(BIN)/minillm tokenize configs/rl-dpo.yaml
	$(BIN)/minillm train configs/rl-dpo.yaml
	$(BIN)/minillm eval --ckpt runs/rl-dpo --task $(RL_TEST)

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
	rm -rf $(VENV) runs data/tokens hf gguf models/standin-chatml .pytest_cache
