"""Lifecycle inside a world: nothing left after destroy, `with`, use after destroy, buffers
garbage-collected without destroy, and freed by their last reference alone."""

import gc
import os
import warnings
import weakref

import torch

import epcomm
from common import BF16, gen, ipc_exportable, routing


def _counts():
    shm = sorted(n for n in os.listdir("/dev/shm") if "epcomm" in n)
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), shm


def _round(buf, ctx, channels_used=True):
    R, E = ctx.nranks, 2 * ctx.nranks
    idx = routing(gen(9, ctx.rank), 64, E, 2).to(ctx.device)
    x = torch.ones((64, 256), dtype=BF16, device=ctx.device)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
    buf.combine(recv_x, handle)
    try:
        ll = buf.low_latency_dispatch(x[:8], routing(gen(9, ctx.rank), 8, E, 2, dup=0).to(
            ctx.device), 8, E, use_fp8=True)
    except epcomm.UnsupportedError:  # a CUDA backend without low-latency mode: every rank alike
        return
    buf.low_latency_combine(torch.zeros((2, R * 8, 256), dtype=BF16, device=ctx.device),
                            ll[2]._ep.topk_idx.to(ctx.device),
                            torch.ones((8, 2), device=ctx.device), ll[2])


def leaves_nothing(ctx):
    """No thread (channel workers: 3 channels), fd or /dev/shm entry outlives destroy()."""
    group = epcomm.Group.from_process_group(ctx.pg)
    buf = epcomm.Buffer(group, device=ctx.device, num_channels=3)
    _round(buf, ctx)  # warm-up: what torch itself starts once stays
    buf.destroy()
    gc.collect()
    before = _counts()
    for _ in range(3):
        buf = epcomm.Buffer(group, device=ctx.device, num_channels=3)
        _round(buf, ctx)
        buf.destroy()
        gc.collect()
    after = _counts()
    group.destroy()
    assert before == after, f"(threads, fds, /dev/shm) before {before}, after {after}"


def destroy_and_with(ctx):
    with epcomm.Buffer(ctx.pg, device=ctx.device) as buf:
        _round(buf, ctx)
    assert repr(buf).endswith("destroyed>")
    buf.destroy()  # a second destroy does nothing
    x = torch.ones((4, 64), dtype=BF16, device=ctx.device)
    idx = torch.zeros((4, 1), dtype=torch.int64, device=ctx.device)
    try:
        buf.dispatch(x, topk_idx=idx, num_experts=ctx.nranks)
        raise AssertionError("dispatch after destroy")
    except epcomm.DestroyedError as e:
        assert "destroyed" in str(e)
    # An error inside `with`: the buffer is released locally, the error propagates.
    try:
        with epcomm.Buffer(ctx.pg, device=ctx.device) as buf2:
            raise KeyError("in the block")
    except KeyError:
        pass
    assert repr(buf2).endswith("destroyed>")


def garbage_collected(ctx):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        buf = epcomm.Buffer(ctx.pg, device=ctx.device, explicitly_destroy=True)
        del buf
        gc.collect()
        quiet = epcomm.Buffer(ctx.pg, device=ctx.device)  # DeepEP's default: freed when dropped
        del quiet
        gc.collect()
    msgs = [str(w.message) for w in got if issubclass(w.category, epcomm.LifecycleWarning)]
    assert len(msgs) == 1 and "buffer.destroy()" in msgs[0], msgs


def freed_when_dropped(ctx):
    """A Buffer made as DeepEP's default (explicitly_destroy=False) goes with its last
    reference, the garbage collector off: with a registration (a reference back from it would
    make a cycle) and, on CUDA, the default out pool (whose arena is registered)."""
    gc.collect()
    gc.disable()
    try:
        buf = epcomm.Buffer(ctx.pg, int(1e8), 0, device=ctx.device)
        cuda = torch.device(ctx.device).type == "cuda"
        exportable = not cuda or ipc_exportable()  # (the cpu backend registers any memory)
        assert (buf.out_pool_bytes > 0) == (cuda and exportable), buf.out_pool_bytes
        t = torch.zeros((64, 256), dtype=BF16, device=ctx.device)
        reg = buf.register(t) if exportable else None
        gone = weakref.ref(buf)
        del buf
        assert gone() is None, "the Buffer outlived its last reference (a reference cycle)"
        assert reg is None or not reg.active, "its registration went with it"
    finally:
        gc.enable()
