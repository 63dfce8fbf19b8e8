# vmmshim — plain GNU make.  `make` builds, `make check` runs every test variant (the CI command).
CUDA_HOME ?= /usr/local/cuda
PREFIX    ?= /usr/local
SAN       ?=
BUILD     ?= build$(if $(SAN),-$(SAN))

CC      ?= cc
WARN    := -std=c11 -Wall -Wextra -Wpedantic -Werror
CPPFLAGS += -D_GNU_SOURCE -I$(CUDA_HOME)/include -Ishim -Itools/include
CFLAGS  ?= -O2 -g
CFLAGS  += $(WARN) -fPIC -fvisibility=hidden -pthread
LDLIBS  := -ldl -pthread
ifeq ($(SAN),asan)
  CFLAGS  += -fsanitize=address -fno-omit-frame-pointer
  LDFLAGS += -fsanitize=address
endif
ifeq ($(SAN),ubsan)
  CFLAGS  += -fsanitize=undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
  LDFLAGS += -fsanitize=undefined
endif
ifeq ($(SAN),tsan)
  CFLAGS  += -fsanitize=thread -fno-omit-frame-pointer
  LDFLAGS += -fsanitize=thread
endif

CORE_SRC   := $(wildcard shim/core/*.c shim/registry/*.c)
SHIM_SRC   := $(wildcard shim/hooks/*.c shim/backing/*.c shim/pool/*.c shim/broker/*.c)
IMPORT_SRC := $(wildcard shim/import/*.c)
CLIENT_SRC := $(wildcard tools/client/*.c) $(IMPORT_SRC)
CTL_SRC    := $(wildcard tools/vmmctl/*.c)
FAKE_SRC   := $(wildcard tests/fakecuda/*.c)
FAKERT_SRC := $(wildcard tests/fakecudart/*.c)
PROG_SRC   := $(wildcard tests/progs/*.c)
TEST_SRC   := $(wildcard tests/unit/test_*.c)
HELPER_SRC := $(wildcard tests/unit/prog_*.c)
FUZZ_TARGETS := registry ipc broker options names

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
CORE_A   := $(BUILD)/libvmmcore.a
IMPORT_A := $(BUILD)/libvmmimport.a
SHIM_SO  := $(BUILD)/libvmmshim.so
CLIENT_SO:= $(BUILD)/libvmmshim-client.so
CLIENT_A := $(BUILD)/libvmmshim-client.a
VMMCTL   := $(BUILD)/vmmctl
FAKE_SO  := $(BUILD)/fakecuda/libcuda.so.1
FAKERT_SO:= $(BUILD)/fakecuda/libcudart.so.13
FAKERT11_SO := $(BUILD)/fakecuda11/libcudart.so.11.0
CUDA11_EMU  := $(BUILD)/progs11/cuda11_prog
PROGS    := $(patsubst tests/progs/%.c,$(BUILD)/progs/%,$(PROG_SRC))
TESTS    := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(TEST_SRC) $(HELPER_SRC))
FUZZ_REPLAY := $(patsubst %,$(BUILD)/tests/test_fuzz_%,$(FUZZ_TARGETS))
GEN_SEEDS := $(BUILD)/fuzz/gen_seeds
CHECKSUMS_SO := $(BUILD)/tests/libchecksums.so
TRACE_SO := $(BUILD)/tests/liballoc_trace.so
NCCL_STANDIN_SO := $(BUILD)/tests/libnccl-standin.so
PUBLIC_H := $(BUILD)/include/vmmshim.h

.PHONY: all deps fuzz-deps test check fuzz fuzz-seeds test-gpu test-matrix bench-gpu demo install wheel cuda11 clean
all: deps $(SHIM_SO) $(CLIENT_SO) $(CLIENT_A) $(VMMCTL) $(FAKE_SO) $(FAKERT_SO) $(FAKERT11_SO) $(CUDA11_EMU) $(TESTS) $(FUZZ_REPLAY) $(GEN_SEEDS) $(PROGS) $(CHECKSUMS_SO) $(TRACE_SO) $(NCCL_STANDIN_SO) $(PUBLIC_H)

# Debian packages the build needs; installed when root, otherwise the exact command is printed.
deps:
	@if ! printf '#include <uthash.h>\n#include <libunwind.h>\n#include <xxhash.h>\n' | $(CC) -E -x c - >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then echo "vmmshim: installing uthash-dev libunwind-dev libxxhash-dev"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq uthash-dev libunwind-dev libxxhash-dev) >/dev/null || exit 1; \
	  else echo "vmmshim: error: missing build dependencies; run: sudo apt-get install -y uthash-dev libunwind-dev libxxhash-dev"; exit 1; fi; \
	fi

$(BUILD)/obj/%.o: %.c | deps
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -MMD -MP -c $< -o $@

$(CORE_A): $(call obj,$(CORE_SRC))
	@rm -f $@; ar rcs $@ $^

# The shim.  libcuda/libcudart are never linked (found at run time).  Debian's libunwind.a is not
# PIC, so libunwind.so.8 ships beside the shim and is dlopen'ed privately (frames.c says why).
# The import mechanism goes in too: emulated legacy IPC imports through it (its symbols stay local).
# RPATH (not RUNPATH) $ORIGIN: what libunwind.so.8 needs (liblzma.so.5) is found beside the shim
# too, where a wheel or an install puts it (make wheel).
$(SHIM_SO): $(call obj,$(SHIM_SRC)) $(IMPORT_A) $(CORE_A) shim/vmmshim.map
	$(CC) -shared $(LDFLAGS) -Wl,--version-script=shim/vmmshim.map -Wl,-z,defs \
	  -Wl,--disable-new-dtags,-rpath,'$$ORIGIN' -o $@ \
	  $(call obj,$(SHIM_SRC)) $(IMPORT_A) $(CORE_A) $(LDLIBS)
	cp -L $$($(CC) -print-file-name=libunwind.so.8) $(BUILD)/libunwind.so.8
	@if readelf -d $@ | grep -E 'NEEDED.*lib(cuda|cudart)' ; then echo "vmmshim: error: $@ must not link libcuda or libcudart"; rm -f $@; exit 1; fi

$(CLIENT_SO): $(call obj,$(CLIENT_SRC)) $(CORE_A) tools/client/vmmclient.map
	$(CC) -shared $(LDFLAGS) -Wl,--version-script=tools/client/vmmclient.map -Wl,-z,defs -o $@ \
	  $(call obj,$(CLIENT_SRC)) $(CORE_A) $(LDLIBS)
	@if readelf -d $@ | grep -E 'NEEDED.*lib(cuda|cudart)' ; then echo "vmmshim: error: $@ must not link libcuda or libcudart"; rm -f $@; exit 1; fi

$(CLIENT_A): $(call obj,$(CLIENT_SRC))
	@rm -f $@; ar rcs $@ $^

# The import mechanism (shim/import) alone, for the shim: it never calls into tools/client.
$(IMPORT_A): $(call obj,$(IMPORT_SRC))
	@rm -f $@; ar rcs $@ $^

# The header as installed: tools/include/vmmshim.h with the shim's part of the API (shim/api/vmm_api.h,
# which it includes by its place in the tree) written in, so that the installed header is one file.
$(PUBLIC_H): tools/include/vmmshim.h shim/api/vmm_api.h
	@mkdir -p $(dir $@)
	awk '$$0 == "#include \"../../shim/api/vmm_api.h\"" { while ((getline l < "shim/api/vmm_api.h") > 0) print l; next } { print }' tools/include/vmmshim.h > $@
	@if grep -n '^#include "\.\./' $@; then echo "vmmshim: error: $@ still includes a path of the tree"; rm -f $@; exit 1; fi

# vmmctl keep serves a kept process's broker requests with the owner's own broker code.
$(VMMCTL): $(call obj,$(CTL_SRC)) $(BUILD)/obj/shim/broker/broker.o $(BUILD)/obj/shim/broker/dir.o $(BUILD)/obj/shim/broker/holders.o $(BUILD)/obj/shim/broker/control.o $(CLIENT_A) $(CORE_A)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

# Test equipment only: an emulated libcuda.so.1, never installed.
$(FAKE_SO): $(call obj,$(FAKE_SRC))
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libcuda.so.1 -o $@ $^ $(LDLIBS)

# An emulated runtime over the emulated driver, versioned like NVIDIA's libcudart.
$(FAKERT_SO): $(call obj,$(FAKERT_SRC)) $(FAKE_SO) tests/fakecudart/cudart.map
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libcudart.so.13 -Wl,--version-script=tests/fakecudart/cudart.map -o $@ \
	  $(call obj,$(FAKERT_SRC)) -L$(BUILD)/fakecuda -l:libcuda.so.1 $(LDLIBS)

# The same emulated runtime as CUDA 11's libcudart.so.11.0 (soname and version node), so CI runs a
# program linked against CUDA 11's runtime under the shim (tests/cuda11, tests/python/test_cuda11.py).
$(FAKERT11_SO): $(call obj,$(FAKERT_SRC)) $(FAKE_SO) tests/fakecudart/cudart.map
	@mkdir -p $(dir $@)
	sed 's/libcudart\.so\.13/libcudart.so.11.0/' tests/fakecudart/cudart.map > $(BUILD)/fakecuda11/cudart.map
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libcudart.so.11.0 -Wl,--version-script=$(BUILD)/fakecuda11/cudart.map -o $@ \
	  $(call obj,$(FAKERT_SRC)) -L$(BUILD)/fakecuda -l:libcuda.so.1 $(LDLIBS)

# tests/cuda11/cuda11_prog.c linked against that libcudart.so.11.0 (CUDA 13's headers: the calls it
# makes are the same in both); `make cuda11` builds it against CUDA 11.8's own headers and runtime.
$(CUDA11_EMU): $(BUILD)/obj/tests/cuda11/cuda11_prog.o $(FAKERT11_SO)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< -L$(BUILD)/fakecuda11 -l:libcudart.so.11.0 -L$(BUILD)/fakecuda -l:libcuda.so.1 $(LDLIBS)

# Plain CUDA runtime programs the tests run natively and under the shim (on the GPU machine the
# same sources build against NVIDIA's libcudart: tests/gpu/run.sh).
$(BUILD)/progs/%: $(BUILD)/obj/tests/progs/%.o $(FAKERT_SO)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< -L$(BUILD)/fakecuda -l:libcudart.so.13 -l:libcuda.so.1 $(LDLIBS)
# Its function is exported, so the shim's dladdr names it (tests/progs/callsite.c).
$(BUILD)/progs/callsite: LDFLAGS += -rdynamic
# An owner naming its tensors: vmm_publish comes from the client library, and from the shim
# when it runs under it (tests/progs/named.c).
$(BUILD)/progs/named $(BUILD)/progs/tags: $(CLIENT_SO)
$(BUILD)/progs/named $(BUILD)/progs/tags: LDLIBS := -L$(BUILD) -l:libvmmshim-client.so -Wl,-rpath,'$$ORIGIN/..' $(LDLIBS)

# The checksums the GPU scripts compare with, built here for the GPU machine (tests/gpu/checksums.c).
$(CHECKSUMS_SO): $(BUILD)/obj/tests/gpu/checksums.o
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -o $@ $^

# An LD_PRELOAD logger of a real program's allocation calls, for the GPU machine
# (tests/gpu/alloc_trace.c); its traces replay over the emulated driver.
$(TRACE_SO): $(BUILD)/obj/tests/gpu/alloc_trace.o
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -o $@ $^ -ldl -pthread

# A library named like NCCL that makes its own VMM memory (tests/progs/lib/nccl_standin.c).
$(NCCL_STANDIN_SO): $(BUILD)/obj/tests/progs/lib/nccl_standin.o $(FAKE_SO)
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -o $@ $< -L$(BUILD)/fakecuda -l:libcuda.so.1

$(BUILD)/tests/%: $(BUILD)/obj/tests/unit/%.o $(CLIENT_A) $(CORE_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

# Each fuzz target built with the normal compiler and a main that replays its seeds and crash
# regressions (tests/fuzz/corpus, tests/fuzz/regress): tests/run.sh runs them with the unit tests.
$(BUILD)/tests/test_fuzz_%: $(BUILD)/obj/tests/fuzz/fuzz_%.o $(BUILD)/obj/tests/fuzz/replay.o $(CLIENT_A) $(CORE_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(GEN_SEEDS): $(BUILD)/obj/tests/fuzz/gen_seeds.o $(CORE_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

test: all
	@BUILD=$(BUILD) SAN=$(SAN) tests/run.sh

# The CI command: the plain build, then the sanitizer builds, each running every test.
check:
	@tests/check.sh

# Fuzzing with libFuzzer (clang; ASan + UBSan): every target for FUZZ_SECONDS, then a table and
# `fuzz: N passed, N failed` (tests/fuzz/run.sh).  New corpus entries and crash inputs go to
# build-fuzz/work, never into the repository.
FUZZ_CC      ?= clang
FUZZ_BUILD   := build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_FLAGS   := -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -pthread
FUZZ_LIB     := $(FUZZ_BUILD)/libvmmfuzz.a
FUZZERS      := $(patsubst %,$(FUZZ_BUILD)/fuzz_%,$(FUZZ_TARGETS))

# clang and its libFuzzer runtime (Debian's libclang-rt-dev, only recommended by clang).
fuzz-deps:
	@t=$$(mktemp); printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' | \
	  $(FUZZ_CC) -fsanitize=fuzzer,address,undefined -x c - -o $$t >/dev/null 2>&1; ok=$$?; rm -f $$t; \
	if [ $$ok != 0 ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "vmmshim: installing clang libclang-rt-dev"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-rt-dev) >/dev/null || exit 1; \
	  else echo "vmmshim: error: make fuzz needs clang with libFuzzer; run: sudo apt-get install -y clang libclang-rt-dev"; exit 1; fi; \
	fi

$(FUZZ_BUILD)/obj/%.o: %.c | deps fuzz-deps
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(CPPFLAGS) $(WARN) $(FUZZ_FLAGS) -MMD -MP -c $< -o $@

$(FUZZ_LIB): $(patsubst %.c,$(FUZZ_BUILD)/obj/%.o,$(CORE_SRC) $(CLIENT_SRC))
	@rm -f $@; ar rcs $@ $^

$(FUZZ_BUILD)/fuzz_%: $(FUZZ_BUILD)/obj/tests/fuzz/fuzz_%.o $(FUZZ_LIB)
	$(FUZZ_CC) $(FUZZ_FLAGS) -o $@ $^ $(LDLIBS)

fuzz: $(FUZZERS)
	@FUZZ_BUILD=$(FUZZ_BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) tests/fuzz/run.sh $(FUZZ_TARGETS)

# Rewrites the seeds in tests/fuzz/corpus from the real writer, encoder and options table.
fuzz-seeds: $(GEN_SEEDS)
	$(GEN_SEEDS) tests/fuzz/corpus

# On the GPU machine, with build/ carried from a development machine (the GPU machine has no
# uthash or libunwind): the real-GPU checks and the PyTorch runs.
test-gpu:
	@BUILD=$(BUILD) tests/gpu/run.sh

# On the GPU machine as test-gpu: the shim's cost against native (churn, many small allocations,
# out-of-memory reach, alignment, PyTorch steps), native and shim runs alternated, one ratio table
# (tests/gpu/bench.sh; ROUNDS, default 3); the memory rows of issue 15 measured with NVML and a
# GPU-bound PyTorch step (tests/gpu/bench_mem.py; MEM_ROUNDS, STEP_ROUNDS); then what a companion
# costs: imports and dump (tests/gpu/companion_bench.sh); then a second process taking a whole model
# (tests/gpu/weight_sync.sh, issue 16; with BENCH_DRY=1 its stand-in run over the emulated driver).
# BENCH_ONLY=speed|mem|companion|weightsync or row names (see bench.sh) runs a part: everything takes
# longer than 10 minutes.
bench-gpu:
	@BUILD=$(BUILD) tests/gpu/bench.sh; a=$$?; \
	case ",$${BENCH_ONLY:-all},$${BENCH_DRY:-0}" in *,1) ;; *,all,* | *,companion,*) BUILD=$(BUILD) tests/gpu/companion_bench.sh || a=1 ;; esac; \
	case ",$${BENCH_ONLY:-all}," in *,all,* | *,weightsync,*) BUILD=$(BUILD) tests/gpu/weight_sync.sh || a=1 ;; esac; \
	exit $$a

# On the GPU machine as test-gpu: real programs and frameworks (static runtime, driver API, legacy
# IPC, PyTorch, JAX, CuPy, cuBLAS) natively and under the shim, one table (tests/gpu/matrix.sh).
test-matrix:
	@BUILD=$(BUILD) tests/gpu/matrix.sh

# The main job: a sample CUDA program under the shim, then vmmctl as a companion.
demo: all
	@BUILD=$(BUILD) tests/scripts/demo.sh

install: all
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/share/vmmshim
	install -m 755 $(SHIM_SO) $(CLIENT_SO) $(BUILD)/libunwind.so.8 $(DESTDIR)$(PREFIX)/lib/
	install -m 644 $(CLIENT_A) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(VMMCTL) $(DESTDIR)$(PREFIX)/bin/
	install -m 644 $(PUBLIC_H) $(DESTDIR)$(PREFIX)/include/
	install -m 644 config/vmmshim.conf $(DESTDIR)$(PREFIX)/share/vmmshim/
	sed -e 's|@PREFIX@|$(PREFIX)|g' tools/client/vmmshim.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/vmmshim.pc

# One platform wheel (no extension module): the shim with libunwind beside it, the client library,
# vmmctl (a script on PATH), vmmshim.h and the Python package, with `vmmshim run` and `vmmshim
# doctor` (tools/python/build_wheel.py; no network, no wheel package: zipfile and a RECORD).
# patchelf (Debian's, as auditwheel uses it) gives the bundled libunwind.so.8 its RUNPATH.
WHEEL_DIR ?= $(BUILD)/dist
wheel: $(SHIM_SO) $(CLIENT_SO) $(VMMCTL)
	@if ! command -v patchelf >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then echo "vmmshim: installing patchelf"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq patchelf) >/dev/null || exit 1; \
	  else echo "vmmshim: error: make wheel needs patchelf; run: sudo apt-get install -y patchelf"; exit 1; fi; \
	fi
	@python3 tools/python/build_wheel.py --build $(BUILD) --out $(WHEEL_DIR)

# CUDA 11.8's runtime and headers from Debian bookworm's non-free component (a private apt source
# list under build/cuda11: the system's sources are left alone; nvidia-cuda-dev is a 774 MB
# download, of which only /usr/include is kept), and tests/cuda11/cuda11_prog built against them,
# for the GPU machine: tests/gpu/cuda11.sh.
cuda11: $(SHIM_SO) $(VMMCTL)
	@BUILD=$(BUILD) CC=$(CC) tests/cuda11/build.sh

clean:
	rm -rf build build-asan build-ubsan build-tsan $(FUZZ_BUILD)

-include $(shell find $(BUILD)/obj $(FUZZ_BUILD)/obj -name '*.d' 2>/dev/null)
