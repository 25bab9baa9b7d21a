#!/usr/bin/env bash
# `epcomm bench` end to end at tiny sizes: the MPI_Alltoallv baseline through the launcher (its
# outputs checked against the reference and against epcomm's), --json, the baseline program alone
# under mpirun (the same options and the same report, table and JSON), and bench/plot making a
# PNG from the results. No performance threshold: only completion and the self-checks.
# Usage: tests/test_bench.sh BUILD_DIR. Exit 77 (skip) when neither MPI nor gnuplot is there.
set -u
build=$(cd "${1:?usage: test_bench.sh BUILD_DIR}" && pwd)
src=$(cd "$(dirname "$0")/.." && pwd)
epcomm=$build/bin/epcomm
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epcomm-test-bench.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
have_mpi=0 have_plot=0
[ -x "$build/bin/epcomm-bench-mpi" ] && command -v mpirun >/dev/null && have_mpi=1
command -v gnuplot >/dev/null && have_plot=1
if [ $have_mpi = 0 ] && [ $have_plot = 0 ]; then
  echo "skip: neither the MPI baseline (epcomm-bench-mpi, mpirun) nor gnuplot is installed"
  exit 77
fi
baseline=off
[ $have_mpi = 1 ] && baseline=on
small="--hidden 256 --topk 4 --experts 16 --warmup 1 --iters 2 --baseline $baseline"
for t in 32 96; do
  "$epcomm" launch -n 2 --timeout 100 "$epcomm" bench --tokens $t $small --routing grouped \
    --json "$tmp/r$t.json" >"$tmp/out$t" || fail "epcomm bench --tokens $t: $(tail -n 5 "$tmp/out$t")"
  grep -q '"check": "pass"' "$tmp/r$t.json" || fail "self-check did not pass: $tmp/r$t.json"
  if [ $have_mpi = 1 ]; then
    grep -q '"ran": true' "$tmp/r$t.json" || fail "the MPI baseline did not run"
    grep -q 'ratio epcomm/baseline: dispatch' "$tmp/out$t" || fail "no baseline ratio in the table"
  fi
  grep -q 'ratio epcomm/ceiling:' "$tmp/out$t" || fail "no ceiling ratio in the table"
done
echo "bench: self-checks pass (baseline $baseline)"
if [ $have_mpi = 1 ]; then # the baseline alone: epcomm bench's options and report
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  btl=(--mca btl self,vader)
  [ -n "${OMPI_MCA_btl:-}" ] && btl=()
  timeout 100 mpirun -n 2 --oversubscribe --bind-to none "${btl[@]}" "$build/bin/epcomm-bench-mpi" \
    --tokens 32 --hidden 256 --topk 4 --experts 16 --warmup 1 --iters 2 --routing zipf \
    --json "$tmp/mpi.json" >"$tmp/mpi.out" 2>&1 || fail "epcomm-bench-mpi alone: $(tail -n 5 "$tmp/mpi.out")"
  grep -q '^epcomm-bench-mpi: normal mode, MPI_Alltoallv baseline alone' "$tmp/mpi.out" ||
    fail "epcomm-bench-mpi alone: not epcomm bench's report: $(head -n 3 "$tmp/mpi.out")"
  grep -q '^MPI baseline dispatch+combine ' "$tmp/mpi.out" || fail "no dispatch+combine row"
  grep -q '"check": "pass"' "$tmp/mpi.json" || fail "epcomm-bench-mpi alone: self-check did not pass"
  echo "baseline alone: same report, self-check passes"
fi
if [ $have_plot = 1 ]; then
  "$src/bench/plot" -o "$tmp/plot.png" "$tmp/r32.json" "$tmp/r96.json" >/dev/null || fail "bench/plot failed"
  [ "$(head -c 4 "$tmp/plot.png" | od -An -tx1 | tr -d ' ')" = 89504e47 ] || fail "bench/plot wrote no PNG"
  echo "plot: PNG written"
fi
exit 0
