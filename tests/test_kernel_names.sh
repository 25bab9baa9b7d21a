#!/usr/bin/env bash
# The CUDA kernels' names, as profilers show them (ep_kernels.h, "Kernel names"): exactly one
# kernel each is epcomm::normal::{notify,layout,dispatch,combine} and epcomm::ll::{dispatch,
# combine}, and no other kernel's name or signature contains "dispatch" or "combine". DeepEP's
# bench_kineto (test_low_latency.py) finds a call's kernel by those words, one line each in the
# profile, and counts a receive hook's launch as the same kernel ("::dispatch") twice a call: a
# receive kernel of its own name made its profile divide by zero.
# Usage: tests/test_kernel_names.sh BUILD_DIR   (exit 0 pass, 1 fail, 77 no CUDA backend built)
set -u
lib=${1:?usage: test_kernel_names.sh BUILD_DIR}/libepcomm.so
say() { echo "test_kernel_names.sh: $*" >&2; fail=1; }
fail=0
[ -e "$lib" ] || { say "$lib was not built"; exit 1; }
for tool in nm c++filt readelf; do
  command -v $tool >/dev/null || { echo "skipped: $tool not found"; exit 77; }
done
# Whether kernels were built is the fat binary's section (it survives strip), not the names.
if ! readelf -S -W "$lib" | grep -q '\.nv_fatbin'; then
  echo "skipped: no CUDA backend in this build"
  exit 77
fi
# A kernel's host stub is __device_stub__<the kernel's mangled name>: demangle the stub, take the
# kernel's name out of it and demangle that.
names=$(nm "$lib" 2>/dev/null | awk '$3 ~ /__device_stub__/ && $3 !~ /\.cold$/ { print $3 }' |
  c++filt | sed -n 's/^__device_stub__\(Z[^(]*\)(.*/_\1/p' | sort -u | c++filt)
if [ -z "$names" ]; then
  say "$lib holds CUDA kernels but nm found no kernel stub (stripped?)"
  exit 1
fi
for k in normal::notify normal::layout normal::dispatch normal::combine ll::dispatch ll::combine; do
  n=$(grep -c "^epcomm::$k(" <<<"$names")
  [ "$n" = 1 ] || say "$n kernels named epcomm::$k (want 1)"
done
for w in dispatch combine; do
  others=$(grep "$w" <<<"$names" | grep -v "^epcomm::\(normal\|ll\)::$w(")
  [ -z "$others" ] || say "kernels other than epcomm::*::$w with \"$w\" in their name: $others"
done
[ "$fail" = 0 ] && echo "$(wc -l <<<"$names") kernels; the call kinds' names as stated"
exit $fail
