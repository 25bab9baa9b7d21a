# Thin wrapper over CMake. `make demo` and `make test` are the two commands of the README.
BUILD      ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_ARGS ?=
RANKS      ?= 4
FUZZ_SECS  ?= 60
PREFIX     ?= /usr/local

.PHONY: all demo test test-quick test-asan asan-build fuzz fuzz-build bench install clean

all: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)

# A 4-rank dispatch/combine on the CPU backend, checked against the reference, with figures.
demo: all
	$(BUILD)/bin/epcomm launch -n $(RANKS) $(BUILD)/bin/epcomm demo

# The whole suite, twice: the normal build and the ASan+UBSan build (plus a short run of the
# libFuzzer target; `make fuzz` is the long one). One runner, one total line at the end:
# "N passed, N failed, N skipped".
test: all asan-build fuzz-build
	$(SAN_ENV) tests/run.sh $(BUILD) $(ASAN_BUILD)

# Only the plain build (quick), or only the sanitizer build.
test-quick: all
	tests/run.sh $(BUILD)

test-asan: asan-build
	$(SAN_ENV) tests/run.sh $(ASAN_BUILD)

SAN_ENV = ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

$(ASAN_BUILD)/CMakeCache.txt:
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DEP_SANITIZE=ON -DEP_CUDA=OFF $(CMAKE_ARGS)

asan-build: $(ASAN_BUILD)/CMakeCache.txt
	cmake --build $(ASAN_BUILD) -j $(JOBS)

# libFuzzer needs clang; without it the fuzz test reports itself skipped.
$(FUZZ_BUILD)/CMakeCache.txt:
	@if command -v clang >/dev/null; then \
	  CC=clang cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Debug -DEP_FUZZ=ON -DEP_CUDA=OFF \
	    -DEP_BUILD_MPI=OFF $(CMAKE_ARGS); fi

fuzz-build: $(FUZZ_BUILD)/CMakeCache.txt
	@if [ -f $(FUZZ_BUILD)/CMakeCache.txt ]; then cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzz_args; fi

fuzz: fuzz-build
	tests/fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_SECS)

bench: all
	$(BUILD)/bin/epcomm launch -n $(RANKS) $(BUILD)/bin/epcomm bench

# The library, header, CLI, rulebook, epcomm.pc and CMake package under $(PREFIX).
install: all
	cmake --install $(BUILD) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
