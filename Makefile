# Two commands: `make demo` (train a small GPT on Tiny Shakespeare on the CPU) and `make test`; then
# `make chat-demo` (fine-tune the demo model on a small instruction task, score it, ask it once); `make lint`
# checks the formatting and the lint rules of pyproject.toml (ruff); `make test-fast` is the suite without its
# end-to-end `slow` tests, for the edit loop.
# Each creates the virtual environment $(VENV) on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet
# Without an NVIDIA GPU (no nvidia-smi), torch is installed from this spec before the requirements,
# so that `torch>=2.6` is already met and pip does not pull a multi-GB CUDA build. On this project's
# machines `torch==2.13.0` picks up a local CPU wheel; elsewhere use PyTorch's CPU index, e.g.
#   make TORCH_CPU_SPEC="torch --index-url https://download.pytorch.org/whl/cpu" demo
# With nvidia-smi present the plain requirements give the normal (CUDA) torch.
TORCH_CPU_SPEC ?= torch==2.13.0

.PHONY: venv demo chat-demo test test-fast lint clean-venv

venv: $(VENV)/.dev-installed

$(VENV)/.installed: requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing requirements into $(VENV) (first run only)"
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		echo "no nvidia-smi: installing CPU torch ($(TORCH_CPU_SPEC))"; $(PIP) $(TORCH_CPU_SPEC); fi
	$(PIP) -r requirements.txt
	@touch $@

$(VENV)/.dev-installed: $(VENV)/.installed requirements-dev.txt
	$(PIP) -r requirements-dev.txt
	@touch $@

# A second `make demo` starts over: the earlier demo run is kept as out/shakespeare.prev (the one before it goes)
demo: $(VENV)/.installed
	$(PY) prepare_data.py --dataset shakespeare --out_dir data/shakespeare
	@if [ -d out/shakespeare ]; then rm -rf out/shakespeare.prev && mv out/shakespeare out/shakespeare.prev && \
		echo "make demo: starting over; the earlier demo run is now out/shakespeare.prev"; fi
	$(PY) train.py configs/shakespeare_cpu.py
	$(PY) sample.py --ckpt out/shakespeare --prompt "ROMEO:" --max_new_tokens 200
	@echo "next, in each new shell: source $(VENV)/bin/activate (then README.md's python/torchrun commands work)"
	@echo "your own text (docs/data.md): make venv (adds tokenizers, matplotlib, transformers), then"
	@echo "  python tokenizer.py --input YOUR_FILES --vocab_size 8192 --out tok/mine"
	@echo "  python prepare_data.py --input YOUR_FILES --tokenizer tok/mine --out_dir data/mine"
	@echo "  python train.py configs/shakespeare_cpu.py --data_dir=data/mine --out_dir=out/mine"
	@echo "  python sample.py --ckpt out/mine"

# docs/sft.md#the-chat-demo; chat interactively afterwards: .venv/bin/python sample.py --ckpt out/chat_demo --chat
chat-demo: $(VENV)/.installed
	@ls out/shakespeare/ckpt_*.pt >/dev/null 2>&1 || $(MAKE) demo
	$(PY) -m bench.chat_demo
	$(PY) sample.py --ckpt out/chat_demo --chat --prompt "sort: k c f a" --temperature 0

# One pytest-xdist worker a core (tests/conftest.py gives each its share of the threads); a test file runs whole on
# one worker, so its module fixtures (a torchrun world, a trained export) are made once. Compiled modules are cached
# (__pycache__) even where the environment sets PYTHONDONTWRITEBYTECODE, as this project's machines do: otherwise
# every process the suite starts (each train.py run, each torchrun rank) compiles the library again, ~0.2 s of CPU.
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n auto --dist loadfile

test: $(VENV)/.dev-installed
	$(PYTEST)

test-fast: $(VENV)/.dev-installed
	$(PYTEST) -m "not slow"

lint: $(VENV)/.dev-installed
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

clean-venv:
	rm -rf $(VENV)
