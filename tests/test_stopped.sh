#!/usr/bin/env bash
# A stopped rank costs one deadline (issue 16, item 6): with EP_TIMEOUT_S=1.5, rank 2 of 3
# SIGSTOPs itself before a combine and is resumed 4 s later. The survivors' combine fails after
# one deadline naming rank 2, and their buffer and group destroys skip the collective work, so
# combine + destroys take less than 2 deadlines (test_failure checks, per rank); the resumed rank
# says that it came too late. Usage: tests/test_stopped.sh BUILD_DIR
set -u
b=${1:?usage: test_stopped.sh BUILD_DIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
EP_TIMEOUT_S=1.5 timeout 60 "$b/bin/epcomm" launch -n 3 "$b/tests/test_failure" stop \
  >"$tmp/out" 2>"$tmp/err"
rc=$?
cat "$tmp/out"
[ "$rc" = 0 ] || { echo "test_stopped.sh: exit status $rc: $(cat "$tmp/err")" >&2; exit 1; }
[ -s "$tmp/err" ] && { echo "test_stopped.sh: stderr: $(cat "$tmp/err")" >&2; exit 1; }
[ "$(grep -c 'combine failed after' "$tmp/out")" = 2 ] ||
  { echo "test_stopped.sh: not every survivor reported" >&2; exit 1; }
grep -q "(resumed)" "$tmp/out" || { echo "test_stopped.sh: the resumed rank did not report" >&2; exit 1; }
exit 0
