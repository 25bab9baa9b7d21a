#!/usr/bin/env bash
# Times variants of the CUDA kernels' compile-time shapes in one bounded sequence (GPU machine):
#   tools/kernel_variants.sh WITH_MPS OUT_DIR "NAME:FLAGS" ...
# FLAGS are nvcc -D options (EPK_CT/EPK_RU/EPK_HG/EPK_SU for combine, EPK_DT/EPK_UNR for dispatch);
# each variant gets its own build (only the benchmark and the launcher), then bin/cuda_bench runs
# at R=2, 4, 8 (24, 24, 16 SMs per rank). Prints one line of times (us) per variant and R.
set -u -o pipefail
mps=${1:?usage}; out=${2:?usage}; shift 2
mkdir -p "$out"
export EP_TIMEOUT_S=${EP_TIMEOUT_S:-15}
for v in "$@"; do
  n=${v%%:*}; f=${v#*:}
  { cmake -S . -B build-v-$n -G Ninja -DEP_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_CUDA_FLAGS="$f" && ninja -C build-v-$n bin/cuda_bench bin/epcomm; } \
    >"build-v-$n.log" 2>&1 &
done
wait
printf '%-8s %2s %9s %9s %9s %9s %9s %9s\n' variant R bf16full bf16cach fp8full fp8cach comb_view comb_tens
for R in 2 4 8; do
  for v in "$@"; do
    n=${v%%:*}
    [ -x build-v-$n/bin/cuda_bench ] || { echo "$n: build failed"; tail -5 build-v-$n.log; continue; }
    timeout 60 "$mps" build-v-$n/bin/epcomm launch -n $R build-v-$n/bin/cuda_bench \
      >"$out/v-$n-r$R.tmp" 2>&1
    rc=$?
    grep -q 'combine check: exact' "$out/v-$n-r$R.tmp" || rc="$rc, combine check not exact"
    cat "$out/v-$n-r$R.tmp" >>"$out/variants.log"
    grep -E '^\[0\] (dispatch (bf16|fp8) \((full|cached), views\)|combine)' "$out/v-$n-r$R.tmp" |
      awk -v n=$n -v R=$R -v rc=$rc '{for(i=1;i<=NF;i++) if ($i ~ /\)$/) {t[++k]=$(i+1); break}}
        END {printf "%-8s %2s %9s %9s %9s %9s %9s %9s%s\n", n, R, t[1], t[2], t[3], t[4], t[5], t[6],
             rc ? " exit " rc : ""}'
    rm -f "$out/v-$n-r$R.tmp"
  done
done
