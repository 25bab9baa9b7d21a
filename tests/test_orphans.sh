#!/usr/bin/env bash
# Killing the launcher (issue 16, item 5). Three runs of 3 ranks looping dispatch/combine:
#  1. kill -9 of `epcomm launch`: every rank is gone within 3 s (checked by pid: PR_SET_PDEATHSIG);
#  2. the same with every rank a grandchild of the launcher (sh -c 'prog; :'), which the death
#     signal does not reach: the ranks see EOF on the launcher's notify socket and fail their
#     calls with "launcher died" within 3 s, then exit;
#  3. as 2, with rank 0 deaf to the launcher (EP_NOTIFY_FD unset): it learns of the death only
#     from a peer's verdict, and must still name the launcher (a killed launcher's sockets close
#     one by one, so a rank can meet that verdict before its own EOF: CI once saw it);
#  4. SIGINT to the launcher's process group (Ctrl-C on a terminal) reaches every rank.
# After each: no rank left, nothing of the job in /dev/shm or among the abstract sockets.
# Usage: tests/test_orphans.sh BUILD_DIR       (exit 0 pass, 1 fail; prints the figures)
set -u
b=${1:?usage: test_orphans.sh BUILD_DIR}
epcomm=$(cd "$b" && pwd)/bin/epcomm prog=$(cd "$b" && pwd)/tests/test_failure
tmp=$(mktemp -d)
lpid=""
cleanup() { [ -n "$lpid" ] && kill -9 "$lpid" 2>/dev/null; for f in "$tmp"/*/pid.*; do
  [ -f "$f" ] && kill -9 "$(cut -d' ' -f1 "$f")" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
fail=0
say() { echo "test_orphans.sh: $*" >&2; fail=1; }

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

# Waits (bounded) until the 3 ranks have written their pids: they are in their loop.
wait_ready() { # dir
  local i
  for i in $(seq 300); do
    [ "$(ls "$1"/pid.* 2>/dev/null | wc -l)" = 3 ] && return 0
    sleep 0.05
  done
  say "$1: the ranks never started"; return 1
}

# Waits up to 3 s for every rank's pid to disappear; prints how long it took.
wait_gone() { # name dir t0
  local i pid alive
  for i in $(seq 300); do
    alive=""
    for f in "$2"/pid.*; do
      pid=$(cut -d' ' -f1 "$f")
      # a zombie (reaped by init at once, but be exact) counts as gone
      [ -d "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null && alive="$alive $pid"
    done
    [ -z "$alive" ] && { echo "$1: every rank gone $(since "$3") s after the signal"; return 0; }
    sleep 0.01
  done
  say "$1: ranks still alive 3 s after the launcher's death:$alive"
}

check_clean() { # name dir
  local job; job=$(cut -d' ' -f2 "$2/pid.0")
  ls /dev/shm 2>/dev/null | grep -q "epcomm-$job" && say "$1: /dev/shm holds $(ls /dev/shm | grep "epcomm-$job")"
  grep -q "@epcomm-$job" /proc/net/unix && say "$1: sockets of the job left: $(grep "@epcomm-$job" /proc/net/unix)"
}

# Starts the job in the background in its own session (own process group, as a terminal's
# foreground job would be, with SIGINT at its default: a script's background job ignores it).
# A wrapper waits for it and writes its exit status, so that the shell reports no job.
start() { # dir cmd...
  local d=$1; shift
  ( env --default-signal=INT setsid "$@" >"$d/out" 2>"$d/err" &
    echo $! >"$d/launcher"; wait $!; echo $? >"$d/rc" ) 2>/dev/null &
  for _ in $(seq 200); do [ -s "$d/launcher" ] && break; sleep 0.01; done
  lpid=$(cat "$d/launcher")
}

run() { # name how
  local name=$1 how=$2 d=$tmp/$1 t0
  mkdir -p "$d"
  if [ "$how" = grandchild ]; then
    start "$d" "$epcomm" launch -n 3 sh -c '"$0" loop "$1"; :' "$prog" "$d"
  elif [ "$how" = deaf ]; then
    start "$d" "$epcomm" launch -n 3 sh -c \
      '[ "$EP_RANK" = 0 ] && unset EP_NOTIFY_FD; "$0" loop "$1"; :' "$prog" "$d"
  else
    start "$d" "$epcomm" launch -n 3 "$prog" loop "$d"
  fi
  wait_ready "$d" || return
  sleep 0.3 # a few rounds
  t0=$(now)
  if [ "$how" = sigint ]; then kill -INT -- "-$lpid"; else kill -9 "$lpid"; fi
  wait_gone "$name" "$d" "$t0"
  wait
  local rc; rc=$(cat "$d/rc")
  lpid=""
  if [ "$how" = grandchild ] || [ "$how" = deaf ]; then
    local r
    for r in 0 1 2; do
      [ -f "$d/result.$r" ] || { say "$name: rank $r left no result"; continue; }
      grep -q "launcher" "$d/result.$r" || say "$name: rank $r: $(cat "$d/result.$r")"
      echo "$name: rank $r: $(cut -d' ' -f2- "$d/result.$r" | cut -c1-200)"
    done
  fi
  [ "$how" = sigint ] && [ "$rc" != 130 ] && say "$name: launcher exited $rc after SIGINT, want 130"
  check_clean "$name" "$d"
}

run kill-launcher direct
run kill-launcher-grandchildren grandchild
run kill-launcher-rank0-deaf deaf
run sigint-process-group sigint
exit $fail
