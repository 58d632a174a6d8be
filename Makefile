# The two commands: `make demo` (the main job: AMP vs FP32) and `make test`. Both install what is missing,
# configure once, build incrementally and run. Also: make build, make bench, make docs, make package, make clean.
#   LIBTORCH=<prefix>   build against your own LibTorch instead of installing torch into .venv
#   CMAKE_ARGS=...      extra configure arguments (e.g. -DLIBTORCH_AMP_CUDA=OFF)
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

# Recursive (=): evaluated when configure runs, after deps has installed ninja and ccache on a fresh machine.
GENERATOR = $(if $(shell command -v ninja 2>/dev/null),Ninja,Unix Makefiles)
LAUNCHER = $(if $(shell command -v ccache 2>/dev/null),-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache,)
TORCH_ARG := $(if $(LIBTORCH),-DCMAKE_PREFIX_PATH=$(LIBTORCH),)
# ccache: paths relative to the checkout, so a fresh clone elsewhere (CI) hits the same cache entries.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_SLOPPINESS := pch_defines,time_macros,include_file_mtime,include_file_ctime

.PHONY: all deps configure build test asan-test demo bench clean gpu-bundle docs package
all: build

deps:
	@scripts/bootstrap.sh

$(BUILD_DIR)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD_DIR) -G "$(GENERATOR)" $(LAUNCHER) $(TORCH_ARG) $(CMAKE_ARGS)

configure: deps $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# --timeout: a test without its own TIMEOUT that hangs fails alone instead of stalling the run. --browser: chromium
# for the test that opens the run report in a headless browser (only the tests need it; it skips without one).
# OMP_WAIT_POLICY=PASSIVE (unless set): ctest runs JOBS test processes on JOBS cores, each with LibTorch's default
# OpenMP threads, and GNU OpenMP's threads spin at every barrier, taking the cores the other tests need: two copies of
# the FP8 CNN test side by side took 75 s each with spinning and 32 s passive (12 s for one alone); results are the
# same bits (docs/testing.md, "The suite's threads").
test: build
	@scripts/bootstrap.sh --browser
	cd $(BUILD_DIR) && OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} ctest --output-on-failure --timeout 1200 -j $(JOBS)

# AddressSanitizer over the tests that read and write files (Fashion-MNIST loading, gzip, checkpoints): $(ASAN_DIR)
# builds only test_examples and test_amp_files, with the frontend code and the amp library instrumented (the lower
# layers come from ccache), and runs their in-process tests (the example-program tests run in `make test`).
ASAN_DIR ?= build-asan
ASAN_RUN := ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0:halt_on_error=1
asan-test: deps
	@test -f $(ASAN_DIR)/CMakeCache.txt || cmake -S . -B $(ASAN_DIR) -G "$(GENERATOR)" $(LAUNCHER) $(TORCH_ARG) \
	  -DLIBTORCH_AMP_SANITIZE=address -DLIBTORCH_AMP_BENCHMARKS=OFF $(CMAKE_ARGS)
	cmake --build $(ASAN_DIR) -j $(JOBS) --target test_examples test_amp_files test_run
	$(ASAN_RUN) $(ASAN_DIR)/tests/test_examples --gtest_filter='-*BadInputTest.*:*AtomicSaveTest.*:*ResumeTest.*:*ResumeMismatchTest.*:*ExampleHelpTest.*:*CheckpointDirRestartTest.*:*GlobalBatchTest.*:ProgressOutputTest.*:ObservabilityProgramTest.*:LogLinesTest.*:OutputDeviceTest.*:DefaultLrTest.*:BadInputUnderLauncherTest.*'
	$(ASAN_RUN) $(ASAN_DIR)/tests/test_amp_files
	$(ASAN_RUN) $(ASAN_DIR)/tests/test_run

# The main job: the same training under FP32 and amp O1/O2/O3 (bf16/fp16), against a hand-rolled LibTorch loop
# and torch.amp; prints the table last, writes benchmarks/results/amp_vs_fp32.{json,csv,png}. DEMO_ARGS=--full
# runs the whole matrix.
DEMO_ARGS ?=
demo: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target bench_amp_vs_fp32
	$(BUILD_DIR)/benchmarks/bench_amp_vs_fp32 $(DEMO_ARGS)

BENCHMARKS := bench_multi_tensor_scale bench_unscale bench_copy_axpby bench_l2_norm bench_fused_adamw bench_amp_overhead \
              bench_allreduce_busbw
bench: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target $(BENCHMARKS)
	@for b in $(BENCHMARKS); do echo "== $$b"; $(BUILD_DIR)/benchmarks/$$b || exit 1; done

# Copies what the GPU machine lacks (it has no apt, no network) into .deps/ (git-ignored), for
# scripts/gpu_check.sh --deps .deps: GoogleTest's source, CLI11's and gloo's headers (about 5 MiB). Every device call
# carries .deps again (at most 64 MiB with the working tree: the size is checked), and neither phase of the GPU check
# reads Fashion-MNIST (30 MiB), so it comes along only with GPU_BUNDLE_DATA=1 (for a CNN run of your own).
GPU_BUNDLE_MAX_MIB ?= 48
GPU_BUNDLE_DATA ?= 0
gpu-bundle:
	rm -rf .deps && mkdir -p .deps/include
	cp -r /usr/src/googletest .deps/googletest
	cp -r /usr/include/CLI .deps/include/CLI
	cp -r /usr/include/nlohmann .deps/include/nlohmann
	cp -r /usr/include/gloo .deps/include/gloo
	if [ "$(GPU_BUNDLE_DATA)" = 1 ]; then \
	  if [ -d /usr/share/datasets/fashion-mnist ]; then cp -r /usr/share/datasets/fashion-mnist .deps/fashion-mnist; \
	  else echo "gpu-bundle: no Fashion-MNIST (apt-get install dataset-fashion-mnist)"; exit 1; fi; fi
	@size=$$(du -sm .deps | cut -f1); tree=$$(git ls-files -z | du -cm --files0-from=- | tail -n 1 | cut -f1); \
	echo "gpu-bundle: .deps is $$size MiB, the tracked tree $$tree MiB (a device call carries 64 MiB in all)"; \
	[ $$size -le $(GPU_BUNDLE_MAX_MIB) ] || { echo "gpu-bundle: .deps is over $(GPU_BUNDLE_MAX_MIB) MiB" >&2; exit 1; }

# The API reference (Doxygen over the installed headers, docs/api.md) into $(BUILD_DIR)/docs/html.
docs: configure
	cmake --build $(BUILD_DIR) --target docs

# A Debian package and a tarball of the install (libraries, headers, CMake package, ddp-launch, docs) in $(BUILD_DIR):
# libtorch-amp_<version>_<arch>.deb. `make docs` first puts the API reference in it too.
package: build
	cd $(BUILD_DIR) && cpack

clean:
	rm -rf $(BUILD_DIR)
