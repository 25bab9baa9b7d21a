#!/usr/bin/env bash
# A rank that dies before or during ep_group_create_from_env (issue 16, item 7): exit 1, SIGKILL
# or exit 0 before creating its group, or SIGKILL inside the creation. The survivors' creation
# must fail within 3 s of the death with an epcomm error naming the rank (the launcher's grace is
# 20 s and EP_TIMEOUT_S 20 s, so neither can be what ends them), and they exit 0 on their own.
# Usage: tests/test_early_death.sh BUILD_DIR    (exit 0 pass, 1 fail; prints the figures)
set -u
b=${1:?usage: test_early_death.sh BUILD_DIR}
epcomm=$b/bin/epcomm prog=$b/tests/test_failure
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
say() { echo "test_early_death.sh: $*" >&2; fail=1; }

scenario() { # mode victim launcher_status
  local mode=$1 victim=$2 want=$3 rc t0 t1
  rm -f "$tmp/death"
  t0=$(date +%s.%N)
  EP_TIMEOUT_S=20 timeout 60 "$epcomm" launch -n 3 --grace 20 "$prog" "early-$mode" \
    "$tmp/death" >"$tmp/$mode.out" 2>"$tmp/$mode.err"
  rc=$?
  t1=$(date +%s.%N)
  [ "$rc" = "$want" ] || say "$mode: launcher exited $rc, expected $want ($(cat "$tmp/$mode.err"))"
  local seen; seen=$(grep -c "detected group creation death of rank $victim in" "$tmp/$mode.out")
  [ "$seen" = 2 ] || say "$mode: $seen of 2 survivors reported the death of rank $victim: $(cat "$tmp/$mode.out")"
  grep -v "epcomm launch: rank $victim (pid [0-9]*) \(exited with status 1\|killed by signal 9\)" \
    "$tmp/$mode.err" | grep -q . && say "$mode: unexpected stderr: $(cat "$tmp/$mode.err")"
  sed "s/^/$mode: /" "$tmp/$mode.out"
  awk -v a="$t0" -v b="$t1" -v m="$mode" 'BEGIN { printf "%s: whole job %.2f s\n", m, b - a }'
}

scenario exit1 2 1
scenario kill 2 137
scenario exit0 2 0
scenario during 1 137
exit $fail
