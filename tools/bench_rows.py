#!/usr/bin/env python3
"""The dispatch loops of `epcomm bench --json` files side by side: one line per file, the median
of the slowest rank per iteration of each loop, in us ("-" where the file has no such row).
Issue 15's full - cached is read from these: the full and the cached dispatch in loops of their
own, paired in one loop, a full and two cached ones (triple), each cached one after the full
one, the stream's end and a barrier (sync), or after a 64 MB copy too (flush), and the full
dispatch without the host's wait (wc).

    tools/bench_rows.py FILE.json...
"""
import json
import os
import sys

COLUMNS = [("full", "dispatch"), ("cached", "dispatch_cached"),
           ("pair.f", "dispatch_pair_full"), ("pair.c", "dispatch_pair_cached"),
           ("tri.f", "dispatch_tri_full"), ("tri.c1", "dispatch_tri_cached1"),
           ("tri.c2", "dispatch_tri_cached2"), ("sync.f", "dispatch_sync_full"),
           ("sync.c", "dispatch_sync_cached"), ("flush.f", "dispatch_flush_full"),
           ("flush.c", "dispatch_flush_cached"), ("wc", "dispatch_wc")]


def row(path):
    phases = json.load(open(path)).get("phases", {})
    cells = []
    for _, key in COLUMNS:
        ms = phases.get(key, {}).get("time_ms", {}).get("median")
        cells.append("-" if ms is None else f"{ms * 1e3:.1f}")
    return cells


def main(paths):
    if not paths:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    width = max(len(os.path.basename(p)) for p in paths)
    print(f"{'file':<{width}}", *(f"{c:>7}" for c, _ in COLUMNS))
    for p in paths:
        print(f"{os.path.basename(p):<{width}}", *(f"{c:>7}" for c in row(p)))


if __name__ == "__main__":
    main(sys.argv[1:])
