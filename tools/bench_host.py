#!/usr/bin/env python3
"""Host time against GPU time per call, from `epcomm bench --backend cuda --json` files.

    tools/bench_host.py FILE.json...

One line per phase: the call's median time (slowest rank, events on the stream) and each rank's
median host time in the call (`host_ms`: enqueueing it, and for a full dispatch the wait for the
counts). Where a rank's host time reaches the call's time, the GPU waited for that host.
"""
import json
import sys


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
        mid = hosts[len(hosts) // 2]
        print(f"  {key:<24} {t:8.1f} {hosts[0]:7.1f} {mid:7.1f} {hosts[-1]:7.1f}  "
              f"{hosts[-1] / t if t > 0 else float('nan'):.2f}")


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in sys.argv[1:]:
        table(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
