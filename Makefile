# Thin wrapper over CMake. `make demo` and `make test` are the two commands of the README.
BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_ARGS ?=
RANKS      ?= 4

.PHONY: all demo test test-asan test-valgrind bench clean configure

all: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)

# A 4-rank dispatch/combine on the CPU backend, checked against the reference, with figures.
demo: all
	$(BUILD)/bin/epcomm launch -n $(RANKS) $(BUILD)/bin/epcomm demo

# The whole suite; ends with "N passed, N failed, N skipped".
test: all
	tests/run.sh $(BUILD)

# The same suite built with AddressSanitizer + UndefinedBehaviorSanitizer.
$(ASAN_BUILD)/CMakeCache.txt:
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DEP_SANITIZE=ON -DEP_CUDA=OFF $(CMAKE_ARGS)

test-asan: $(ASAN_BUILD)/CMakeCache.txt
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  tests/run.sh $(ASAN_BUILD)

bench: all
	$(BUILD)/bin/epcomm launch -n $(RANKS) $(BUILD)/bin/epcomm bench

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
