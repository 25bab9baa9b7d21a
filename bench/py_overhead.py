"""The per-call cost of the Python layer over the C API (README.md, "Python"), on the smallest
work: a dispatch and a combine of one token (hidden 64, topk 1, one expert per rank) on CPU
tensors, as bench/call_overhead.c times it in C. Run:

    epcomm launch -n R python bench/py_overhead.py [ITERS]

Rank 0 prints the medians, in microseconds, of:
  - epcomm.Buffer.dispatch + combine (what a DeepEP program calls: checks, torch.empty outputs
    through the allocator callback, handle objects, events);
  - the same through epcomm._C directly, outputs preallocated (the binding alone);
  - one round trip into the library: _C.buffer_query through the extension, and, for the choice
    of binding, ep_group_rank through ctypes.
"""

import ctypes
import statistics
import sys
import time

import torch

import epcomm
from epcomm import _C

H, WARMUP = 64, 200


def timed(fn, iters):
    for _ in range(WARMUP):
        fn()
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e6


def main():
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
    group = epcomm.init()
    R, me = group.nranks, group.rank
    buf = epcomm.Buffer(group, device="cpu")
    x = torch.zeros((1, H), dtype=torch.bfloat16)
    idx = torch.tensor([[(me + 1) % R]], dtype=torch.int64)

    def python_layer():
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=R)
        buf.combine(recv_x, handle)

    bid, recv_x, out = buf._normal, torch.zeros((R, H), dtype=torch.bfloat16), torch.zeros_like(x)
    rank_prefix = torch.zeros((R, R), dtype=torch.int32)

    def binding_only():
        _, h = _C.dispatch(bid, x.data_ptr(), _C.DTYPE_BF16, 1, H, 0, 0, 0, 0, idx.data_ptr(), 0,
                           1, R, 0, 0, 0, _C.OUTPUT_CALLER, 0, R, None, recv_x.data_ptr(), 0, 0,
                           0, 0, rank_prefix.data_ptr(), 0)
        _C.combine(bid, h, recv_x.data_ptr(), 0, 0, 0, 0, out.data_ptr(), 0)
        _C.handle_destroy(h)

    lib = ctypes.CDLL(epcomm.library_path())
    lib.ep_group_rank.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    rank_out, gid = ctypes.c_int(), group._id
    figures = {
        "Buffer.dispatch + combine": timed(python_layer, iters),
        "_C.dispatch + combine": timed(binding_only, iters),
        "_C.buffer_query": timed(lambda: _C.buffer_query(bid), iters),
        "ctypes ep_group_rank": timed(lambda: lib.ep_group_rank(gid, ctypes.byref(rank_out)),
                                      iters),
    }
    buf.destroy()
    group.destroy()
    if me == 0:
        print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, {R} ranks, median "
              f"of {iters}:")
        for name, us in figures.items():
            print(f"  {name:28s} {us:7.2f} us")
        layer = figures["Buffer.dispatch + combine"] - figures["_C.dispatch + combine"]
        print(f"  Python layer over the binding: {layer:.2f} us per dispatch + combine")


if __name__ == "__main__":
    main()
