#!/usr/bin/env bash
# Peer failure and timeouts end to end (docs/SEMANTICS.md §8.1-8.2): for each scenario, run
# test_failure under `epcomm launch -n R` and check that the survivors detected the failure in
# time and exited 0, that the launcher named the dead rank and how, and that /dev/shm is clean.
# Usage: tests/test_failure.sh BUILD_DIR        (exit 0 pass, 1 fail; silent when passing)
#        tests/test_failure.sh BUILD_DIR cuda   the dispatch (pushed and pulled), low-latency
#                                               and allocator (late hello) scenarios on the
#                                               CUDA backend
#                                               (exit 77 with "skipped: no GPU" without one)
set -u
b=${1:?usage: test_failure.sh BUILD_DIR}
epcomm=$b/bin/epcomm prog=$b/tests/test_failure
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
say() { echo "test_failure.sh: $*" >&2; fail=1; }

scenario() { # name ranks victim
  local name=$1 n=$2 victim=$3 rc
  rm -f "$tmp/death"
  timeout 60 "$epcomm" launch -n "$n" --grace 20 "$prog" "$name" "$tmp/death" \
    >"$tmp/$name.out" 2>"$tmp/$name.err"
  rc=$?
  [ "$rc" = 137 ] || say "$name: launcher exited $rc, expected 137 (rank $victim SIGKILLed)"
  grep -q "epcomm launch: rank $victim (pid [0-9]*) killed by signal 9" "$tmp/$name.err" ||
    say "$name: launcher did not report the death of rank $victim"
  local others; others=$(grep -v "killed by signal 9" "$tmp/$name.err")
  [ -z "$others" ] || say "$name: unexpected stderr: $others"
  local seen; seen=$(grep -c "detected .* death of rank $victim in" "$tmp/$name.out")
  [ "$seen" = $((n - 1)) ] || say "$name: $seen of $((n - 1)) survivors reported detection"
  grep "detected" "$tmp/$name.out"
}

survive() { # name: every rank (3) fails as the scenario says, exits 0, prints nothing on stderr
  local mode=$1
  timeout 60 "$epcomm" launch -n 3 "$prog" "$mode" >"$tmp/$mode.out" 2>"$tmp/$mode.err" ||
    say "$mode: exit status $? ($(cat "$tmp/$mode.err"))"
  [ -s "$tmp/$mode.err" ] && say "$mode: stderr: $(cat "$tmp/$mode.err")"
  [ "$(grep -c 'rank [0-9]*: EP_ERR' "$tmp/$mode.out")" = 3 ] ||
    say "$mode: not every rank reported its failure: $(cat "$tmp/$mode.out")"
  grep "EP_ERR" "$tmp/$mode.out"
}

if [ "${2:-}" = cuda ]; then
  export EP_BACKEND=cuda
  timeout 60 "$prog" probe >"$tmp/probe" 2>&1
  if grep -q "skipped: no GPU" "$tmp/probe"; then grep -m1 skipped "$tmp/probe"; exit 77; fi
  scenario kill-ll 3 2
  scenario kill-dispatch 3 2                   # windows of pushed rows
  EP_QUEUE_BYTES=1M scenario kill-dispatch 3 2 # every row at once: pulled
  EP_CUDA_LATE_HELLO=1 scenario kill-alloc 3 2
  EP_CUDA_LATE_HELLO=1 survive slow-alloc
  EP_CUDA_LATE_HELLO=0 EP_CUDA_EARLY_DATA=1 scenario kill-alloc 3 2
  EP_CUDA_LATE_HELLO=0 EP_CUDA_EARLY_DATA=1 survive slow-alloc
  exit $fail
fi

scenario kill-dispatch 3 2
scenario kill-combine 4 3
scenario kill-alloc 3 2
scenario kill-create 3 2
scenario kill-root 3 0
scenario kill-ll 3 2

for mode in timeout timeout-gone slow-alloc; do survive $mode; done

left=$(ls /dev/shm 2>/dev/null | grep -i epcomm)
[ -z "$left" ] || say "/dev/shm not clean: $left"
exit $fail
