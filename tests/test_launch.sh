#!/usr/bin/env bash
# Tests `epcomm launch`. Usage: tests/test_launch.sh path/to/epcomm
# Prints one line per check; exits 0 if all passed, 1 otherwise. Runs in well under 30 s.
#
# SC2016: the single-quoted scripts are expanded by the ranks' sh, on purpose.
# SC2015: `A && B || fail` is meant: fail when either check fails.
# shellcheck disable=SC2016,SC2015
set -u

EPCOMM=${1:?usage: $0 path/to/epcomm}
[ -x "$EPCOMM" ] || { echo "FAIL: '$EPCOMM' is not an executable"; exit 1; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/test_launch.XXXXXX") || exit 1
trap 'rm -rf "$TMP"' EXIT
failed=0

ok() { echo "ok   - $1"; }
bad() { echo "FAIL - $1: $2"; failed=1; }

# Runs the launcher (bounded by `timeout`, so a hang fails instead of blocking) with stdout and
# stderr captured in $TMP/out and $TMP/err; sets rc and secs (elapsed, whole seconds).
launch() {
  local t0=$SECONDS
  timeout -s KILL 25 "$EPCOMM" launch "$@" >"$TMP/out" 2>"$TMP/err"
  rc=$?
  secs=$((SECONDS - t0))
}

# expect NAME WANT_RC: checks the exit status and prints the captured streams on failure.
expect_rc() {
  if [ "$rc" -eq "$2" ]; then return 0; fi
  bad "$1" "exit status $rc, want $2; stderr: $(head -c 400 "$TMP/err")"
  return 1
}

has_line() { grep -qxF -- "$2" "$TMP/$1"; }

test_env() {
  local name="env vars per rank"
  launch -n 3 sh -c 'echo $EP_RANK/$EP_NRANKS $EP_LOCAL_RANK/$EP_LOCAL_SIZE $EP_JOB_ID $EP_NOTIFY_FD'
  expect_rc "$name" 0 || return
  local r
  for r in 0 1 2; do
    grep -qE "^\[$r\] $r/3 $r/3 [A-Za-z0-9._-]+ [0-9]+$" "$TMP/out" ||
      { bad "$name" "no well-formed line for rank $r in: $(cat "$TMP/out")"; return; }
  done
  local ids
  ids=$(awk '{print $4}' "$TMP/out" | sort -u | wc -l)
  [ "$ids" -eq 1 ] || { bad "$name" "EP_JOB_ID differs between ranks"; return; }
  local id1
  id1=$(awk '{print $4}' "$TMP/out" | head -1)
  launch -n 1 sh -c 'echo $EP_JOB_ID'
  [ "$(cat "$TMP/out")" != "[0] $id1" ] || { bad "$name" "EP_JOB_ID repeats across launches"; return; }
  ok "$name"
}

test_tagging() {
  local name="output tagging (stdout/stderr kept apart, partial line flushed)"
  launch -n 2 sh -c 'echo out$EP_RANK; echo err$EP_RANK >&2; printf part$EP_RANK'
  expect_rc "$name" 0 || return
  local r
  for r in 0 1; do
    has_line out "[$r] out$r" && has_line out "[$r] part$r" && has_line err "[$r] err$r" ||
      { bad "$name" "rank $r: stdout=$(cat "$TMP/out") stderr=$(cat "$TMP/err")"; return; }
  done
  [ "$(wc -l <"$TMP/out")" -eq 4 ] && [ "$(wc -l <"$TMP/err")" -eq 2 ] ||
    { bad "$name" "unexpected extra lines"; return; }
  launch -n 1 --no-tag -- sh -c 'printf "%s\n" "$*"' sh -n --not-ours
  has_line out "-n --not-ours" || { bad "$name" "--no-tag/--: got '$(cat "$TMP/out")'"; return; }
  ok "$name"
}

test_clean_silent() {
  local name="clean run is silent on stderr"
  launch -n 4 sh -c 'echo hello'
  expect_rc "$name" 0 || return
  [ ! -s "$TMP/err" ] || { bad "$name" "stderr: $(cat "$TMP/err")"; return; }
  [ "$(grep -c hello "$TMP/out")" -eq 4 ] || { bad "$name" "missing output"; return; }
  ok "$name"
}

test_exit_status() {
  local name="exit status propagation"
  launch -n 3 --grace 5 sh -c 'if [ $EP_RANK = 1 ]; then exit 3; fi; exit 0'
  expect_rc "$name" 3 || return
  grep -qE '^epcomm launch: rank 1 \(pid [0-9]+\) exited with status 3$' "$TMP/err" ||
    { bad "$name" "no death line: $(cat "$TMP/err")"; return; }
  [ "$(wc -l <"$TMP/err")" -eq 1 ] || { bad "$name" "extra stderr: $(cat "$TMP/err")"; return; }
  launch -n 1 /nonexistent/program
  expect_rc "$name (exec failure)" 127 || return
  grep -qF "cannot run '/nonexistent/program'" "$TMP/err" ||
    { bad "$name" "no exec error: $(cat "$TMP/err")"; return; }
  ok "$name"
}

# Rank 1 SIGKILLs itself; ranks 0 and 2 wait (poll, no sleep) on EP_NOTIFY_FD and peek twice.
NOTIFY_PY='
import os, select, socket
s = socket.fromfd(int(os.environ["EP_NOTIFY_FD"]), socket.AF_UNIX, socket.SOCK_STREAM)
p = select.poll(); p.register(s, select.POLLIN)
if not p.poll(10000): print("no notification"); raise SystemExit(1)
a = s.recv(4096, socket.MSG_PEEK); b = s.recv(4096, socket.MSG_PEEK)
print("peeked:", a.decode().strip(), "| again:", a == b)
'
test_notify() {
  local name="death notification on EP_NOTIFY_FD"
  if ! command -v python3 >/dev/null; then echo "skip - $name: no python3"; return; fi
  launch -n 3 --grace 10 sh -c 'if [ $EP_RANK = 1 ]; then kill -9 $$; fi; exec python3 -c "$1"' \
    sh "$NOTIFY_PY"
  expect_rc "$name" 137 || return
  local r
  for r in 0 2; do
    grep -qE "^\[$r\] peeked: dead rank=1 pid=[0-9]+ how=killed by signal 9 \(Killed\) \| again: True$" \
      "$TMP/out" || { bad "$name" "rank $r saw: $(cat "$TMP/out")"; return; }
  done
  [ "$(grep -c 'rank 1 (pid [0-9]*) killed by signal 9 (Killed)$' "$TMP/err")" -eq 1 ] ||
    { bad "$name" "want one death line, stderr: $(cat "$TMP/err")"; return; }
  [ "$secs" -le 5 ] || { bad "$name" "took ${secs}s: survivors should exit on their own"; return; }
  ok "$name"
}

test_grace_kill() {
  local name="grace then SIGTERM then SIGKILL for a rank that traps SIGTERM"
  launch -n 2 --grace 0.5 sh -c 'if [ $EP_RANK = 1 ]; then exit 1; fi
    trap "echo ignoring TERM" TERM; while :; do sleep 0.1; done'
  expect_rc "$name" 1 || return
  has_line out "[0] ignoring TERM" || { bad "$name" "rank 0 never got SIGTERM"; return; }
  grep -qE 'rank 0 \(pid [0-9]+\) killed by signal 9 \(Killed\)$' "$TMP/err" ||
    { bad "$name" "rank 0 not SIGKILLed: $(cat "$TMP/err")"; return; }
  [ "$secs" -le 8 ] || { bad "$name" "took ${secs}s, want about 3.5"; return; }
  ok "$name (${secs}s)"
}

test_timeout() {
  local name="--timeout exits 124"
  launch -n 2 --timeout 0.5 --grace 0.5 sh -c 'trap "" TERM; sleep 20'
  expect_rc "$name" 124 || return
  has_line err "epcomm launch: timeout after 0.5 s; terminating ranks" ||
    { bad "$name" "stderr: $(cat "$TMP/err")"; return; }
  [ "$secs" -le 4 ] || { bad "$name" "took ${secs}s"; return; }
  ok "$name"
}

test_forward_signal() {
  local name="SIGTERM to the launcher is forwarded to the ranks"
  timeout -s KILL 25 "$EPCOMM" launch -n 2 sh -c \
    'trap "echo got TERM; exit 0" TERM; echo ready; while :; do sleep 0.05; done' \
    >"$TMP/out" 2>"$TMP/err" &
  local pid=$!
  for _ in $(seq 200); do # readiness handshake: both ranks have printed "ready"
    [ "$(grep -c ready "$TMP/out")" -eq 2 ] && break
    sleep 0.05
  done
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  rc=$?
  expect_rc "$name" 143 || return
  has_line out "[0] got TERM" && has_line out "[1] got TERM" ||
    { bad "$name" "stdout: $(cat "$TMP/out")"; return; }
  ok "$name"
}

test_shm_cleanup() {
  local name="/dev/shm entries of the job are removed"
  [ -d /dev/shm ] && [ -w /dev/shm ] || { echo "skip - $name: no writable /dev/shm"; return; }
  launch -n 2 sh -c 'touch /dev/shm/epcomm-$EP_JOB_ID-r$EP_RANK; echo $EP_JOB_ID'
  expect_rc "$name" 0 || return
  local id
  id=$(awk '{print $2; exit}' "$TMP/out")
  [ -n "$id" ] && ! ls /dev/shm/epcomm-"$id"* >/dev/null 2>&1 ||
    { bad "$name" "left: $(ls /dev/shm/epcomm-"$id"* 2>&1)"; return; }
  ok "$name"
}

test_usage() {
  local name="argument errors exit 2 with one line"
  local args
  for args in "" "-n" "-n 0" "-n 4097" "-n x" "-n 2" "-n 2 --bogus true" "-n 2 --timeout -1 true" \
    "-n 2 --grace abc true"; do
    # shellcheck disable=SC2086 # split on purpose
    launch $args
    [ "$rc" -eq 2 ] && [ "$(wc -l <"$TMP/err")" -eq 1 ] ||
      { bad "$name" "'launch $args': rc=$rc stderr=$(cat "$TMP/err")"; return; }
  done
  ok "$name"
}

test_env
test_tagging
test_clean_silent
test_exit_status
test_notify
test_grace_kill
test_timeout
test_forward_signal
test_shm_cleanup
test_usage

if [ "$failed" -ne 0 ]; then
  echo "test_launch: FAILED"
  exit 1
fi
echo "test_launch: all passed"
