#!/usr/bin/env bash
# The planned GPU runs of issue 15, one device call each, shaped for the device tool: each call
# ends well inside its 10 minutes (an outer deadline, so that the packing below still runs), and
# everything it wrote comes back as one file, OUT/cN.tgz (the tool brings back at most 8 files,
# two folders deep; the runs below write dozens). Run from the repository root:
#
#   tools/gpu_session.sh N OUT      N = 1 to 13, 15 to 23; OUT = $OUT on the device machine
#
#   1  gpu_check build late suite: the late hello against the copy-out (allocator-path bench rows,
#      EP_CUDA_LATE_HELLO 0 / 1, R = 2 / 4 / 8, 4096 and 128 tokens; first, since it decides the
#      defaults), then the normal-mode CUDA tests with the new low-latency deferred-failure ones
#   2  gpu_check build python hostcost: the Python package's CUDA tests, then the layer step's host
#      phases with the default outputs plain and from the out pool
#   3  deepep_side_by_side build normal python report at $DS_TOKENS (default "4096 128";
#      DS_TOKENS=512 for issue 15's middle size): DeepEP V1 and epcomm (C bench and Python) in
#      one call, the table in OUT/c3/table.txt
#   4  gpu_check build suite python hostcost pystep: the host waits' and failure paths (normal mode and
#      low-latency, the tests $SUITEF4 names), then the Python package's CUDA tests and the host
#      cost of the layer step and of recv_x's allocation at R = 2 and 4, then the layer step with
#      the out pool (six ways) against the defaults at 128 tokens, R = 2 / 4 / 8 (a change's
#      check), with the host phases of early data on and off before it (hostearly)
#   5  gpu_check build suite pystep early: EP_CUDA_EARLY_DATA (the allocator path's rows moved
#      while the host waits and allocates): the normal-mode tests with it on and off ($SUITEF5),
#      the failure scenarios, then the Python layer step six ways at 128 tokens (the defaults
#      with and without it among them) and `epcomm bench`'s dispatch_alloc with it off / on at
#      128 and 4096 tokens
#   6  gpu_check build python hostcost pystep, R = 2 / 4 / 8 at 128 tokens: the Python package's
#      CUDA tests (a change's check), then where a spike comes from
#      (bench/py_host_cost.py prints every rank's phases of the slowest layer steps; the layer
#      step six ways names each spike's slowest rank, its host time and garbage collections)
#   7  DeepEP's own tests/test_intranode.py and tests/test_low_latency.py at R = 2 and 4 against
#      epcomm.deep_ep with the package's defaults (the out pool among them; tools/deepep_compat.sh
#      build intranode low_latency, or the stages in $DC7_STAGES), then examples/moe_layer.py at
#      4 ranks on CUDA
#   8  full - cached at 4096 tokens with smaller plan tiles: tools/kernel_variants.sh, notify
#      blocks (= tile tokens) of 256 (today's) and 128, R = 4 and 8 twice each ($KV_NT: the
#      sizes, default "256 128"); the table in OUT/c8/variants.txt (ran in the eighteenth
#      session: no change)
#   9  the combine's reduce shapes at 128 tokens (R = 8 and 4, R = 8 again): holders x vectors
#      in flight per lane of 2 x 4 (today's; CUDA 13.0's ptxas spills 40 bytes there), 4 x 2
#      and 8 x 1 (no spills), tools/kernel_variants.sh; the table in OUT/c9/variants.txt
#   10 pulled rows, copied per source as each arrives (today's: a slice of all rows per block
#      below 8 ranks, a share of every source from 8 up, EPK_PULL_SPLIT=2) against two
#      kernel variants' builds: a share of every source at every R (EPK_PULL_SPLIT=1, taken in
#      claimed runs as today's from 8 up; -DEPK_PULL_CLAIM=0 builds the fixed share) and all
#      sources waited for first (EPK_PULL_EACH=0): gpu_check build suite (the normal-mode tests
#      and the failure scenarios, $SUITEF10), then its pull step on each build at R:SMs in
#      $PULLR (default "8:16 4:24"), 4096 tokens: EP_CUDA_PULL 0 / 1 on today's, 1 on the others
#   11 the combine of a separate tensor copied into the combine buffer first (EP_CUDA_COMBINE_COPY):
#      gpu_check build suite ($SUITEF11: the normal-mode tests with it on and off, graph, combine
#      buffer, registered combines, failure scenarios), its ccopy step at R = 2 / 4 / 8 and
#      $CCT tokens (default 4096), then side by side with DeepEP at 4096 tokens (OUT/c11/sbs)
#   12 where R = 8's ids and weights cost (the twenty-fifth session found it is where their lines
#      land, not their stores): a copy of this tree with the measurement-only patch
#      docs/gpu-runs/2026-12-06-s25/idw-sink/measurement-only.patch (each warp's ids and
#      weights into one slot of its own; wrong outputs), built beside this tree and timed
#      alternately (tools/kernel_variants.sh, R = 8); OUT/c12/variants.txt. Nsight Compute's
#      DRAM and L2 write counters are not collected: they need replays, which stop under MPS at
#      R = 8 (twenty-sixth session, docs/gpu-runs/2026-12-06-s26/ncu-r8-failed/)
#   13 the kernels' buffer descriptor as `const __grid_constant__` (3aed2ed, compile-checked only
#      when it landed): gpu_check build suite ($SUITEF13: the normal-mode and low-latency tests
#      and the failure scenarios), then tools/kernel_variants.sh with it (gc1) and without it
#      (gc0, -DEPK_GRID_CONST=0), R = 2 / 4 / 8, at 128 tokens and then at 4096;
#      OUT/c13/variants-t128.txt and variants-t4096.txt (their bf16lpair column: the bench's
#      full / cached pair with a combine after each dispatch, first run on a GPU there)
#      (ran in the twenty-seventh session: R = 8's bf16 dispatch 16% faster with it)
#   14 a full dispatch's ids and weights written after the rows in one pass per block
#      (EPK_IDW_BATCH=1 at the rows' L2 priority, 2 at normal priority; compile-checked only
#      when it landed) against today's form and a measurement-only build without those stores
#      (EPK_MEAS_IDW=3, wrong outputs): tools/kernel_variants.sh, R = 8 and 4, 4096 tokens
#      (OUT/c14/variants.txt); EP_CUDA_TRACE's phases at R = 8 (bf16) for base and batch
#      (OUT/c14/trace-*/); then the normal-mode suite on a build with EPK_IDW_BATCH=1
#      ($SUITEF14; 2 differs from it only in the stores' L2 policy) (ran in the twenty-eighth
#      session: no gain from either; both forms were removed, the step with them)
#   15 where R = 8's full - cached goes, two tests: the full dispatch in the worst-case form (no
#      host wait for the count; the bench's dispatch_wc row, kernel_variants.sh's bf16wc /
#      fp8wc columns) and a build whose cached calls take a full call's area-D layout
#      (docs/gpu-runs/2026-12-06-s28/cached-full-layout.patch: room for ids and weights, so
#      fewer rows a window and other offsets) and one whose full calls' data kernel does what a
#      cached one does (as-cached.patch: no ids or weights fetched or written; wrong outputs);
#      R = 8 and 4, 4096 tokens (OUT/c15/variants.txt),
#      then EP_CUDA_TRACE's phases of today's tree at R = 8 (bf16, fp8)
#   16 EP_CUDA_TRACE with the data kernel's own part split (the spread of its blocks' starts, the
#      first block's own part done, the rest): gpu_check build trace at R = 8 (16 SMs) and 4
#      (24), bf16 and fp8, 4096 tokens (OUT/c16/trace-*.log), then cuda.normal.r2 and its trace test
#   17 whether what a full dispatch leaves for the next one is in the L2: the bench's
#      dispatch_flush_* rows (a full dispatch, a 64 MB device copy, the stream's end and a
#      barrier, a cached one) and dispatch_sync_* (the same without the copy) beside the
#      triple and the cached loop, gpu_check build trace at R = 8, bf16 and fp8, then the bench
#      tests (ran in the twenty-eighth session without the barrier, which the loop needs on one
#      GPU; the next session's first call)
#   18 whether R = 8's full - cached is the SMs' L1 / shared-memory split (the notify kernel's
#      default split differs from the data kernels', and a full dispatch runs its notify on ~17
#      SMs a rank): tools/kernel_variants.sh, the tree against every normal-mode kernel asking
#      for the most L1 (-DEPK_CARVEOUT=0) and for the most shared memory (=100), R = 8 and 4,
#      4096 tokens (OUT/c18/variants.txt), then EP_CUDA_TRACE at R = 8 (bf16) on the first
#      of them (OUT/c18/trace/)
#   19 how much of R = 8's full - cached the full call's own fetch of the ids and weights is, in
#      loops that start each cached dispatch right after a full one: tools/kernel_variants.sh,
#      the tree against as-cached.patch (the twenty-eighth session's: no ids or weights fetched
#      or written) and docs/gpu-runs/2026-12-06-s29/nofetch.patch (written but not fetched),
#      both wrong outputs; R = 8, then 8 and 4 again (OUT/c19/a.txt, b.txt; every loop's medians
#      in the runs' JSON)
#   20 whether the GPU's clocks move during the bench at R = 8 (a state that outlives a drain and a
#      barrier, and that a full dispatch's ids and weights make worse, could be its power
#      management): nvidia-smi samples the SM and memory clocks, power, temperature and the
#      active clock-event reasons every 20 ms (OUT/c20/clocks.csv) while tools/kernel_variants.sh
#      times the tree at R = 8 (OUT/c20/variants.txt); a summary of the samples follows
#   21 whether the full call's fetch slows it and the next call by what it reads (the caller's
#      topk_idx / topk_weights, pages a cached call never touches) or by fetching at all: the tree
#      against nofetch.patch and planfetch.patch (the same fetches from the plan's first 64 KB,
#      which the kernel reads anyway; wrong outputs), R = 8 twice (OUT/c21/a.txt, b.txt). The
#      64 KB wrap every 1024 tokens, so pfe also reads less than the 384 KB of a rank's ids and
#      weights: a pfe as slow as the tree says "fetching at all"; one as fast as nof does not yet
#      tell pages from bytes (ran in the thirtieth session: as fast as nof)
#   22 pages or bytes, after 21: the tree against fromx.patch (the same fetches, 384 KB a rank,
#      from the caller's x, a large allocation the call reads anyway; wrong outputs),
#      bigpages.patch (the bench's device tensors, ids and weights among them, each in an
#      allocation of whole 2 MB pages), planfetch.patch (wrong outputs) and idcopy.patch (right
#      outputs: the notify kernel, which reads the ids anyway, copies them and the weights after
#      the plan, and the data kernel fetches that copy), R = 8 and 4 twice (OUT/c22/a.txt,
#      b.txt; patches in docs/gpu-runs/2026-12-06-s30/); V22 names a subset (default "fx big pfe
#      cpy"). Ran in the thirtieth session with V22=cpy only: right outputs, bf16 R = 8 ~108 us
#      slower; in the thirty-first with V22="fx big pfe": fx and big as slow as the tree, pfe
#      faster at R = 8, none moves R = 4 (docs/PERFORMANCE.md)
#   23 the floor under R = 4's full - cached: the tree against as-cached.patch (a full call that
#      fetches and writes no ids or weights, less than any right full dispatch does; wrong
#      outputs), R = 4, then 4 and 8 again (OUT/c23/a.txt, b.txt)
#
# Needs .gpu/with-mps (a copy of shared/gpu/with-mps) and, for 3 and 7, .deepep (DeepEP V1's
# source); both are ignored by git, so the call must carry them: carry [".gpu"] or [".gpu",
# ".deepep"].
# GPU_SESSION_S bounds the run (default 540 s); the machine's start and the transfers come on top.
set -u -o pipefail
n=${1:?usage: gpu_session.sh N OUT}
out=${2:?usage: gpu_session.sh N OUT}
limit=${GPU_SESSION_S:-540}
patch_failed='' step_rc='' # set by patched and kv below, never taken from the environment
case $n in [1-9] | 1[0-35-9] | 2[0-3]) ;; *) echo "usage: gpu_session.sh N OUT (N = 1 to 13, 15 to 23)" >&2; exit 2 ;; esac
[ -x .gpu/with-mps ] || { echo "no .gpu/with-mps here: carry .gpu" >&2; exit 2; }
case $n in 3 | 7 | 11) [ -d .deepep ] || { echo "no .deepep here: carry .deepep" >&2; exit 2; } ;; esac
d=$out/c$n
mkdir -p "$d"
t0=$SECONDS
# patched DIR PATCH: a copy of this tree's sources in DIR (outside OUT: the sources do not go
# back) with a measurement patch applied, for tools/kernel_variants.sh's NAME@DIR form.
# A patch that does not apply is said, and the step skips its runs (no exit: the packing below
# still runs; the call's status is 1).
patched() {
  rm -rf "$1" && mkdir -p "$1" &&
    cp -r CMakeLists.txt cmake include src tools bench examples tests python "$1"/ &&
    patch -s -d "$1" -p1 <"$2" && return
  echo "gpu_session: $2 does not apply to this tree" >&2
  patch_failed=1
  return 1
}
# kv TABLE OUT_DIR VARIANT...: tools/kernel_variants.sh (VR etc. from the environment) within
# the call's time left (at least 1 s: `timeout 0` would not bound it), its table into TABLE and
# to stdout; its failure or deadline becomes the call's status (the steps end on the table).
kv() {
  local f=$1 left=$((limit - (SECONDS - t0)))
  shift
  timeout -k 5 "$((left > 0 ? left : 1))" tools/kernel_variants.sh .gpu/with-mps "$@" >"$f" 2>&1 ||
    step_rc=$?
  cat "$f"
}
# two_passes VR_A VR_B VARIANT...: kv twice, OUT/cN/a.txt with VR_A and b.txt with VR_B (the
# second pass tells a variant's effect from the run's noise).
two_passes() {
  local a=$1 b=$2
  shift 2
  VR=$a kv "$d/a.txt" "$d/a" "$@"
  VR=$b kv "$d/b.txt" "$d/b" "$@"
}
# patch_of NAME: the measurement patch of the variant NAME (steps 19, 21, 22).
patch_of() {
  local g=docs/gpu-runs/2026-12-06
  case $1 in
    asc) echo $g-s28/as-cached.patch ;;
    nof) echo $g-s29/nofetch.patch ;;
    pfe) echo $g-s29/planfetch.patch ;;
    fx) echo $g-s30/fromx.patch ;;
    big) echo $g-s30/bigpages.patch ;;
    cpy) echo $g-s30/idcopy.patch ;;
    *) return 1 ;;
  esac
}
# patched_passes VR_A VR_B NAME...: two_passes of the tree against each NAME's patched copy
# (/tmp/gs-NAME; each name once). A name without a patch, or a patch that does not apply, is said
# and skips the runs (the call's status is then 1).
patched_passes() {
  local a=$1 b=$2 v p vs=(base:)
  shift 2
  for v in $(printf '%s\n' "$@" | awk '!seen[$0]++'); do
    if ! p=$(patch_of "$v"); then
      echo "gpu_session: no measurement patch named $v" >&2
      patch_failed=1
      continue
    fi
    patched "/tmp/gs-$v" "$p" && vs+=("$v@/tmp/gs-$v:")
  done
  [ -n "$patch_failed" ] || two_passes "$a" "$b" "${vs[@]}"
}
case $n in
  1)
    SUITEF='^cuda\.(normal|graph|timeout|cycles|overflow|cbuf|memreg|ll_deferred|ll_graph|failure)' \
      timeout -k 5 "$limit" tools/gpu_check.sh .gpu/with-mps "$d" build late suite ;;
  2)
    timeout -k 5 "$limit" tools/gpu_check.sh .gpu/with-mps "$d" build python hostcost ;;
  4)
    SUITEF=${SUITEF4:-'^cuda\.(normal\.r[238](\.early)?$|memreg_dispatch|overflow|ll\.r[234]$|ll_deferred|failure|ll_timeout|timeout|ll_misuse\.r2)'} \
      HCR="2 4" timeout -k 5 "$limit" tools/gpu_check.sh .gpu/with-mps "$d" build suite python hostcost \
      hostearly pystep ;;
  5)
    SUITEF=${SUITEF5:-'^cuda\.(normal\.r[238](\.early)?$|memreg_dispatch\.r3\.(early|copyout)|overflow|timeout|ll_deferred\.r2|failure)'} \
      EARLYT=${EARLYT:-128 4096} timeout -k 5 "$limit" tools/gpu_check.sh .gpu/with-mps "$d" build \
      suite pystep early ;;
  6)
    HCR="2 4 8" timeout -k 5 "$limit" tools/gpu_check.sh .gpu/with-mps "$d" build python \
      hostcost pystep ;;
  7)
    # shellcheck disable=SC2086 # the stages are words
    OUT="$d" WITH_MPS="$PWD/.gpu/with-mps" NPROCS="2 4" TIMEOUT=150 timeout -k 5 "$limit" \
      tools/deepep_compat.sh .deepep ${DC7_STAGES:-build intranode low_latency}
    rc7=$?
    echo "deepep_compat: exit $rc7"
    timeout -k 5 120 .gpu/with-mps "${PYTHON:-python3}" -m epcomm launch -n 4 \
      "${PYTHON:-python3}" examples/moe_layer.py >"$d/moe_layer.log" 2>&1
    rc=$?
    echo "examples/moe_layer.py, 4 ranks: exit $rc"
    tail -n 5 "$d/moe_layer.log"
    [ "$rc7" = 0 ] && [ "$rc" = 0 ] ;;  # the call's status: both ran clean
  8)
    vs=()
    for nt in ${KV_NT:-256 128}; do vs+=("nt$nt:-DEPK_NOTIFY_NT=$nt"); done
    VR="4 8 4 8" timeout -k 5 "$limit" tools/kernel_variants.sh .gpu/with-mps "$d" "${vs[@]}" \
      >"$d/variants.txt" 2>&1
    rc8=$?
    cat "$d/variants.txt"
    [ "$rc8" = 0 ] ;;
  9)
    KV_TOKENS=128 VR="8 4 8" timeout -k 5 "$limit" tools/kernel_variants.sh .gpu/with-mps "$d" \
      "hg2ru4:-DEPK_HG=2 -DEPK_RU=4" "hg4ru2:-DEPK_HG=4 -DEPK_RU=2" \
      "hg8ru1:-DEPK_HG=8 -DEPK_RU=1" >"$d/variants.txt" 2>&1
    rc9=$?
    cat "$d/variants.txt"
    [ "$rc9" = 0 ] ;;
  10)
    for v in share:-DEPK_PULL_SPLIT=1 all:-DEPK_PULL_EACH=0; do
      { cmake -S . -B build-v-${v%%:*} -G Ninja -DEP_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
          -DCMAKE_CUDA_FLAGS="${v#*:}" && ninja -C build-v-${v%%:*} bin/epcomm; } \
        >"$d/build-v-${v%%:*}.log" 2>&1 &
    done
    SUITEF=${SUITEF10:-'^cuda\.(normal\.r[238]$|normal\.r[38]\.push|memreg_dispatch\.r3|failure)'} \
      timeout -k 5 "$limit" tools/gpu_check.sh .gpu/with-mps "$d" build suite
    wait
    export PULLR=${PULLR:-8:16 4:24} PULLT=4096
    timeout -k 5 "$((limit - (SECONDS - t0)))" tools/gpu_check.sh .gpu/with-mps "$d/each" pull
    for v in share all; do
      echo "variant $v:"
      GPUB=build-v-$v PULLP=1 timeout -k 5 "$((limit - (SECONDS - t0)))" \
        tools/gpu_check.sh .gpu/with-mps "$d/$v" pull
    done ;;
  11)
    SUITEF=${SUITEF11:-'^cuda\.(normal\.r[238]$|normal\.r[38]\.stage|graph\.r2|cbuf|memreg\.r[23]$|failure)'} \
      timeout -k 5 "$limit" tools/gpu_check.sh .gpu/with-mps "$d" build suite
    CCT=${CCT:-4096} timeout -k 5 "$((limit - (SECONDS - t0)))" tools/gpu_check.sh .gpu/with-mps \
      "$d" ccopy
    DS_TOKENS=4096 timeout -k 5 "$((limit - (SECONDS - t0)))" tools/deepep_side_by_side.sh \
      .gpu/with-mps "$d/sbs" .deepep build normal report ;;
  12)
    sink=build-sink-src
    if patched "$sink" docs/gpu-runs/2026-12-06-s25/idw-sink/measurement-only.patch; then
      VR="8 8" kv "$d/variants.txt" "$d" base: "sink@$sink:-DEPK_IDW_SINK=1"
    fi ;;
  13)
    SUITEF=${SUITEF13:-'^cuda\.(normal|graph|memreg|cbuf|ll|failure|timeout)'} \
      timeout -k 5 250 tools/gpu_check.sh .gpu/with-mps "$d" build suite
    for t in 128 4096; do
      echo "tokens $t:"
      KV_TOKENS=$t kv "$d/variants-t$t.txt" "$d/kv$t" gc1: gc0:-DEPK_GRID_CONST=0
    done ;;
  15)
    s28=docs/gpu-runs/2026-12-06-s28
    if patched build-cfl-src "$s28/cached-full-layout.patch" &&
      patched build-asc-src "$s28/as-cached.patch"; then
      VR="8 4" timeout -k 5 420 tools/kernel_variants.sh .gpu/with-mps "$d" base: \
        cfl@build-cfl-src: asc@build-asc-src: >"$d/variants.txt" 2>&1
      cat "$d/variants.txt"
      GPUB=build-v-base TRR="8:16" TRDT="bf16 fp8" TRT=4096 timeout -k 5 \
        "$((limit - (SECONDS - t0)))" tools/gpu_check.sh .gpu/with-mps "$d/trace" trace
    fi ;;
  16)
    SUITEF='^cuda\.normal\.r2(\.trace)?$' TRR="8:16 4:24" TRDT="bf16 fp8" TRT=4096 \
      timeout -k 5 "$limit" tools/gpu_check.sh .gpu/with-mps "$d" build trace suite ;;
  17)
    SUITEF='^cuda\.bench\.' TRR="8:16" TRDT="bf16 fp8" TRT=4096 \
      timeout -k 5 "$limit" tools/gpu_check.sh .gpu/with-mps "$d" build trace suite ;;
  18)
    VR="8 4" timeout -k 5 420 tools/kernel_variants.sh .gpu/with-mps "$d" base: \
      co0:-DEPK_CARVEOUT=0 co100:-DEPK_CARVEOUT=100 >"$d/variants.txt" 2>&1
    cat "$d/variants.txt"
    GPUB=build-v-co0 TRR="8:16" TRDT=bf16 TRT=4096 timeout -k 5 \
      "$((limit - (SECONDS - t0)))" tools/gpu_check.sh .gpu/with-mps "$d/trace" trace ;;
  19) patched_passes 8 "8 4" asc nof ;;
  21) patched_passes 8 8 nof pfe ;;
  23) patched_passes 4 "4 8" asc ;;
  22)
    # shellcheck disable=SC2086 # the names are words
    patched_passes "8 4" "8 4" ${V22:-fx big pfe cpy} ;;
  20)
    q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active
    nvidia-smi --query-gpu=$q --format=csv >/dev/null 2>&1 || q=${q/clocks_event/clocks_throttle}
    nvidia-smi --query-gpu=$q --format=csv,noheader,nounits -lms 20 >"$d/clocks.csv" 2>&1 &
    smi=$!
    VR=8 kv "$d/variants.txt" "$d/v" base:
    kill $smi 2>/dev/null
    # Samples while the GPU was busy (power above 200 W): the SM clock's spread and the reasons.
    awk -F', ' '$4 + 0 > 200 { n++; c[$2]++; r[$6]++; p += $4 }
      END { printf "%d busy samples, mean power %.0f W\n", n, n ? p / n : 0
            for (k in c) printf "  sm clock %s MHz: %d\n", k, c[k]
            for (k in r) printf "  event reasons %s: %d\n", k, r[k] }' "$d/clocks.csv" ;;
  3)
    DS_TOKENS="${DS_TOKENS:-4096 128}" timeout -k 5 "$limit" tools/deepep_side_by_side.sh .gpu/with-mps "$d" \
      .deepep build normal python report ;;
esac
rc=$?
[ "$rc" != 0 ] || rc=${step_rc:-0}
[ -z "${patch_failed:-}" ] || rc=1
case $rc in 124 | 137) echo "gpu_session: call $n stopped at its deadline ($limit s)" ;; esac
# A test that tests/run.sh bounds with its own timeout runs in a process group of its own, which
# the deadline above does not reach: nothing of this tree's builds may hold the GPU (or the MPS
# server) into the next call, which may find this machine still warm.
pkill -9 -f 'build-(gpu|deepep|v-[^/]*)/|pytest tests/python|bench/py_|tools/deepep_time\.py' 2>/dev/null
echo "gpu_session: call $n, exit $rc after $((SECONDS - t0)) s"
tar czf "$out/c$n.tgz" -C "$out" "c$n" && rm -rf "$d"
# The device tool brings back files of at most 16 MiB: a larger archive loses everything.
size=$(stat -c %s "$out/c$n.tgz" 2>/dev/null || echo 0)
if [ "$size" -gt $((15 << 20)) ]; then
  echo "gpu_session: $out/c$n.tgz is $size bytes: split in two" >&2
  split -b 15M "$out/c$n.tgz" "$out/c$n.tgz." && rm -f "$out/c$n.tgz"
fi
exit $rc
