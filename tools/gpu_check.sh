#!/usr/bin/env bash
# The CUDA backend's checks on a GPU machine, in one bounded sequence (device time is scarce):
#   tools/gpu_check.sh WITH_MPS OUT_DIR [STEP...]
#   steps: build quick suite sanitize bench epbench doctor scan ll llsan llbench
#   (bench = `epcomm bench --backend cuda` at R=2/4/8, bf16 and fp8, DeepEP's sizes and SMs per
#   rank, every variant and the cudaMemcpy baseline, tables and JSON into OUT_DIR; epbench is the
#   same step under its older name; scan = the same with more SMs per rank; low-latency mode:
#   ll = the cuda.ll* and cuda.bench* tests, llsan = compute-sanitizer memcheck and racecheck on
#   small R=2 low-latency cases, llbench = `epcomm bench --mode ll --backend cuda` at R=2/4/8 with
#   128 tokens (bf16 and fp8), then 16/32/64 tokens)
# WITH_MPS: path of shared/gpu/with-mps (ranks sharing one GPU run concurrently under MPS).
# Every step is bounded by `timeout`; logs go to OUT_DIR; a one-line summary per step to stdout.
set -u -o pipefail
mps=${1:?usage: gpu_check.sh WITH_MPS OUT_DIR [STEP...]}
out=${2:?usage: gpu_check.sh WITH_MPS OUT_DIR [STEP...]}
shift 2
steps=${*:-build quick suite sanitize bench}
b=build-gpu
mkdir -p "$out"
export EP_TIMEOUT_S=${EP_TIMEOUT_S:-15}
ok=1
for s in $steps; do
  t0=$SECONDS
  case $s in
    build)
      { cmake -S . -B $b -G Ninja -DEP_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo &&
          ninja -C $b; } >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem \
        --format=csv >"$out/gpu.txt" 2>&1 ;;
    quick)
      timeout 240 "$mps" tests/run.sh --filter '^cuda\.(normal\.r[12]|graph\.r2|timeout\.r2)$' $b \
        2>&1 | tee "$out/quick.log" | tail -8 || ok=0
      [ $ok = 1 ] || break ;;
    suite)
      timeout 300 "$mps" tests/run.sh --filter '^cuda\.(normal|graph|timeout|cycles|overflow)' $b 2>&1 |
        tee "$out/suite.log" |
        grep -v '^PASS' || true ;;
    sanitize)
      # No MPS here: compute-sanitizer attaches to each rank's process.
      san() { # tool log ranks command...
        local tool=$1 log=$2 n=$3
        shift 3
        EP_TIMEOUT_S=120 timeout 200 $b/bin/epcomm launch -n "$n" compute-sanitizer --tool "$tool" \
          --error-exitcode 9 "$@" >"$out/$log" 2>&1
        echo "compute-sanitizer $tool, R=$n $*: exit $? ($(grep -hE '(ERROR|RACECHECK) SUMMARY' "$out/$log" |
          sort | uniq -c | tr -s ' ' | tr '\n' ';'))"
      }
      san memcheck san-memcheck-graph.log 2 $b/tests/test_cuda graph 1
      san racecheck san-racecheck-graph.log 2 $b/tests/test_cuda graph 1
      export EP_BACKEND=cuda
      san memcheck san-memcheck-normal.log 1 $b/tests/test_normal
      unset EP_BACKEND ;;
    bench|epbench)
      # One program for both backends: the same options, checks and statistics as on the CPU.
      for R in 2 4 8; do
        for dt in bf16 fp8; do
          timeout 150 "$mps" $b/bin/epcomm launch -n $R $b/bin/epcomm bench --backend cuda \
            --dtype $dt --json "$out/bench-r$R-$dt.json" >"$out/bench-r$R-$dt.log" 2>&1
          echo "epcomm bench --backend cuda, R=$R, $dt: exit $?"
          grep -v '^\[[1-9]' "$out/bench-r$R-$dt.log" | sed 's/^\[0\] //' |
            grep -E '^(epcomm|copy ceiling|cudaMemcpy|ratio|check|first)'
        done
      done ;;
    ll)
      timeout 560 "$mps" tests/run.sh --filter '^cuda\.(ll|bench)' $b 2>&1 | tee "$out/ll.log" |
        grep -v '^PASS' || true ;;
    llsan)
      # No MPS (see sanitize); small shapes, one rank pair.
      llsan() { # tool log command...
        local tool=$1 log=$2
        shift 2
        EP_TIMEOUT_S=120 timeout 145 $b/bin/epcomm launch -n 2 compute-sanitizer --tool "$tool" \
          --error-exitcode 9 "$@" >"$out/$log" 2>&1
        echo "compute-sanitizer $tool, R=2 $*: exit $? ($(grep -hE '(ERROR|RACECHECK) SUMMARY' "$out/$log" |
          sort | uniq -c | tr -s ' ' | tr '\n' ';'))"
      }
      llsan memcheck san-memcheck-ll-graph.log $b/tests/test_cuda_ll graph 1
      llsan racecheck san-racecheck-ll-graph.log $b/tests/test_cuda_ll graph 1
      export EP_BACKEND=cuda
      llsan memcheck san-memcheck-ll-misuse.log $b/tests/test_ll_misuse
      llsan memcheck san-memcheck-ll-flip.log $b/tests/test_ll flip 12
      unset EP_BACKEND ;;
    llbench)
      for R in 2 4 8; do
        for run in "128 bf16" "128 fp8" "64 bf16" "32 bf16" "16 bf16"; do
          set -- $run
          timeout 60 "$mps" $b/bin/epcomm launch -n $R $b/bin/epcomm bench --mode ll --backend cuda \
            --tokens $1 --dtype $2 --json "$out/llbench-r$R-t$1-$2.json" \
            >"$out/llbench-r$R-t$1-$2.log" 2>&1
          echo "ll bench R=$R tokens $1 $2: exit $?"
          grep -v '^\[[1-9]' "$out/llbench-r$R-t$1-$2.log" | sed 's/^\[0\] //' |
            grep -E '^(epcomm|two-phase|graph|overlap|ratio|check|first)'
        done
      done ;;
    doctor)
      $b/bin/epcomm doctor env 2>&1 | tee "$out/doctor-env.txt" | tail -30 ;;
    scan)
      # Where the time goes: the same sizes with more SMs per rank (main rows only).
      for rs in "2 32" "2 48" "4 32"; do
        set -- $rs
        for dt in bf16 fp8; do
          timeout 120 "$mps" $b/bin/epcomm launch -n $1 $b/bin/epcomm bench --backend cuda \
            --sms $2 --dtype $dt --variants main --baseline off >"$out/scan-r$1-s$2-$dt.log" 2>&1
          echo "bench R=$1 --sms $2 $dt: exit $?"
          grep -E '^\[0\] epcomm (dispatch|combine) ' "$out/scan-r$1-s$2-$dt.log" | sed 's/^\[0\] //'
        done
      done ;;
  esac
  echo "== step $s: $((SECONDS - t0)) s"
done
tar czf "$out/test-logs.tgz" -C $b test-logs 2>/dev/null
[ $ok = 1 ]
