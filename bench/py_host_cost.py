"""Host time of the Python layer's CUDA calls, where a small batch spends it (at 128 tokens a
write + combine is host-bound: the GPU waits for the host). Run on a GPU machine, the ranks
sharing the GPU under MPS:

    epcomm launch -n R python bench/py_host_cost.py [TOKENS]

Rank 0 prints the median host time (perf_counter around the call, no synchronization) of
Buffer.combine and of its parts as PyTorch offers them (a copy, torch.empty, a wait_stream, a
fresh event recorded), of recv_x's allocation plain and from the out pool (through
torch.cuda.use_mem_pool, through the direct calls OutPool makes: whether it makes them on this
PyTorch is printed), of the two forms bench/py_combine_input.py times (experts' write into a plain
tensor / into a Buffer.mem_pool tensor, then the combine), then a cProfile of 200 combines
(ordered by own time). DeepEP's sizes: H 7168, topk 8, 256 experts, bf16.

Then the same calls both ways a synchronous call can be ordered (_events.CudaLaunch.DIRECT):
through the communication stream as DeepEP does (the baseline) and on the current stream
itself; for each, the host time of a combine and the event-timed medians (slowest rank) of the
experts' write + combine from the combine buffer, and of a whole layer's dispatch (default
outputs: the host waits for the count) + combine, with the ratio to the baseline.

The layer step's phases come four times: default outputs as plain tensors (the baseline), from
the Buffer's out pool (``out_pool_bytes``), from the pool with the spares off (the next calls'
outputs made while the dispatch waits for its count, ``epcomm._spares``), and from the pool
again; the first two with every rank's phases of the (at most three) slowest steps that took
over twice the median step, so that a rank whose own phase stalled stands apart from the ranks
that waited for it; and with the host time of the pool's room check alone
(``OutPool._room``: it may take a snapshot of the pool). EP_CUDA_LATE_HELLO is 1 unless set, for
the whole run: the buffer has registrations (the pools), so every figure here, the baseline's and
the other sections' too, is taken with the late hello (what a Buffer with its default out pool
runs; EP_CUDA_LATE_HELLO=0 for the receiver's copy-out)."""

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

import epcomm
from epcomm import _events, deep_ep
from ranks import event_times, gather

H, TOPK, E = 7168, 8, 256


def host_us(fn, n=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(t) * 1e6


def event_us(group, fn, n=100):
    """Median over calls of the slowest rank's CUDA-event time of fn, us."""
    alls = gather(group, event_times(fn, n)[0])
    return statistics.median(max(c) for c in zip(*alls)) * 1e3


def both_ways(group, buf, x, idx, w, tpr, tpe, itr, handle, y):
    """{DIRECT: (combine host us, write + combine event us, dispatch + combine event us)}."""
    cbuf = buf.get_combine_buffer(handle)

    def write_combine():
        cbuf.copy_(y)
        buf.combine(cbuf, handle)

    def layer():
        recv_x, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=tpr, is_token_in_rank=itr,
                                             num_tokens_per_expert=tpe, topk_idx=idx,
                                             topk_weights=w)
        buf.combine(recv_x, h)

    out = {}
    for direct in (False, True, False, True):  # twice each, interleaved: the machine drifts
        _events.CudaLaunch.DIRECT = direct
        figs = (host_us(lambda: buf.combine(cbuf, handle)), event_us(group, write_combine),
                event_us(group, layer))
        out.setdefault(direct, []).append(figs)
    _events.CudaLaunch.DIRECT = True
    return {k: tuple(statistics.median(f[i] for f in v) for i in range(3))
            for k, v in out.items()}


LAYER_STEPS = 100  # timed layer steps of layer_phases, after 10 untimed


PHASES = ("layout", "dispatch to alloc (wait)", "alloc callback", "alloc to return", "combine",
          "whole step")


def stalls(group, ph, top=3):
    """The steps whose whole host time, on some rank, exceeded twice the median of such steps:
    for the `top` slowest, every rank's phases (us), so that a rank whose own phase took long
    (a host stall: its layout, its allocation) stands apart from ranks that waited for it (their
    wait for the count). Lines of text; none when no step did."""
    n, k = len(ph), len(PHASES)
    alls = gather(group, [v for p in ph for v in p])
    whole = [max(a[i * k + k - 1] for a in alls) for i in range(n)]
    med = statistics.median(whole)
    worst = sorted((i for i in range(n) if whole[i] > 2 * med), key=lambda i: -whole[i])[:top]
    out = []
    for i in worst:
        out.append(f"  step {i + 1} of {n}: {whole[i] * 1e6:.0f} us on its slowest rank "
                   f"(median step {med * 1e6:.0f} us); per rank, " + ", ".join(PHASES) + ":")
        for r, a in enumerate(alls):
            out.append(f"    rank {r}: " + " ".join(f"{a[i * k + j] * 1e6:.0f}" for j in range(k)))
    return out


def layer_phases(group, buf, x, idx, w, E, n=LAYER_STEPS):
    """Median host us of a layer step's phases: the layout call; dispatch from its start to its
    allocator callback (notify launched, the host's wait for the count), the callback, from the
    callback to its return (the data kernel's launch, the Python results); the combine call.
    With stalls()'s lines for the steps far slower than the median."""
    from epcomm import _buffer
    rows_call = _buffer._Rows.__call__
    marks = {}

    def timed_rows(self, rows):
        marks["a0"] = time.perf_counter()
        r = rows_call(self, rows)
        marks["a1"] = time.perf_counter()
        return r

    _buffer._Rows.__call__ = timed_rows
    ph = []
    try:
        for i in range(n + 10):
            t0 = time.perf_counter()
            pr, _, pe, ir, _ = buf.get_dispatch_layout(idx, E)
            t1 = time.perf_counter()
            out = buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir,
                               num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w)
            t2 = time.perf_counter()
            buf.combine(out[0], out[4])
            t3 = time.perf_counter()
            if i >= 10:
                ph.append((t1 - t0, marks["a0"] - t1, marks["a1"] - marks["a0"], t2 - marks["a1"],
                           t3 - t2, t3 - t0))
    finally:
        _buffer._Rows.__call__ = rows_call
    torch.cuda.synchronize()
    return ([(nm, statistics.median(p[i] for p in ph) * 1e6) for i, nm in enumerate(PHASES)],
            stalls(group, ph))


def alloc_rows(pool, shape, buf, live=48):
    """Host us of recv_x's allocation in the dispatch's callback: plain, and from the out pool
    through torch.cuda.use_mem_pool (the form before the fourteenth session), the direct calls
    OutPool makes now, and OutPool.empty as dispatch calls it (room check + direct; the arena
    is not cut up here, so its room check is the cheap one). Each timed call also frees its
    tensor (in dispatch recv_x lives on). Then what the room check costs when the arena is cut
    up (a training step holding many layers' recv_x): a snapshot of the pool's cache with one
    free segment, and with `live` recv_x alive in the pool."""
    if pool is None or pool.mem is None:
        return []
    from epcomm import _mempool
    dev, bf = buf.device, torch.bfloat16

    def via_use_mem_pool():
        with _mempool._use_pool(pool.mem.pool, dev):
            torch.empty(shape, dtype=bf, device=dev)

    def snapshot():
        try:
            pool.mem.pool.snapshot(include_traces=False)
        except TypeError:  # a PyTorch without the keyword
            pool.mem.pool.snapshot()

    direct = (("recv_x: pool, direct calls", lambda: pool._direct(pool.mem, shape, bf, dev))
              if _mempool._DIRECT else
              ("recv_x: pool, use_mem_pool again (no direct calls here)", via_use_mem_pool))
    rows = [(name, host_us(fn)) for name, fn in (
        ("recv_x: torch.empty", lambda: torch.empty(shape, dtype=bf, device=dev)),
        ("recv_x: pool, use_mem_pool", via_use_mem_pool),
        direct,
        ("recv_x: OutPool.empty", lambda: pool.empty(shape, bf, dev)),
        ("out pool snapshot, 1 segment", snapshot))]
    with _mempool._use_pool(pool.mem.pool, dev):
        held = [torch.empty(shape, dtype=bf, device=dev) for _ in range(live)]
    rows.append((f"out pool snapshot, {live} live", host_us(snapshot)))
    del held
    return rows


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    group = epcomm.init()
    torch.cuda.set_device(0)
    deep_ep.Buffer.set_num_sms(24)
    gen = torch.Generator().manual_seed(1234 + group.rank)
    os.environ.setdefault("EP_CUDA_LATE_HELLO", "1")
    buf = deep_ep.Buffer(group, int(1e9), 0, explicitly_destroy=True, device="cuda",
                         out_pool_bytes=int(1e9))
    pool, buf._out_pool = buf._out_pool, None  # plain default outputs until the pool's phases
    try:
        x = torch.randn((n, H), generator=gen).to(torch.bfloat16).cuda()
        idx = torch.rand((n, E), generator=gen).topk(TOPK).indices.cuda()
        w = torch.rand((n, TOPK), generator=gen).cuda()
        tpr, _, tpe, itr, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=tpr,
                                                  is_token_in_rank=itr, num_tokens_per_expert=tpe,
                                                  topk_idx=idx, topk_weights=w)
        y, plain, side = recv_x * 1, torch.empty_like(recv_x), torch.cuda.Stream()
        mp = buf.mem_pool(64 << 20)

        def pool_form():
            with torch.cuda.use_mem_pool(mp.pool):
                z = torch.empty_like(y)
            z.copy_(y)
            buf.combine(z, handle)

        parts = (("combine", lambda: buf.combine(plain, handle)),
                 ("copy_", lambda: plain.copy_(y)),
                 ("torch.empty", lambda: torch.empty((n, H), dtype=torch.bfloat16, device="cuda")),
                 ("wait_stream", lambda: side.wait_stream(torch.cuda.current_stream())),
                 ("new event, recorded", lambda: torch.cuda.Event().record()),
                 ("write + combine, tensor", lambda: (plain.copy_(y), buf.combine(plain, handle))),
                 ("write + combine, mem_pool", pool_form))
        res = [(name, host_us(fn)) for name, fn in parts]
        res += alloc_rows(pool, tuple(recv_x.shape), buf)
        ways = both_ways(group, buf, x, idx, w, tpr, tpe, itr, handle, y)
        phases, slow = layer_phases(group, buf, x, idx, w, E)
        buf._out_pool = pool
        c0 = buf.in_place_counts()
        u0 = buf._spares.used
        pool_phases, pool_slow = layer_phases(group, buf, x, idx, w, E) if pool else (None, [])
        c1 = buf.in_place_counts()  # the pool path taken, or a silent fallback
        spares_taken = buf._spares.used - u0
        # The same without the spares (epcomm._spares): their share of the host's phases;
        # then with them once more (the order of the runs moves a phase too).
        buf._spares.enabled = False
        try:
            bare_phases, _ = layer_phases(group, buf, x, idx, w, E) if pool else (None, [])
        finally:
            buf._spares.enabled = True
        again, _ = layer_phases(group, buf, x, idx, w, E) if pool else (None, [])
        pool_inpl = (c1[1] - c0[1], c1[0] - c0[0])
        rx_bytes = recv_x.numel() * recv_x.element_size()
        room = host_us(lambda: pool._room(rx_bytes, buf.device)) if pool else None
        buf._out_pool = None
        lprof = cProfile.Profile()
        lprof.enable()
        for _ in range(100):
            pr, _, pe, ir, _ = buf.get_dispatch_layout(idx, E)
            out = buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir,
                               num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w)
            buf.combine(out[0], out[4])
        lprof.disable()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            buf.combine(plain, handle)
        prof.disable()
        torch.cuda.synchronize()
        if group.rank == 0:
            from epcomm import _mempool
            print(f"R={group.nranks}, {n} tokens per rank: host us per call, median of 200 "
                  f"(torch {torch.__version__}; out pool's direct calls "
                  f"{'used' if _mempool._DIRECT else 'not used'})")
            for name, us in res:
                print(f"  {name:<32}{us:8.1f}")
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            print(out.getvalue())
            print("layer step (layout + dispatch, default outputs + combine): host us, "
                  "medians of 100; default outputs plain (baseline) / from the out pool / the "
                  "out pool with the spares off / the out pool again; "
                  f"EP_CUDA_LATE_HELLO={os.environ.get('EP_CUDA_LATE_HELLO')}")
            for i, (nm, us) in enumerate(phases):
                pu = (f"{pool_phases[i][1]:10.1f}{bare_phases[i][1]:10.1f}{again[i][1]:10.1f}"
                      if pool_phases else "   no pool")
                print(f"  {nm:<28}{us:8.1f}{pu}")
            if pool_phases:
                steps = LAYER_STEPS + 10
                print(f"  out pool steps in place: {pool_inpl[0]}/{steps} dispatches, "
                      f"{pool_inpl[1]}/{steps} combines (rank 0); spares taken: "
                      f"{spares_taken} in {steps} steps (3 a step when every one was made)")
            if room is not None:
                print(f"  out pool room check ({rx_bytes} bytes): {room:.1f} us")
            for what, lines in (("plain outputs", slow), ("out pool", pool_slow)):
                if lines:
                    print(f"  stalls ({what}): steps over twice the median step")
                    print("\n".join(lines))
            out = io.StringIO()
            pstats.Stats(lprof, stream=out).sort_stats("tottime").print_stats(25)
            print(out.getvalue())
            print("ordering of a synchronous call (medians of two rounds each; event times: "
                  "slowest rank)")
            print(f"{'':<34}{'combine host':>14}{'write+combine':>15}{'dispatch+combine':>18}")
            base = ways[False]
            for direct, name in ((False, "comm stream (DeepEP's; baseline)"),
                                 (True, "current stream (direct)")):
                f = ways[direct]
                print(f"{name:<34}{f[0]:14.1f}{f[1]:15.1f}{f[2]:18.1f}")
            print(f"{'x baseline':<34}" + "".join(f"{base[i] / ways[True][i]:{wd}.2f}"
                                                   for i, wd in ((0, 14), (1, 15), (2, 18))))
    finally:
        buf.destroy()
        group.destroy()


if __name__ == "__main__":
    main()
