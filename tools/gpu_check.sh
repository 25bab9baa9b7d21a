#!/usr/bin/env bash
# The CUDA backend's checks on a GPU machine, in one bounded sequence (device time is scarce):
#   tools/gpu_check.sh WITH_MPS OUT_DIR [STEP...]
#   steps: build quick suite sanitize bench epbench doctor scan trace ll llsan llbench llopt lltrace
#   (suite: the normal-mode tests, or those matching $SUITEF)
#   pull (pulled rows against pushed ones: the cached dispatch into caller arrays with
#   EP_CUDA_PULL=1 and 0, alternated, R:SMs in $PULLR, tokens in $PULLT, values in $PULLP)
#   ccopy (the combine of a separate tensor with EP_CUDA_COMBINE_COPY=1 and 0, alternated, R:SMs
#   in $CCR, tokens in $CCT)
#   scope (flags between ranks at system scope and the GPU's: EP_CUDA_SCOPE=sys and auto,
#   alternated, R:SMs in $SCR, tokens in $SCT)
#   l2hint (rows through L2 at evict-first priority or not: EP_CUDA_L2_HINT=off and on,
#   alternated (or the values in $L2V), R:SMs in $L2R, tokens in $L2T, dtypes in $L2DT)
#   late (the late hello: allocator-path bench rows with EP_CUDA_LATE_HELLO=0 and 1)
#   early (the allocator path's rows moved before the allocation: dispatch_alloc with
#   EP_CUDA_EARLY_DATA=0 and 1)
#   python (the Python package's CUDA tests, the package installed from this tree first)
#   hostms (each rank's host time in a call against the call's GPU time, tools/bench_host.py, at
#   R:SMs in $HMR, tokens in $HMT)
#   hostcost (bench/py_host_cost.py at R in $HCR, default "2 8", 128 tokens: host time of the
#   Python layer step's phases, default outputs plain and from the out pool, recv_x's allocation
#   plain and from the pool; after `python`)
#   hostearly (the same at R in $HCR with the late hello off, EP_CUDA_EARLY_DATA=0 and 1)
#   pystep (bench/py_combine_input.py at R:SMs in $PYR, tokens in $PYT (default 128): the layer
#   step with the out pool and with early data against the defaults, epcomm alone; installs the
#   package first)
#   ncu (Nsight Compute on rank 0 of R=$NCUR ranks, normal mode, dtypes in $NCUDT: per-kernel time, DRAM bytes,
#   occupancy, then the SpeedOfLight/Occupancy/WarpStateStats sections)
#   cudanet (the cuda.net.* tests: the CUDA data path across pretend hosts through NCCL)
#   net (across pretend hosts, issue 14: the NCCL engine on one GPU with a NCCL_HOSTID per rank,
#   then the cpu path's net.* tests through MPI; NCCL's library and header are looked for in the
#   PyTorch wheel when the toolkit has none: set EP_NCCL_LIB / NCCL_HOME to choose)
#   (bench = `epcomm bench --backend cuda` at R=2/4/8, bf16 and fp8, DeepEP's sizes and SMs per
#   rank, every variant and the cudaMemcpy baseline, tables and JSON into OUT_DIR; epbench is the
#   same step under its older name; scan = the same with more SMs per rank; trace = the same with
#   EP_CUDA_TRACE=1 at R:SMs in $TRR (default "2:24 8:16"), dtypes $TRDT, tokens $TRT (default
#   4096): mean time of each phase of a normal-mode call)
#   (llopt = `epcomm bench --mode ll --backend cuda` at R=2/4/8 once per EP_CUDA_LL_OPT variant in
#   $LLOPT (default "0 1 3 7 15 31", R in $LLR, default "2 4 8"), bf16 and fp8, one line each;
#   lltrace = EP_CUDA_LL_TRACE=1 at R in $LLTR (default "2 8") for OPT in $LLTROPT (default
#   "0 31"): the mean time of every kernel phase, ranks 0 and 1; both steps once per fill of the
#   view / zero-copy rows in $LLFILL, default "kernel": "kernel copies" adds EP_BENCH_LL_FILL=copies)
#   (llovl = the overlap of two-phase calls with a compute kernel, hook stream on/off, EP_CUDA_SMS
#   in $OVSMS ("-": the rank's share))
#   (low-latency mode: ll = the cuda.ll* and cuda.bench* tests, llsan = compute-sanitizer memcheck
#   and racecheck on small R=2 low-latency cases, llbench = `epcomm bench --mode ll --backend
#   cuda` at R=2/4/8 with 128 tokens (bf16 and fp8), then 16/32/64 tokens)
# GPUB: the build directory (default build-gpu; another, e.g. a kernel variant's from
# tools/kernel_variants.sh, for the steps after build).
# WITH_MPS: path of shared/gpu/with-mps (ranks sharing one GPU run concurrently under MPS).
# Every step is bounded by `timeout`; logs go to OUT_DIR; a one-line summary per step to stdout.
set -u -o pipefail
mps=${1:?usage: gpu_check.sh WITH_MPS OUT_DIR [STEP...]}
out=${2:?usage: gpu_check.sh WITH_MPS OUT_DIR [STEP...]}
shift 2
steps=${*:-build quick suite sanitize bench}
b=${GPUB:-build-gpu}
. "$(dirname "$0")/gpu_steps.sh"
mkdir -p "$out"
export EP_TIMEOUT_S=${EP_TIMEOUT_S:-15}
ok=1
# phase_us FIELD KEY FILE: a time of phase KEY of an `epcomm bench --json` file in us, FIELD
# the JSON text before the milliseconds ("-": absent);
# us KEY FILE: its median; rank_mean KEY FILE: the slowest rank's mean (DeepEP's statistic);
# summary KEY FILE: a value of its summary block.
phase_us() {
  sed -n "s/^  \"$2\": {.*$1\([^,]*\),.*/\1/p" "$3" 2>/dev/null |
    awk 'END { if (NR) printf "%.1f", $1 * 1000; else printf "-" }'
}
us() { phase_us '"time_ms": {"median": ' "$1" "$2"; }
rank_mean() { phase_us '"slowest_rank_mean_ms": ' "$1" "$2"; }
summary() {
  sed -n "s/^  \"$1\": \([^,]*\),*$/\1/p" "$2" 2>/dev/null | awk 'END { printf "%s", NR ? $1 : "-" }'
}
# late_gain PREFIX: the allocator rows' medians with EP_CUDA_LATE_HELLO=0 and 1 (PREFIX-l0.json,
# PREFIX-l1.json) and their ratio: the late hello's verdict at one size.
# ratio A B: A / B as "1.23x", "-" when either is not a positive number.
ratio() {
  awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2fx", a / b; else printf "-" }'
}
# host_cost R LOG [VAR=VALUE...]: bench/py_host_cost.py at R ranks, 128 tokens, in that
# environment, into LOG; prints its exit status.
host_cost() {
  local R=$1 log=$2
  shift 2
  timeout 200 "$mps" env "$@" $b/bin/epcomm launch -n "$R" "${PYTHON:-python3}" \
    bench/py_host_cost.py 128 >"$log" 2>&1
  echo "py_host_cost, R=$R, 128 tokens${*:+, $*}: exit $?"
}
# switch_runs VAR "VALUES" NAME R:SMS N DTYPE TITLE SAY=TAG ROW...: `epcomm bench` at R ranks, SMS
# SMs each, N tokens, DTYPE, twice with VAR set to each of VALUES in turn (alternated), into
# OUT/NAME-rR-tN-DTYPE-TAG<value>-<run>.{json,log}; prints one line: TITLE, then per run SAY<value>,
# each ROW's figures and the self-check. A ROW is "LABEL|KEY|TOOK|CALLS": LABEL, phase KEY's
# median/slowest rank's mean, and (summary TOOK/summary CALLS): how many of its calls took the
# path the switch is about; "LABEL|KEY" when the bench counts none.
switch_runs() {
  local var=$1 vals=$2 name=$3 R=${4%%:*} S=${4#*:} N=$5 dt=$6 line="R=${4%%:*}, ${4#*:} SMs, $5 tokens, $6, $7"
  local say=${8%%=*} tag=${8#*=} rep v f row label key took calls
  shift 8
  for rep in 1 2; do
    for v in $vals; do
      f="$out/$name-r$R-t$N-$dt-$tag$v-$rep"
      timeout 150 "$mps" env "$var=$v" $b/bin/epcomm launch -n "$R" $b/bin/epcomm bench \
        --backend cuda --dtype "$dt" --tokens "$N" --sms "$S" --json "$f.json" >"$f.log" 2>&1 ||
        line="$line [exit $?]"
      line="$line $say=$v"
      for row in "$@"; do
        IFS='|' read -r label key took calls <<<"$row"
        line="$line $label$(us "$key" "$f.json")/$(rank_mean "$key" "$f.json")"
        [ -z "$took" ] || line="$line ($(summary "$took" "$f.json")/$(summary "$calls" "$f.json"))"
        line="$line,"
      done
      line="$line check $(summary check "$f.json");"
    done
  done
  echo "$line"
}
# switch_grid "R:SMS..." "N..." "DTYPE..." VAR "VALUES" NAME TITLE SAY=TAG ROW...: switch_runs
# at every R:SMs, token count and dtype.
switch_grid() {
  local sets=$1 toks=$2 dts=$3 rs N dt
  shift 3
  for rs in $sets; do
    for N in $toks; do
      for dt in $dts; do switch_runs "$1" "$2" "$3" "$rs" "$N" "$dt" "${@:4}"; done
    done
  done
}
late_gain() {
  local k off on
  for k in dispatch_alloc_reg dispatch_alloc; do
    off=$(us $k "$1-l0.json") on=$(us $k "$1-l1.json")
    echo "  $k: late hello off $off us, on $on us (off/on $(ratio "$off" "$on"))"
  done
  # dispatch_alloc runs with nothing registered (a control: about 1.00x); the registered row
  # must have written in place with the late hello on, or its ratio means a silent fallback.
  echo "  dispatch_alloc_reg in place (fewest on a receiving rank): off" \
    "$(summary alloc_reg_in_place_min "$1-l0.json")/$(summary alloc_reg_calls "$1-l0.json"), on" \
    "$(summary alloc_reg_in_place_min "$1-l1.json")/$(summary alloc_reg_calls "$1-l1.json")"
}
for s in $steps; do
  t0=$SECONDS
  case $s in
    build)
      nccl_inc=$(find /usr/local/cuda/include /opt -name nccl.h -path '*include*' 2>/dev/null | head -1)
      { cmake -S . -B $b -G Ninja -DEP_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
          ${nccl_inc:+-DEP_NCCL_INCLUDE=$(dirname "$nccl_inc")} &&
          ninja -C $b; } >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem \
        --format=csv >"$out/gpu.txt" 2>&1
      bash tests/test_recompile.sh $b clang 2>&1 | tail -3 ;; # the CUDA host code under clang too
    quick)
      timeout 240 "$mps" tests/run.sh --filter '^cuda\.(normal\.r[12]|graph\.r2|timeout\.r2)$' $b \
        2>&1 | tee "$out/quick.log" | tail -8 || ok=0
      [ $ok = 1 ] || break ;;
    suite)
      timeout 450 "$mps" tests/run.sh --filter "${SUITEF:-^cuda\.(normal|graph|timeout|cycles|overflow|cbuf|memreg)}" $b 2>&1 |
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
    hostms)
      # Host time against GPU time per call (`epcomm bench`'s host_ms, each rank's median) at
      # R:SMs in $HMR (default "2:24 8:16"), tokens in $HMT (default "128 4096"), bf16: where a
      # rank's host time reaches the call's time in a call the host does not wait in, the GPU
      # waited for that host (a full dispatch's host waits for the count: marked "waits").
      for rs in ${HMR:-2:24 8:16}; do
        set -- ${rs%%:*} ${rs#*:}
        for tk in ${HMT:-128 4096}; do
          j="$out/hostms-r$1-t$tk.json"
          timeout 150 "$mps" $b/bin/epcomm launch -n $1 $b/bin/epcomm bench --backend cuda \
            --sms $2 --tokens $tk --json "$j" >"$out/hostms-r$1-t$tk.log" 2>&1
          echo "bench R=$1, $2 SMs, $tk tokens: exit $?"
          "${PYTHON:-python3}" tools/bench_host.py "$j" 2>&1 | tail -n +2
        done
      done ;;
    python)
      # The Python package's CUDA tests (tests/python, `-k cuda`), the package built from this tree
      # into the machine's Python (PyTorch's own; no build isolation: nothing can be fetched).
      install_pkg python "${PYTHON:-python3}" "$out/pip.log"
      installed=1
      timeout 400 "$mps" "${PYTHON:-python3}" -m pytest tests/python -q -k cuda >"$out/pytest.log" 2>&1
      echo "python: pytest -k cuda: exit $?"
      tail -n 3 "$out/pytest.log" ;;
    hostcost)
      for R in ${HCR:-2 8}; do
        host_cost "$R" "$out/hostcost-r$R.log"
        sed 's/^\[0\] //' "$out/hostcost-r$R.log" | grep -E -A8 '^layer step|recv_x:|pool snapshot'
        sed 's/^\[0\] //' "$out/hostcost-r$R.log" | grep -E '^  stalls|^  step|^    rank' | head -80
      done ;;
    hostearly)
      # The layer step's host phases with the late hello off, EP_CUDA_EARLY_DATA 0 / 1 (early
      # data applies only without a late hello): where the rows moved early save time, if they do.
      for R in ${HCR:-2 8}; do
        for e in 0 1; do
          host_cost "$R" "$out/hostearly-r$R-e$e.log" EP_CUDA_LATE_HELLO=0 EP_CUDA_EARLY_DATA=$e
          sed 's/^\[0\] //' "$out/hostearly-r$R-e$e.log" | grep -E -A7 '^layer step'
        done
      done ;;
    pystep)
      # The Python layer step with the out pool against the package's defaults, epcomm alone
      # (bench/py_combine_input.py; DeepEP beside it is tools/deepep_side_by_side.sh's job), at
      # R:SMs in $PYR (default "2:24 4:24 8:16") and tokens in $PYT (default 128). This tree's
      # package is installed first, also when no `python` step came before.
      if [ -z "${installed:-}" ] && ! install_pkg pystep "${PYTHON:-python3}" "$out/pip-pystep.log"
      then
        echo "pystep: no run (an older package would be timed)"
        continue
      fi
      installed=1
      py_layer_steps "$mps" "${PYTHON:-python3}" "$out" "${PYR:-2:24 4:24 8:16}" "${PYT:-128}"
      for rs in ${PYR:-2:24 4:24 8:16}; do
        for N in ${PYT:-128}; do
          f="$out/py-r${rs%%:*}-t$N.log"
          echo "== $f"
          sed 's/^\[[0-9]*\] //' "$f" | grep -i -A8 '^layer' || tail -3 "$f"
        done
      done ;;
    pull)
      # Pulled rows against pushed ones (EP_CUDA_PULL 1 / 0, same build, one call, each twice,
      # alternated): `epcomm bench`'s cached dispatch into unregistered caller arrays and its full
      # dispatch into an allocator's (plain) arrays, median and slowest rank's mean, and how many
      # of their calls pulled (the GPU counts them), at
      # R:SMs in $PULLR (default "2:24 4:24 8:16"), tokens in $PULLT (default "4096 128"), dtypes
      # in $PULLDT (default bf16), EP_CUDA_PULL values in $PULLP (default "0 1").
      switch_grid "${PULLR:-2:24 4:24 8:16}" "${PULLT:-4096 128}" "${PULLDT:-bf16}" \
        EP_CUDA_PULL "${PULLP:-0 1}" pull "caller arrays, us (median/rank mean, pulled/calls):" \
        pull=p "|dispatch_cached_caller|caller_pulled_min|caller_calls" \
        "allocator |dispatch_alloc|alloc_pulled_min|alloc_calls" ;;
    ccopy)
      # The combine of a separate tensor with its x copied into the combine buffer first
      # (EP_CUDA_COMBINE_COPY 1 / 0, same build, one call, each twice, alternated): `epcomm
      # bench`'s main combine row, median and slowest rank's mean, and how many of its calls
      # copied (fewest on a rank / calls), at R:SMs in $CCR (default "2:24 4:24 8:16"), tokens
      # in $CCT (default "4096 128"), bf16.
      switch_grid "${CCR:-2:24 4:24 8:16}" "${CCT:-4096 128}" bf16 EP_CUDA_COMBINE_COPY "0 1" \
        ccopy "combine of a separate tensor, us (median/rank mean, copied/calls):" copy=c \
        "|combine|combine_copied_min|combine_calls" ;;
    scope)
      # Flags between ranks at system scope against the GPU's (EP_CUDA_SCOPE sys / auto, same
      # build, one call, each twice, alternated; auto is .gpu here, every rank on one GPU): `epcomm
      # bench`'s full and cached dispatch into views, combine of a view, and the full and cached
      # dispatch timed in one loop (full - cached), median and slowest rank's mean, at R:SMs in
      # $SCR (default "2:24 4:24 8:16"), tokens in $SCT (default "128 4096"), dtypes in $SCDT
      # (default bf16).
      switch_grid "${SCR:-2:24 4:24 8:16}" "${SCT:-128 4096}" "${SCDT:-bf16}" EP_CUDA_SCOPE \
        "sys auto" scope "us (median/rank mean):" scope=s "full |dispatch" \
        "cached |dispatch_cached" "combine |combine_view" "paired full |dispatch_pair_full" \
        "paired cached |dispatch_pair_cached" ;;
    l2hint)
      # The rows a call moves through L2 at normal priority against evict-first
      # (EP_CUDA_L2_HINT off / on, same build, one call, each twice, alternated): `epcomm bench`'s
      # full and cached dispatch into views, the cached one into caller tensors (pulled), the
      # combine of a view and of a separate tensor, and
      # the full and cached dispatch timed in one loop, median and slowest rank's mean, at R:SMs
      # in $L2R (default "2:24 4:24 8:16"), tokens in $L2T (default "128 4096"), dtypes in $L2DT
      # (default "bf16 fp8").
      switch_grid "${L2R:-2:24 4:24 8:16}" "${L2T:-128 4096}" "${L2DT:-bf16 fp8}" EP_CUDA_L2_HINT \
        "${L2V:-off on}" l2hint "us (median/rank mean):" l2=h "full |dispatch" \
        "cached |dispatch_cached" "caller |dispatch_cached_caller" "combine |combine_view" \
        "combine tensor |combine" "paired full |dispatch_pair_full" \
        "paired cached |dispatch_pair_cached" ;;
    late)
      # The late hello against the copy-out (EP_CUDA_LATE_HELLO 0 / 1, same build, one call):
      # the allocator-path rows of `epcomm bench` (plain outputs, then registered ones), bf16,
      # at R:SMs in $LATER (default "2:24 4:24 8:16") and tokens in $LATET (default "4096 128").
      for rs in ${LATER:-2:24 4:24 8:16}; do
        R=${rs%%:*} S=${rs#*:}
        for N in ${LATET:-4096 128}; do
          for late in 0 1; do
            log="$out/late-r$R-t$N-l$late.log"
            timeout 150 "$mps" env EP_CUDA_LATE_HELLO=$late $b/bin/epcomm launch \
              -n $R $b/bin/epcomm bench --backend cuda --dtype bf16 --tokens $N --sms $S \
              --json "$out/late-r$R-t$N-l$late.json" >"$log" 2>&1
            echo "R=$R, $S SMs, $N tokens, EP_CUDA_LATE_HELLO=$late: exit $?"
            grep -v '^\[[1-9]' "$log" | sed 's/^\[0\] //' |
              grep -E '^(epcomm dispatch, allocator|epcomm dispatch  |check)'
          done
          late_gain "$out/late-r$R-t$N"
        done
      done ;;
    early)
      # The allocator path's rows moved before the allocation (EP_CUDA_EARLY_DATA 0 / 1, same
      # build, one call): `epcomm bench`'s dispatch_alloc row (nothing registered: early data
      # applies; its allocator is C, so what it shows is the launch gap, not Python's), bf16, at
      # R:SMs in $EARLYR (default "2:24 4:24 8:16") and tokens in $EARLYT (default "4096 128").
      for rs in ${EARLYR:-2:24 4:24 8:16}; do
        R=${rs%%:*} S=${rs#*:}
        for N in ${EARLYT:-4096 128}; do
          for e in 0 1; do
            timeout 150 "$mps" env EP_CUDA_EARLY_DATA=$e $b/bin/epcomm launch -n $R \
              $b/bin/epcomm bench --backend cuda --dtype bf16 --tokens $N --sms $S \
              --json "$out/early-r$R-t$N-e$e.json" >"$out/early-r$R-t$N-e$e.log" 2>&1
            echo "R=$R, $S SMs, $N tokens, EP_CUDA_EARLY_DATA=$e: exit $?," \
              "check $(summary check "$out/early-r$R-t$N-e$e.json")"
          done
          off=$(us dispatch_alloc "$out/early-r$R-t$N-e0.json")
          on=$(us dispatch_alloc "$out/early-r$R-t$N-e1.json")
          echo "  dispatch_alloc: early data off $off us, on $on us (off/on $(ratio "$off" "$on"))"
        done
      done ;;
    net)
      lib=${EP_NCCL_LIB:-$(find /opt /usr -name 'libnccl.so.2' 2>/dev/null | head -1)}
      export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 EP_NCCL_LIB=$lib
      grep -q 'NCCL engine ON' "$out/build.log" 2>/dev/null ||
        echo "net: the build found no nccl.h: the NCCL engine is not built (its test skips)"
      for rh in "2 2" "4 2" "4 4"; do
        set -- $rh
        timeout 60 "$mps" mpirun -n $1 --oversubscribe --bind-to none --mca btl self,vader \
          -x EP_HOSTS=$2 -x EP_NCCL_LIB -x EP_TIMEOUT_S -x NCCL_DEBUG=WARN \
          $b/tests/test_nccl_engine >"$out/net-nccl-r$1-h$2.log" 2>&1
        echo "NCCL engine, R=$1 on $2 pretend hosts, one GPU: exit $? ($(tail -n 1 "$out/net-nccl-r$1-h$2.log"))"
      done
      timeout 180 "$mps" tests/run.sh --filter '^(net|cuda\.net)' $b 2>&1 | tee "$out/net-cpu.log" | tail -4 || true ;;
    cudanet)
      # The CUDA data path across pretend hosts on this GPU (issue 14): NCCL between hosts (each
      # rank its own NCCL host over loopback), CUDA IPC inside one; tests matching $CNF.
      lib=${EP_NCCL_LIB:-$(find /opt /usr -name 'libnccl.so.2' 2>/dev/null | head -1)}
      export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 EP_NCCL_LIB=$lib
      EP_TIMEOUT_S=60 timeout 500 "$mps" tests/run.sh --filter "${CNF:-^cuda\.net}" $b 2>&1 |
        tee "$out/cudanet.log" | tail -12 || true
      cp $b/test-logs/cuda.net.* "$out/" 2>/dev/null || true ;;
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
      # Issue 12 item 8: DeepEP's low-latency sizes (H 7168, topk 8, E 288) at R in $LLBR (2 4 8),
      # 128 tokens bf16 and fp8, then 64/32/16 tokens bf16, 200 timed calls each; one line per run:
      # median and p90 (us, slowest rank) of dispatch and combine (y in a tensor), the two-phase
      # send/receive medians, graph replay / calls, overlap efficiency, the check.
      pus() { # p90 of phase KEY
        sed -n "s/^  \"$1\": {.*\"time_ms\": {[^}]*\"p90\": \([^,]*\),.*/\1/p" "$2" 2>/dev/null |
          awk 'END { if (NR) printf "%.1f", $1 * 1000; else printf "-" }'
      }
      printf '%-2s %-4s %-4s %8s %8s %8s %8s %8s %8s %8s %8s %6s %6s %s\n' R tok dt d_med d_p90 c_med \
        c_p90 d_snd d_rcv c_snd c_rcv graph ovl check
      for R in ${LLBR:-2 4 8}; do
        for run in "128 bf16" "128 fp8" "64 bf16" "32 bf16" "16 bf16"; do
          set -- $run
          j=$out/llbench-r$R-t$1-$2.json
          timeout 90 "$mps" $b/bin/epcomm launch -n $R $b/bin/epcomm bench --mode ll --backend cuda \
            --tokens $1 --dtype $2 --json "$j" >"${j%.json}.log" 2>&1 || echo "R=$R $1 $2: exit $?"
          ck=exact
          grep -q '"check": "pass"' "$j" 2>/dev/null || ck=FAILED
          printf '%-2s %-4s %-4s %8s %8s %8s %8s %8s %8s %8s %8s %6s %6s %s\n' $R $1 $2 \
            "$(us dispatch "$j")" "$(pus dispatch "$j")" "$(us combine "$j")" "$(pus combine "$j")" \
            "$(us dispatch_send "$j")" "$(us dispatch_recv "$j")" "$(us combine_send "$j")" \
            "$(us combine_recv "$j")" "$(summary ratio_graph_calls "$j")" \
            "$(summary overlap_efficiency "$j")" $ck
        done
      done ;;
    llopt)
      # Low-latency kernel variants side by side (same build, EP_CUDA_LL_OPT bits), 128 tokens,
      # the FMA kernel sized ~60 us so that the overlap efficiency can exceed 1.3. Medians in us
      # from each run's JSON (bf16 run; fp8 run for d8 and d8snd). LLFILL="kernel copies" also
      # runs each with the view / zero-copy rows' expert outputs written by one cudaMemcpyAsync
      # per expert (EP_BENCH_LL_FILL=copies, the fill before 2026-12-04): opt shown as e.g. 31c.
      printf '%-2s %-3s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %6s %6s %s\n' R opt d16 d8 c_view \
        c_call c_zc d16snd d16rcv d8snd c_snd c_rcv graph ovl check
      for R in ${LLR:-2 4 8}; do
        for o in ${LLOPT:-0 1 3 7 15 31}; do
          for f in ${LLFILL:-kernel}; do
            fs="" ol=$o
            [ "$f" = kernel ] || fs="-f$f" ol=$o${f:0:1}
            note=""
            for dt in bf16 fp8; do
              EP_BENCH_LL_FILL=$f EP_CUDA_LL_OPT=$o timeout 60 "$mps" $b/bin/epcomm launch -n $R \
                $b/bin/epcomm bench --mode ll --backend cuda --dtype $dt \
                --compute-us ${LL_COMPUTE_US:-60} --json "$out/llopt-r$R-o$o$fs-$dt.json" \
                >"$out/llopt-r$R-o$o$fs-$dt.log" 2>&1 || note="$note $dt: exit $?"
            done
            j=$out/llopt-r$R-o$o$fs-bf16.json j8=$out/llopt-r$R-o$o$fs-fp8.json
            ck=exact
            grep -q '"check": "pass"' "$j" 2>/dev/null && grep -q '"check": "pass"' "$j8" 2>/dev/null ||
              ck=FAILED
            printf '%-2s %-3s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %6s %6s %s%s\n' $R $ol \
              "$(us dispatch "$j")" "$(us dispatch "$j8")" "$(us combine_view "$j")" \
              "$(us combine "$j")" "$(us combine_zero_copy "$j")" "$(us dispatch_send "$j")" \
              "$(us dispatch_recv "$j")" "$(us dispatch_send "$j8")" "$(us combine_send "$j")" \
              "$(us combine_recv "$j")" "$(summary ratio_graph_calls "$j")" \
              "$(summary overlap_efficiency "$j")" $ck "$note"
          done
        done
      done ;;
    llovl)
      # Receive hooks: the overlap of two-phase calls with a compute kernel, the send on the hook
      # stream (EP_CUDA_LL_HOOK_STREAM=1) or on the caller's (0), with EP_CUDA_SMS blocks per
      # kernel ("-": the rank's share), at R in $LLR, compute kernel ~$LL_COMPUTE_US us (60);
      # medians in us: communication alone (C), compute alone (P), send->compute->receive (O).
      printf '%-2s %-4s %-4s %8s %8s %8s %6s %8s %8s %8s %8s %s\n' R hook sms C P O eff d_snd d_rcv \
        c_snd c_rcv check
      for R in ${LLR:-2 4}; do
        for hk in ${OVHOOK:-0 1}; do
          for sm in ${OVSMS:-- 16}; do
            j=$out/llovl-r$R-h$hk-s$sm.json
            [ "$sm" = - ] && smv= || smv=$sm
            EP_CUDA_LL_HOOK_STREAM=$hk EP_CUDA_SMS=${smv:-0} timeout 60 "$mps" $b/bin/epcomm launch \
              -n $R $b/bin/epcomm bench --mode ll --backend cuda --compute-us ${LL_COMPUTE_US:-60} \
              --json "$j" >"${j%.json}.log" 2>&1 || echo "R=$R hook=$hk sms=$sm: exit $?"
            ck=exact
            grep -q '"check": "pass"' "$j" 2>/dev/null || ck=FAILED
            printf '%-2s %-4s %-4s %8s %8s %8s %6s %8s %8s %8s %8s %s\n' $R $hk $sm \
              "$(us overlap_comm "$j")" "$(us overlap_compute "$j")" "$(us overlap "$j")" \
              "$(summary overlap_efficiency "$j")" "$(us dispatch_send "$j")" \
              "$(us dispatch_recv "$j")" "$(us combine_send "$j")" "$(us combine_recv "$j")" $ck
          done
        done
      done ;;
    trace)
      # Normal mode: where the time of a call goes (EP_CUDA_TRACE: notify plan, hello, wait for
      # peers, gap, the data kernel's own part, peers and rest; the idle time before the call),
      # over everything epcomm bench runs, rank 0's lines.
      for rs in ${TRR:-2:24 8:16}; do
        set -- ${rs%%:*} ${rs#*:}
        for dt in ${TRDT:-bf16 fp8}; do
          for tk in ${TRT:-4096}; do
            EP_CUDA_TRACE=1 timeout 120 "$mps" $b/bin/epcomm launch -n $1 $b/bin/epcomm bench \
              --backend cuda --sms $2 --dtype $dt --tokens $tk >"$out/trace-r$1-$dt-t$tk.log" 2>&1
            echo "trace R=$1, $2 SMs, $dt, $tk tokens: exit $?"
            grep -h 'epcomm trace rank 0:' "$out/trace-r$1-$dt-t$tk.log" | sed 's/.*rank 0: //'
          done
        done
      done ;;
    lltrace)
      # LLFILL as in llopt: the view / zero-copy rows' fill (kernel, or copies).
      for R in ${LLTR:-2 8}; do
        for o in ${LLTROPT:-0 31}; do
          for f in ${LLFILL:-kernel}; do
            fs=""
            [ "$f" = kernel ] || fs="-f$f"
            EP_BENCH_LL_FILL=$f EP_CUDA_LL_OPT=$o EP_CUDA_LL_TRACE=1 timeout 60 "$mps" \
              $b/bin/epcomm launch -n $R $b/bin/epcomm bench --mode ll --backend cuda --iters 100 \
              >"$out/lltrace-r$R-o$o$fs.log" 2>&1
            echo "trace R=$R EP_CUDA_LL_OPT=$o fill $f: exit $?"
            grep -h 'll trace rank [01]:' "$out/lltrace-r$R-o$o$fs.log" | sed 's/.*ll trace //'
          done
        done
      done ;;
    ncu)
      # Per-kernel figures of normal mode at R=$NCUR (default 8) with $NCUSMS SMs (16), every rank
      # under MPS. Nsight Compute's MPS mode: one `ncu --mps control` process holds the options
      # and collects the report; rank 0 runs under `ncu --mps primary-client`, the others under
      # `ncu --mps client` (no other options there). Clocks left alone. First a metric set of
      # one pass (no replay: a replayed kernel would wait again for its peers), then the
      # SpeedOfLight/Occupancy/WarpStateStats sections (replayed; may not finish).
      R=${NCUR:-8} sms=${NCUSMS:-16}
      cat >"$out/ncu-wrap.sh" <<'WRAP'
#!/usr/bin/env bash
if [ "$EP_RANK" = 0 ]; then exec ncu --mps primary-client "$@"; fi
exec ncu --mps client "$@"
WRAP
      chmod +x "$out/ncu-wrap.sh"
      kern='regex:(notify|dispatch|combine)'
      m=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg,launch__grid_size,launch__registers_per_thread
      # NCUM overrides the metric set: PC sampling ("regex:^smsp__pcsamp_") gives the stall
      # reasons in one pass, where the WarpStateStats section's counters need replays.
      m=${NCUM:-$m}
      cat >"$out/ncu-job.sh" <<'JOB'
#!/usr/bin/env bash
# ncu-job.sh LOG SECS R LAUNCH-COMMAND... -- NCU-OPTIONS...: inside one MPS daemon (with-mps),
# the ncu control process in the background, then the ranks.
log=$1 secs=$2 R=$3
shift 3
cmd=()
while [ "$1" != -- ]; do cmd+=("$1"); shift; done
shift
timeout $((secs + 20)) ncu --mps control --mps-num-clients "$R" --clock-control none "$@" >"$log" 2>&1 &
ctl=$!
sleep 3
timeout "$secs" "${cmd[@]}" >"$log.app" 2>&1
app=$?
wait $ctl
echo "app exit $app, ncu control exit $?"
JOB
      chmod +x "$out/ncu-job.sh"
      ncu_run() { # log secs ncu-options...
        local log=$1 secs=$2
        shift 2
        echo "ncu R=$R $sms SMs $dt $(basename "$log"): $(EP_TIMEOUT_S=60 "$mps" "$out/ncu-job.sh" "$log" \
          "$secs" $R $b/bin/epcomm launch -n $R "$out/ncu-wrap.sh" $b/bin/epcomm bench --backend cuda \
          --sms $sms --dtype $dt --tokens ${NCUT:-4096} --variants main --baseline off --iters 20 -- "$@" 2>&1 | tail -1)"
      }
      for dt in ${NCUDT:-bf16 fp8}; do
        ncu_run "$out/ncu-r$R-$dt.log" 150 -k "$kern" --launch-skip 30 -c 12 --metrics "$m" --csv
        grep -E '^"|==PROF==|==ERROR==|==WARNING==' "$out/ncu-r$R-$dt.log" | grep -v '^"ID"' |
          awk -F'","' '/^"/ { printf "%s %s = %s\n", $5, $(NF-2), $NF; next } { print }' | head -120
        grep -h '==ERROR==' "$out/ncu-r$R-$dt.log.app" | head -5
      done
      if [ "${NCUSECT:-1}" = 1 ]; then # NCUSECT=0: the metric runs only
        dt=bf16
        ncu_run "$out/ncu-r$R-sections.log" ${NCUSECT_S:-200} -k "$kern" --launch-skip 30 -c 3 \
          --section SpeedOfLight --section Occupancy --section WarpStateStats
        grep -E 'epcomm::|epk_|Duration|Throughput|Occupancy|Stall|Warp Cycles|==ERROR==|==PROF==' \
          "$out/ncu-r$R-sections.log" | head -80
      fi ;;
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
