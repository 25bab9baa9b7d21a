"""Host time of the Python layer's CUDA calls, where a small batch spends it (at 128 tokens a
write + combine is host-bound: the GPU waits for the host). Run on a GPU machine, the ranks
sharing the GPU under MPS:

    epcomm launch -n R python bench/py_host_cost.py [TOKENS]

Rank 0 prints the median host time (perf_counter around the call, no synchronization) of
Buffer.combine and of its parts as PyTorch offers them (a copy, torch.empty, a wait_stream, a
fresh event recorded), of the two forms bench/py_combine_input.py times (experts' write into a
plain tensor / into a Buffer.mem_pool tensor, then the combine), then a cProfile of 200 combines
(ordered by own time). DeepEP's sizes: H 7168, topk 8, 256 experts, bf16."""

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

import epcomm
from epcomm import deep_ep

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


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    group = epcomm.init()
    torch.cuda.set_device(0)
    deep_ep.Buffer.set_num_sms(24)
    gen = torch.Generator().manual_seed(1234 + group.rank)
    buf = deep_ep.Buffer(group, int(1e9), 0, explicitly_destroy=True, device="cuda")
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
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            buf.combine(plain, handle)
        prof.disable()
        torch.cuda.synchronize()
        if group.rank == 0:
            print(f"R={group.nranks}, {n} tokens per rank: host us per call, median of 200")
            for name, us in res:
                print(f"  {name:<28}{us:8.1f}")
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            print(out.getvalue())
    finally:
        buf.destroy()
        group.destroy()


if __name__ == "__main__":
    main()
