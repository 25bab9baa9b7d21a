#!/usr/bin/env bash
# `epcomm bench` on either backend through one command line: `--backend cuda` where there is no
# GPU is a skip that says so ("skipped: no GPU", exit 77, rank 0 only) and, where there is one, a
# checked run; options a program or backend cannot run are refused by name before any work, by
# epcomm bench and by the MPI baseline program alike (the same parser); a rank that cannot
# prepare a collective loop, or check its outputs, stops every rank at once (EP_BENCH_REFUSE).
# With `nccl`: only the GPU's NCCL baseline across pretend hosts, a checked run and a rank that
# cannot open NCCL or its communicator (exit 77, "skipped: no GPU", where there is none).
# usage: tests/test_bench_cli.sh BUILD_DIR [nccl]   one line per check; exit 0 all passed, 1 otherwise
set -u
build=$(cd "${1:?usage: test_bench_cli.sh BUILD_DIR [nccl]}" && pwd)
bin=$build/bin/epcomm
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epcomm-test-bench-cli.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
check() {
  if [ -z "$2" ]; then passed=$((passed + 1)); printf 'PASS %s\n' "$1"
  else failed=$((failed + 1)); printf 'FAIL %s: %s\n' "$1" "$2"; fi
}
run() { timeout -s KILL 120 "$@" >"$tmp/out" 2>"$tmp/err" </dev/null; rc=$?; }
has() { grep -qE -- "$2" "$tmp/$1"; }
count() { grep -cE -- "$2" "$tmp/$1"; }
tiny=(--tokens 64 --hidden 256 --topk 2 --experts 8 --warmup 1 --iters 2)

# ---- nccl: the GPU baseline across 2 pretend hosts of 2 ranks (one communicator over all four)
if [ "${2:-}" = nccl ]; then
  net=(--backend cuda --hosts 2 "${tiny[@]}" --baseline on)
  run "$bin" launch -n 4 --hosts 2 --timeout 100 "$bin" bench "${net[@]}" --json "$tmp/r.json"
  if [ "$rc" = 77 ]; then
    cat "$tmp/out"
    exit 77
  fi
  why=""
  [ "$rc" = 0 ] || why="status $rc: $(tail -n 3 "$tmp/err")"
  grep -q '"check": "pass"' "$tmp/r.json" 2>/dev/null || why="$why; the self-check did not pass"
  has out 'NCCL baseline dispatch' || why="$why; no NCCL baseline row: $(head -n 20 "$tmp/out")"
  check "bench ${net[*]}: the NCCL baseline ran and matched" "$why"
  # under mpirun (the launcher of pretend hosts): its tags, its exit status, no per-rank lines
  for what in "NCCL for the baseline" "the NCCL baseline's communicator"; do
    t0=$SECONDS why=""
    EP_BENCH_REFUSE="1:$what" run "$bin" launch -n 4 --hosts 2 --timeout 100 "$bin" bench "${net[@]}"
    [ "$rc" = 1 ] || why="status $rc, want 1"
    has err "^\[[0-9]+,1\]<stderr>:epcomm bench: rank 1 could not prepare $what" ||
      why="$why; rank 1 did not say it"
    has err "^\[[0-9]+,0\]<stderr>:epcomm bench: another rank could not prepare $what" ||
      why="$why; rank 0 did not say a peer failed"
    [ "$(count err 'could not|stopped before')" = 2 ] ||
      why="$why; $(count err 'could not|stopped before') lines say a rank could not go on, want 2"
    ! has err 'unknown variable' || why="$why; a warning: $(grep -m1 'unknown variable' "$tmp/err")"
    [ $((SECONDS - t0)) -lt 60 ] || why="$why; took $((SECONDS - t0)) s"
    check "bench --hosts 2 --baseline on, rank 1 cannot prepare $what: every rank stops" "$why"
  done
  printf '%d passed, %d failed\n' "$passed" "$failed"
  [ "$failed" = 0 ]
  exit
fi

# ---- --backend cuda: a skip without a GPU, a checked run with one
for mode in normal ll; do
  why=""
  run "$bin" launch -n 2 "$bin" bench --backend cuda --mode $mode "${tiny[@]}" --json "$tmp/r.json"
  if [ "$rc" = 77 ]; then
    [ "$(count out 'skipped: no GPU')" = 1 ] || why="exit 77, but $(count out 'skipped: no GPU') 'skipped: no GPU' lines: $(cat "$tmp/out")"
    has out '^\[0\] skipped: no GPU \(.+\)$' || why="$why; the skip does not say why: $(cat "$tmp/out")"
  elif [ "$rc" = 0 ]; then # a GPU is here: the run must have checked itself
    grep -q '"check": "pass"' "$tmp/r.json" || why="ran on a GPU, but the self-check did not pass"
  else
    why="status $rc (want 77 without a GPU, 0 with one): $(tail -n 3 "$tmp/err")"
  fi
  check "bench --backend cuda --mode $mode: skipped: no GPU, or a passing run" "$why"
done

# ---- combinations refused by name: exit 2, one message from rank 0 naming the option
refuse() { # want-regex args...
  local want=$1
  shift
  run "$bin" launch -n 2 "$bin" bench "$@"
  local why=""
  [ "$rc" = 2 ] || why="status $rc, want 2"
  [ "$(count err 'epcomm bench:')" = 1 ] || why="$why; $(count err 'epcomm bench:') messages, want 1"
  has err "^\[0\] epcomm bench: $want" || why="$why; no /$want/ in: $(head -n 1 "$tmp/err")"
  check "bench $* refused" "$why"
}
refuse "--sms 8: only with --backend cuda" --sms 8
refuse "--sms and --threads: give one" --backend cuda --sms 8 --threads 2
refuse "--compute-us: only with --mode ll --backend cuda" --compute-us 50
refuse "--compute-us: only with --mode ll --backend cuda" --backend cuda --compute-us 50
refuse "--baseline on: --mode ll has no baseline" --mode ll --baseline on
refuse "option --raw is not one of epcomm bench's" --raw "$tmp/x"
refuse "unknown option '--frobnicate'" --frobnicate 1
refuse "--variants 'some': want one of all\|main" --variants some
refuse "--backend 'tpu': want one of cpu\|cuda" --backend tpu

# ---- a rank that cannot prepare what a collective loop needs (EP_BENCH_REFUSE=RANK:WHAT makes
# rank RANK not ready there): it says what it lacked, rank 0 says a peer did, and every rank
# exits 1 at once, none left in the next collective call until its deadline (600 s by default;
# run's 120 s kill would give 137 instead)
stops() { # mode what [verb: prepare, or check for a check of outputs]
  local t0=$SECONDS why="" verb=${3:-prepare}
  EP_BENCH_REFUSE="1:$2" run "$bin" launch -n 3 "$bin" bench --mode "$1" "${tiny[@]}" \
    --baseline off
  cat "$tmp/err" >>"$tmp/out"
  [ "$rc" = 1 ] || why="status $rc, want 1"
  has out "^\[1\] epcomm bench: rank 1 could not $verb $2" || why="$why; rank 1 did not say it"
  has out "^\[0\] epcomm bench: another rank could not $verb $2" ||
    why="$why; rank 0 did not say a peer failed"
  [ "$(count out 'exited with status 1')" = 3 ] ||
    why="$why; $(count out 'exited with status 1') of 3 ranks exited with status 1"
  # one failure, said once by rank 1 and once by rank 0: no later agreement repeats it
  [ "$(count out 'could not|stopped before')" = 2 ] ||
    why="$why; $(count out 'could not|stopped before') lines say a rank could not go on, want 2"
  [ $((SECONDS - t0)) -lt 60 ] || why="$why; took $((SECONDS - t0)) s"
  # the tool's own variable is taken out before the library could call it unknown
  ! has out 'unknown variable' || why="$why; a warning: $(grep -m1 'unknown variable' "$tmp/out")"
  check "bench --mode $1, rank 1 cannot $verb $2: every rank stops" "$why"
}
stops normal "its GPU and stream"
stops normal "the copy ceiling"
stops normal "its inputs"
stops normal "its expert outputs"
stops normal "the dispatch's outputs" check
stops normal "the combined outputs" check
stops normal "its caller tensors"
stops normal "a variant's received rows" check
stops ll "its inputs"
stops ll "its expert outputs"
stops ll "the dispatch's view" check
stops ll "the combined outputs" check
stops ll "a variant's view" check
stops ll "a variant's combined outputs" check

# ---- the MPI baseline program: the same parser, its own subset
mpi=$build/bin/epcomm-bench-mpi
# Started alone (an MPI singleton), as root too: OpenMPI refuses root without these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ -x "$mpi" ]; then
  for args in "--backend cuda" "--mode ll" "--baseline on" "--sms 4"; do
    run "$mpi" $args
    why=""
    [ "$rc" = 2 ] || why="status $rc, want 2"
    has err "^epcomm-bench-mpi: (${args%% *}|option ${args%% *})" ||
      why="$why; the refusal does not name ${args%% *}: $(head -n 1 "$tmp/err")"
    check "epcomm-bench-mpi $args refused" "$why"
  done
else
  printf 'SKIP epcomm-bench-mpi refusals (not built: no MPI)\n'
fi

printf '%d passed, %d failed\n' "$passed" "$failed"
[ "$failed" = 0 ]
