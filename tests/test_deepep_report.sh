#!/usr/bin/env bash
# tools/deepep_time.py report (the side-by-side table of issue 15) on recorded figures: one
# size of a real H200 run (tests/fixtures/deepep_report: epcomm's bench JSON, the Python
# bench's JSON, DeepEP's lines; 2026-12-04, tenth session; its layer step had plain outputs, so it
# stands under the name the step without the out pool has). Checks ratios (the layer step's
# too), the full - cached line (DeepEP's own beside it), the copy-ceiling line, the full
# dispatch + combine line, the memory floors of the copy-out cells, that a clean run has no
# notes, that a failed epcomm self-check is reported, that a fast path the bench counted as not
# always taken is named, and that files with DeepEP's statistic (each rank's mean, the slowest
# rank's) are compared by it; full - cached after a barrier, both sides; tools/bench_rows.py.
# Usage: test_deepep_report.sh SRC
set -u -o pipefail
src=${1:?usage: test_deepep_report.sh SRC}
fix=$src/tests/fixtures/deepep_report
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

out=$(python3 "$src/tools/deepep_time.py" report "$fix") || fail "report exited $?"
want=(
  'fp8 dispatch, full \(views\) +96\.9 +695\.7 +7\.18$'
  'bf16 dispatch, cached, caller tensors +270\.8 +426\.9 +1\.58$'
  'combine, x = dispatch view +217\.9 +477\.4 +2\.19$'
  'Python: write \+ combine \(mem_pool tensor\) +335\.2 +585\.3 +1\.75$'
  "Python: layer step, no out pool +845\.4 +922\.4 +1\.09$"
  # DeepEP's own full - cached, by the same statistic: 695.7 - 400.9 and 486.9 - 426.9
  'paired in one loop, medians: fp8 11\.5, bf16 9\.8; DeepEP.s, by the same statistic: fp8 294\.8, bf16 60\.0$'
  'copy ceiling .*: fp8 0\.611, bf16 0\.799$'
  'combine of its view, epcomm / DeepEP: bf16 361\.4 / 964\.3 us = 2\.67x, fp8 314\.8 / 1173\.1 us = 3\.73x$'
  # 2 ranks x (58.7 MB of x + 3 x 117.1 MB of rows) at 2 x 2 x 268.4 MB / 263.8 us of cudaMemcpy
  'memory floor: bf16 dispatch into caller tensors, pushed: 1 x \+ 3 rows per rank, 201\.4 us at the copy ceiling.s 4\.07 TB/s, at most 2\.12x DeepEP \(426\.9 us\)$'
  'memory floor: bf16 dispatch into caller tensors, pulled: 2 x \+ 2 rows per rank, 172\.7 us'
  'memory floor: combine, x = separate tensor: 1 x \+ 3 rows per rank, 201\.4 us .* at most 2\.37x DeepEP \(477\.4 us\)$'
)
for w in "${want[@]}"; do
  grep -Eq "$w" <<<"$out" || fail "no line matching '$w' in:
$out"
done
! grep -q '^note:' <<<"$out" || fail "notes in a clean run: $(grep '^note:' <<<"$out")"

cp "$fix"/* "$tmp"/
sed -i 's/"check": "pass"/"check": "fail"/' "$tmp/epcomm-normal-r2-t4096-fp8.json"
out=$(python3 "$src/tools/deepep_time.py" report "$tmp") || fail "report exited $? (failed check)"
grep -q '^note: epcomm normal R=2 tokens 4096: check FAILED' <<<"$out" ||
  fail "a failed self-check is not reported: $out"
# A pooled Python row whose calls did not all go in place (a silent fallback) is named.
python3 - "$tmp/py-r2-t4096.json" <<'PY' || fail "could not edit the fixture copy"
import json, sys
d = json.load(open(sys.argv[1]))
d["figures"]["write_combine_mem_pool"]["in_place"] = 12
json.dump(d, open(sys.argv[1], "w"))
PY
out=$(python3 "$src/tools/deepep_time.py" report "$tmp") || fail "report exited $? (fallback)"
grep -q '^note: Python R=2 tokens 4096: write_combine_mem_pool: in place \[12\] of 40 calls' \
  <<<"$out" || fail "a fallback of a pooled row is not reported: $out"
# The layer step with the out pool and the late hello off: its combines must go in place, its
# dispatches must not (the fixture predates the form: added here as a run would write it).
python3 - "$tmp/py-r2-t4096.json" <<'PY' || fail "could not edit the fixture copy"
import json, sys
d = json.load(open(sys.argv[1]))
d["figures"]["layer_dispatch_combine_pool_nolate"] = {
    "median_us": 900.0, "mean_us": 910.0, "calls": 40, "in_place": [3, 38]}
json.dump(d, open(sys.argv[1], "w"))
PY
out=$(python3 "$src/tools/deepep_time.py" report "$tmp") || fail "report exited $? (no late)"
grep -q 'Python: layer step, out pool, late hello off' <<<"$out" ||
  fail "the layer step without the late hello is not in the table: $out"
grep -q '^note: Python R=2 tokens 4096: layer_dispatch_combine_pool_nolate: 3 dispatches in place' \
  <<<"$out" || fail "a late hello that was on is not reported: $out"
grep -q '^note: Python R=2 tokens 4096: layer_dispatch_combine_pool_nolate: in place \[38\] of 40' \
  <<<"$out" || fail "the form's combines not in place are not reported: $out"
# The pair with a combine after each dispatch (the fixture predates it: added as a run writes
# it) gives its own full - cached after the paired loop's.
python3 - "$tmp/epcomm-normal-r2-t4096-bf16.json" <<'PY' || fail "could not edit the fixture copy"
import json, sys
d = json.load(open(sys.argv[1]))
for k, ms in (("full", 0.1500), ("cached", 0.1375)):
    row = dict(d["phases"]["dispatch_pair_" + k])
    row["time_ms"] = dict(row["time_ms"], median=ms)
    d["phases"]["dispatch_lpair_" + k] = row
json.dump(d, open(sys.argv[1], "w"))
PY
out=$(python3 "$src/tools/deepep_time.py" report "$tmp") || fail "report exited $? (lpair)"
lwant='paired in one loop, medians: fp8 11\.5, bf16 9\.8; paired, each followed by a combine: '
grep -Eq "${lwant}bf16 12\.5; DeepEP" <<<"$out" || fail "the pair with combines is not reported: $out"
# The full and the cached dispatch after the same drain and barrier (dispatch_sync_*, newer than
# the fixture: added as both runs write them), epcomm's and DeepEP's by the table's statistic;
# no line while only one side has them.
sline="after the full one, the stream's end and a barrier"
! grep -q "$sline" <<<"$out" || fail "a barrier line without the figures: $out"
python3 - "$tmp" <<'PY' || fail "could not edit the fixture copies"
import json, sys
for t, full, cached in (("fp8", 0.1000, 0.0950), ("bf16", 0.2000, 0.1880)):
    p = f"{sys.argv[1]}/epcomm-normal-r2-t4096-{t}.json"
    d = json.load(open(p))
    for k, ms in (("full", full), ("cached", cached)):
        row = dict(d["phases"]["dispatch_pair_" + k], slowest_rank_mean_ms=ms)
        d["phases"]["dispatch_sync_" + k] = row
    json.dump(d, open(p, "w"))
PY
out=$(python3 "$src/tools/deepep_time.py" report "$tmp") || fail "report exited $? (sync)"
! grep -q "$sline" <<<"$out" || fail "a barrier line without DeepEP's figures: $out"
for r in fp8_sync_full:700.0 fp8_sync_cached:640.0 bf16_sync_full:490.0 bf16_sync_cached:455.5; do
  printf 'DEEPEP {"impl": "deepep", "mode": "normal", "R": 2, "sms": 24, "tokens": 4096, "op": "dispatch_%s", "us": %s, "chunk": "default"}\n' \
    "${r%%:*}" "${r#*:}" >>"$tmp/deepep-normal-r2.log"
done
out=$(python3 "$src/tools/deepep_time.py" report "$tmp") || fail "report exited $? (sync, DeepEP)"
grep -Eq "${sline}; epcomm: fp8 5\.0, bf16 12\.0; DeepEP: fp8 60\.0, bf16 34\.5$" <<<"$out" ||
  fail "full - cached after a barrier is not reported for both: $out"
# tools/bench_rows.py: the loops' medians of a file, "-" for a loop it lacks.
rows=$(python3 "$src/tools/bench_rows.py" "$fix/epcomm-normal-r2-t4096-bf16.json" \
  "$tmp/epcomm-normal-r2-t4096-bf16.json") || fail "bench_rows.py exited $?"
grep -Eq '^epcomm-normal-r2-t4096-bf16\.json +143\.5 +134\.5 +143\.8 +133\.9 +- +- +- +- +- ' \
  <<<"$rows" || fail "bench_rows.py: the fixture's loops: $rows"
grep -Eq ' 143\.8 +133\.9 +- +- +- +143\.8 +133\.9 +- +- +-$' <<<"$rows" ||
  fail "bench_rows.py: the sync loop added to the copy: $rows"
# Files with DeepEP's own statistic (each rank's mean, the slowest rank's) are compared by it.
python3 - "$tmp/epcomm-normal-r2-t4096-fp8.json" "$tmp/py-r2-t4096.json" <<'PY' ||
import json, sys
d = json.load(open(sys.argv[1]))
d["phases"]["dispatch"]["slowest_rank_mean_ms"] = 0.0900
json.dump(d, open(sys.argv[1], "w"))
p = json.load(open(sys.argv[2]))
p["figures"]["write_combine_mem_pool"]["rank_mean_us"] = 300.0
json.dump(p, open(sys.argv[2], "w"))
PY
  fail "could not edit the fixture copies"
out=$(python3 "$src/tools/deepep_time.py" report "$tmp") || fail "report exited $? (rank means)"
grep -Eq 'fp8 dispatch, full \(views\) +90\.0 +695\.7 +7\.73$' <<<"$out" ||
  fail "the C bench's slowest rank's mean is not what the table compares: $out"
grep -Eq 'Python: write \+ combine \(mem_pool tensor\) +300\.0 +585\.3 +1\.95$' <<<"$out" ||
  fail "the Python bench's slowest rank's mean is not what the table compares: $out"
# A fast path the bench counted as not always taken (a silent fallback inside the row's time) is
# named; one taken by every call is not.
python3 - "$tmp/epcomm-normal-r2-t4096-bf16.json" <<'PY' || fail "could not edit the fixture copy"
import json, sys
d = json.load(open(sys.argv[1]))
d["summary"].update({"caller_calls": 40, "caller_pulled_min": 12,
                     "combine_calls": 40, "combine_copied_min": 40})
json.dump(d, open(sys.argv[1], "w"))
PY
out=$(python3 "$src/tools/deepep_time.py" report "$tmp") || fail "report exited $? (paths)"
grep -q '^note: epcomm normal R=2 tokens 4096 bf16: fast path not always taken: caller tensors pulled (EP_CUDA_PULL): 12 of 40 calls$' \
  <<<"$out" || fail "a fast path's fallback is not reported (or a full one is): $out"
# Low latency: epcomm by each rank's median, the slowest rank's (DeepEP's figure is that too),
# not by the median of each iteration's slowest rank.
ll=$tmp/ll
mkdir -p "$ll"
cat >"$ll/epcomm-ll-r2-t128-bf16.json" <<'JSON'
{"config": {"mode": "ll", "ranks": 2, "threads": 0, "tokens": 128, "dtype": "bf16"},
 "summary": {"check": "pass"},
 "phases": {"dispatch": {"time_ms": {"median": 0.0150, "mean": 0.0155},
   "per_rank": [{"rank": 0, "time_ms": 0.0100}, {"rank": 1, "time_ms": 0.0120}]}}}
JSON
echo 'DEEPEP {"impl": "deepep", "mode": "ll", "R": 2, "tokens": 128, "experts": 288, "hook": 1, "op": "dispatch_bf16", "us": 24.0}' \
  >"$ll/deepep-ll-r2.log"
out=$(python3 "$src/tools/deepep_time.py" report "$ll") || fail "report exited $? (low latency)"
grep -Eq '^ll +2 .* 128  dispatch bf16 +12\.0 +24\.0 +2\.00$' <<<"$out" ||
  fail "low latency is not compared by the slowest rank's median: $out"
# A file from before the per-rank figures: the median of each iteration's slowest rank.
python3 - "$ll/epcomm-ll-r2-t128-bf16.json" <<'PY' || fail "could not edit the low-latency file"
import json, sys
d = json.load(open(sys.argv[1]))
del d["phases"]["dispatch"]["per_rank"]
json.dump(d, open(sys.argv[1], "w"))
PY
out=$(python3 "$src/tools/deepep_time.py" report "$ll") || fail "report exited $? (old ll file)"
grep -Eq '^ll +2 .* 128  dispatch bf16 +15\.0 +24\.0 +1\.60$' <<<"$out" ||
  fail "a low-latency file without per-rank figures is not read by its median: $out"
echo "deepep_time report: ratios, gaps, ceiling and notes as recorded"
