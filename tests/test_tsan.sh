#!/usr/bin/env bash
# The CPU backend's threads under ThreadSanitizer. With EP_CHANNELS > 1 every channel's thread
# waits, checks the peers' liveness and may fail the call, at the same time: a data race there
# once let a thread report a death as "exited" while another was still learning from the
# launcher how it died. The suite's ASan build does not see races, so this builds the launcher
# and three test programs with -fsanitize=thread (into BUILD_DIR/tsan) and runs, with several
# channels: the failure scenarios (tests/test_failure.sh, which fails on any stderr line), the
# concurrent-buffers test and a dispatch/combine run. Any ThreadSanitizer report fails it.
# Usage: tests/test_tsan.sh BUILD_DIR   (exit 0 pass, 1 fail, 77 skipped without TSan)
set -u -o pipefail
b=$(cd "${1:?usage: test_tsan.sh BUILD_DIR}" && pwd) || exit 2
src=$(cd "$(dirname "$0")/.." && pwd)
t=$b/tsan
say() { echo "test_tsan.sh: $*" >&2; exit 1; }

probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
echo 'int main(void) { return 0; }' >"$probe/p.c"
if ! cc -fsanitize=thread "$probe/p.c" -o "$probe/p" 2>/dev/null || ! "$probe/p" 2>/dev/null; then
  echo "skipped: no ThreadSanitizer here (cc -fsanitize=thread does not build or run)"
  exit 77
fi

flags="-fsanitize=thread -O1 -g"
cmake -S "$src" -B "$t" -DCMAKE_BUILD_TYPE=Debug -DEP_CUDA=OFF -DEP_BUILD_MPI=OFF \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread \
  -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread >"$t.log" 2>&1 &&
  cmake --build "$t" -j "$(getconf _NPROCESSORS_ONLN)" \
    --target epcomm_cli test_failure test_threads test_normal >>"$t.log" 2>&1 ||
  say "the TSan build failed (log: $t.log)"

export TSAN_OPTIONS="halt_on_error=0 exitcode=66"
export EP_CHANNELS=3
bash "$src/tests/test_failure.sh" "$t" >"$probe/failure.log" 2>&1 ||
  say "test_failure.sh under TSan, 3 channels: $(grep -m1 -A12 'ThreadSanitizer\|test_failure.sh:' "$probe/failure.log")"
echo "failure scenarios, 3 channels: no race"

run() { # ranks channels program args...
  local n=$1 ch=$2 prog=$3; shift 3
  EP_CHANNELS=$ch timeout 120 "$t/bin/epcomm" launch -n "$n" "$t/tests/$prog" "$@" >"$probe/run.log" 2>&1 ||
    say "$prog at $n ranks, $ch channels: exit $? $(grep -m1 -A12 'ThreadSanitizer' "$probe/run.log")"
  ! grep -q ThreadSanitizer "$probe/run.log" ||
    say "$prog at $n ranks, $ch channels: $(grep -m1 -A12 'ThreadSanitizer' "$probe/run.log")"
  echo "$prog at $n ranks, $ch channels: no race"
}
run 3 2 test_threads
run 3 3 test_normal
