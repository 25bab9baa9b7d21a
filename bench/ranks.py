"""What the Python benches share: every rank's figures, gathered through the epcomm group, and
the CUDA-event timing of a call."""

import gc
import struct
import time


def gather(group, values):
    """Every rank's list of floats (the same length on each rank), in rank order: the group's
    allgather of them packed as doubles. Collective."""
    n = len(values)
    mine = struct.pack(f"{n}d", *values)
    return [struct.unpack(f"{n}d", b) for b in group.allgather(mine)]


def event_times(fn, n, warmup=10):
    """fn timed n times by CUDA events on the current stream (at small batches the host is the
    bottleneck, so they bracket its work too), after `warmup` calls: (event ms, host ms, garbage
    collections during the call), one per call. torch is imported by the caller."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(n)]
    host, gcs = [], []
    for a, b in ev:
        g0 = sum(st["collections"] for st in gc.get_stats())
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host.append((time.perf_counter() - t0) * 1e3)
        gcs.append(sum(st["collections"] for st in gc.get_stats()) - g0)
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev], host, gcs
