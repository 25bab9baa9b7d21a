#!/usr/bin/env bash
# A stopped rank costs one deadline (issue 16, item 6): with EP_TIMEOUT_S=1.5, rank 2 of 3
# SIGSTOPs itself before a combine and is resumed 4 s later. The survivors' combine fails after
# one deadline naming rank 2, and their buffer and group destroys skip the collective work, so
# combine + destroys take less than 2 deadlines (test_failure checks, per rank); the resumed rank
# says that it came too late. Then the same in an ep_group_barrier (the bootstrap's channel), with
# rank 0 entering it 0.3 s after rank 1: rank 1 must still name rank 2, not rank 0; and once more
# with rank 1 stopped while rank 0 gives up, tells it and exits (rank 1 still names rank 2).
# Usage: tests/test_stopped.sh BUILD_DIR
set -u
b=${1:?usage: test_stopped.sh BUILD_DIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # mode what
  EP_TIMEOUT_S=1.5 timeout 60 "$b/bin/epcomm" launch -n 3 "$b/tests/test_failure" "$1" \
    >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  cat "$tmp/out"
  [ "$rc" = 0 ] || { echo "test_stopped.sh: $1: exit status $rc: $(cat "$tmp/err")" >&2; exit 1; }
  [ -s "$tmp/err" ] && { echo "test_stopped.sh: $1: stderr: $(cat "$tmp/err")" >&2; exit 1; }
  [ "$(grep -c "$2 failed after" "$tmp/out")" = 2 ] ||
    { echo "test_stopped.sh: $1: not every survivor reported" >&2; exit 1; }
  grep -q "(resumed)" "$tmp/out" ||
    { echo "test_stopped.sh: $1: the resumed rank did not report" >&2; exit 1; }
}
run stop combine
run stop-barrier barrier
run stop-barrier-gone barrier
exit 0
