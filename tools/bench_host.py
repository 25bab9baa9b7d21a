#!/usr/bin/env python3
"""Host time against GPU time per call, from `epcomm bench --backend cuda --json` files.

    tools/bench_host.py FILE.json...

One line per phase: the call's median time (slowest rank, events on the stream) and each rank's
median host time in the call (`host_ms`). For a call the host does not wait in, that is the time
to enqueue it, and where it reaches the call's time the GPU waited for that host. A full
dispatch's host waits for the count (marked "waits"): its host time holds that wait and says
nothing of the kind.
"""
import json
import sys

# The rows whose call makes the host wait for the count (bench_normal.c, bench_normal_var.c).
WAITS = {"dispatch", "dispatch_pair_full", "dispatch_alloc", "dispatch_alloc_reg"}


def table(path):
    with open(path) as f:
        j = json.load(f)
    cfg = j.get("config", {})
    print(f"{path}: R={cfg.get('ranks')} tokens={cfg.get('tokens')} dtype={cfg.get('dtype')}")
    print(f"  {'phase':<24} {'time us':>8} {'host us min/med/max':>22}  host/time")
    for key, p in j["phases"].items():
        t = p["time_ms"]["median"] * 1e3
        hosts = sorted(r["host_ms"] * 1e3 for r in p["per_rank"] if "host_ms" in r)
        if not hosts:
            continue
        mid = hosts[(len(hosts) - 1) // 2]  # the lower median for an even count
        print(f"  {key:<24} {t:8.1f} {hosts[0]:7.1f} {mid:7.1f} {hosts[-1]:7.1f}  "
              f"{hosts[-1] / t if t > 0 else float('nan'):.2f}"
              f"{'  waits' if key in WAITS else ''}")


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in sys.argv[1:]:
        table(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
