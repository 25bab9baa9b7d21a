#!/usr/bin/env bash
# Times variants of the CUDA kernels' compile-time shapes in one bounded sequence (GPU machine):
#   tools/kernel_variants.sh WITH_MPS OUT_DIR "NAME[@SRC_DIR]:FLAGS" ...
# SRC_DIR (default: this tree) builds another source tree, e.g. the previous commit's
# (`git archive REV | tar -x -C DIR`), to time it against this one in the same call.
# FLAGS are nvcc -D options (EPK_CT/EPK_RU/EPK_HG/EPK_SU/EPK_CSPLIT for combine,
# EPK_DT/EPK_UNR/EPK_DMETA for dispatch, EPK_PLAN_GRID for the full dispatch's notify grid,
# EPK_NOTIFY_NT for its block size, which is also the tokens of a plan tile: 128 gives 32 tiles at
# 4096 tokens instead of 16); each variant gets its own build (only the epcomm tool), then `epcomm
# bench --backend cuda` runs at R=2, 4, 8 (24, 24, 16 SMs per rank), bf16 and fp8. Prints one line
# of median times (us) per variant and R, from the runs' JSON (bf16pair / fp8pair: full - cached
# dispatch timed in one loop, the paired rows; bf16lpair: the same with a combine after each
# dispatch; bf16wc / fp8wc: the full dispatch in the worst-case form, no host wait for the count);
# a run whose self-check did not pass says so (measurement builds may give wrong outputs on
# purpose, so that is a note, not a failure). Exits 1 when a variant did not build: its rows are
# missing. VR: rank counts (2 4 8); KV_TOKENS: tokens per rank (the bench's default, 4096).
set -u -o pipefail
mps=${1:?usage}; out=${2:?usage}; shift 2
mkdir -p "$out"
export EP_TIMEOUT_S=${EP_TIMEOUT_S:-15}
built_all=1
name() { local n=${1%%:*}; echo "${n%%@*}"; }
src() { local n=${1%%:*}; case $n in *@*) echo "${n#*@}" ;; *) echo . ;; esac; }
for v in "$@"; do
  n=$(name "$v"); f=${v#*:}
  # A build folder configured from another source tree (a variant name reused for another
  # patch) is started afresh: cmake refuses a cache that names another source folder.
  grep -qxF "CMAKE_HOME_DIRECTORY:INTERNAL=$(cd "$(src "$v")" && pwd -P)" \
    build-v-$n/CMakeCache.txt 2>/dev/null || rm -rf build-v-$n
  # Built in this call (build-v-N/.kv-built): a failed rebuild leaves an earlier binary behind.
  rm -f build-v-$n/.kv-built
  { cmake -S "$(src "$v")" -B build-v-$n -G Ninja -DEP_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_CUDA_FLAGS="$f" && ninja -C build-v-$n bin/epcomm && touch build-v-$n/.kv-built; } \
    >"build-v-$n.log" 2>&1 &
done
wait
# us KEY FILE: the median time of phase KEY in microseconds ("-" when absent).
us() {
  sed -n "s/^  \"$1\": {.*\"time_ms\": {\"median\": \([^,]*\),.*/\1/p" "$2" |
    awk 'END { if (NR) printf "%.1f", $1 * 1000; else printf "-" }'
}
# gap FILE [INFIX]: full - cached dispatch of the paired loop (both in each iteration; INFIX
# lpair: the loop with a combine after each dispatch), medians, us.
gap() {
  local k=dispatch_${2:-pair}
  awk -v a="$(us "${k}_full" "$1")" -v b="$(us "${k}_cached" "$1")" \
    'BEGIN { if (a == "-" || b == "-") printf "-"; else printf "%.1f", a - b }'
}
printf '%-8s %2s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n' variant R bf16full bf16cach fp8full \
  fp8cach comb_view comb_tens bf16pair fp8pair bf16lpair bf16wc fp8wc
for R in ${VR:-2 4 8}; do
  for v in "$@"; do
    n=$(name "$v") note=""
    [ -f build-v-$n/.kv-built ] || {
      echo "$n: build failed"
      tail -5 build-v-$n.log
      built_all=0
      continue
    }
    for dt in bf16 fp8; do
      timeout 90 "$mps" build-v-$n/bin/epcomm launch -n $R build-v-$n/bin/epcomm bench \
        --backend cuda --dtype $dt --baseline off ${KV_TOKENS:+--tokens $KV_TOKENS} --json "$out/v-$n-r$R-$dt.json" \
        >>"$out/variants.log" 2>&1 || note="$note $dt: exit $?"
      grep -q '"check": "pass"' "$out/v-$n-r$R-$dt.json" 2>/dev/null || note="$note $dt: check failed"
    done
    b=$out/v-$n-r$R-bf16.json f=$out/v-$n-r$R-fp8.json
    printf '%-8s %2s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s%s\n' "$n" "$R" "$(us dispatch "$b")" \
      "$(us dispatch_cached "$b")" "$(us dispatch "$f")" "$(us dispatch_cached "$f")" \
      "$(us combine_view "$b")" "$(us combine "$b")" "$(gap "$b")" "$(gap "$f")" \
      "$(gap "$b" lpair)" "$(us dispatch_wc "$b")" \
      "$(us dispatch_wc "$f")" "$note"
  done
done
[ "$built_all" = 1 ]
