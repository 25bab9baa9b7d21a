#!/usr/bin/env python3
"""Times DeepEP V1 (a built source tree, imported as `deep_ep`) at epcomm's benchmark sizes, and
prints one table of ratios against `epcomm bench --backend cuda --json` results of the same run.

Our own harness: it imports the built deep_ep and times its public calls with CUDA events; it
copies nothing of DeepEP's tests. Used by tools/deepep_side_by_side.sh; by hand (GPU machine, with
the ranks under MPS when they share a GPU):

  PYTHONPATH=DEEPEP_BUILD python3 tools/deepep_time.py normal --ranks 2 --sms 24 \
      --tokens 4096,512,128
  PYTHONPATH=DEEPEP_BUILD python3 tools/deepep_time.py ll --ranks 2 --tokens 128 --experts 288
  python3 tools/deepep_time.py report OUT_DIR      # the table: DeepEP's logs, epcomm's JSON

normal: intranode dispatch (bf16, fp8 e4m3 with per-128 float scales, column-major as DeepEP's
  own tests pass them) and combine (bf16, no weights, no bias), R processes on one GPU, a gloo
  process group, DeepEP's Config with `--sms` SMs. Per size: `full` = get_dispatch_layout +
  dispatch with topk (the count exchange and DeepEP's host wait for the receive count), `cached`
  = dispatch along the handle, `combine` = combine of the bf16 dispatch's recv_x along its handle.
  DeepEP's chunk size is tuned per operation over a few values (its tests tune too), the best
  kept; its default config is one of the candidates. Time: CUDA events around each call on the
  current stream, calls back to back, the mean over --iters calls after warm-up (DeepEP's own
  method), the slowest rank's mean; compared with the same statistic of epcomm bench (its JSON's
  "slowest_rank_mean_ms"; files from before it: the mean of the per-iteration slowest rank, which
  is never below it and at R = 8 and 128 tokens 17-19% above on an H100).
low-latency: low_latency_dispatch (bf16, fp8) and low_latency_combine (y in a tensor of ours, and
  zero copy), T tokens, E experts; `--hook 1` (default) sends with return_recv_hook=True and calls
  the hook at once, timing send and receive apart and together; `--hook 0` is DeepEP's one-kernel
  form. Median and p90 over --iters calls, slowest rank; compared with the same statistic of
  epcomm bench (each rank's median, its JSON's per_rank time_ms, the largest; files without
  per-rank figures: the median of the per-iteration slowest rank).

Each run prints `DEEPEP {json}` lines (rank 0) that `report` reads."""
import argparse
import json
import os
import sys
import time


def log(rank, *a):
    if rank == 0:
        print(*a, flush=True)


def emit(rank, **kv):
    if rank == 0:
        print("DEEPEP " + json.dumps(kv), flush=True)


# ----------------------------------------------------------------------------- workers

def setup(rank, world, port):
    import torch
    import torch.distributed as dist
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ndev = torch.cuda.device_count()
    torch.cuda.set_device(rank % ndev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    return torch, dist, dist.new_group(list(range(world)), backend="gloo")


def time_seq(torch, dist, group, fn, npoints, warmup, iters):
    """fn(mark) issues one iteration and calls mark(i) at its points i = 0 .. npoints-1 (a CUDA
    event recorded on the current stream; mark is a no-op in warm-up). Returns ev(i, j): the
    microseconds from point i to point j, one per iteration."""
    for _ in range(warmup):
        fn(lambda i: None)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    evs = [[torch.cuda.Event(enable_timing=True) for _ in range(npoints)] for _ in range(iters)]
    for ev in evs:
        fn(lambda i, ev=ev: ev[i].record())
    torch.cuda.synchronize()
    return lambda i, j: [ev[i].elapsed_time(ev[j]) * 1e3 for ev in evs]


def slowest(dist, group, world, v):
    out = [None] * world
    dist.all_gather_object(out, v, group=group)
    return max(out)


def stats(xs):
    s = sorted(xs)
    return sum(s) / len(s), s[len(s) // 2], s[int(0.9 * (len(s) - 1))]


def cast_fp8(torch, x):
    """Per-token, per-128-channel e4m3 cast; scales float [N][H/128], column-major like DeepEP's
    tests pass them (a transposed contiguous copy)."""
    n, h = x.shape
    v = x.float().view(n, h // 128, 128)
    amax = v.abs().amax(dim=2).clamp(min=1e-4)
    q = (v * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(n, h)
    s = (amax / 448.0).contiguous()
    return q, s.T.contiguous().T


def routing(torch, n, e, topk, seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    scores = torch.rand((n, e), device="cuda", generator=g) + 1e-3
    return torch.topk(scores, topk, dim=-1, sorted=False).indices


def normal_worker(rank, args, port):
    torch, dist, group = setup(rank, args.ranks, port)
    import deep_ep
    R, S, H, K, E = args.ranks, args.sms, args.hidden, args.topk, args.experts
    deep_ep.Buffer.set_num_sms(S)
    nvl_bytes = int(args.nvl_mb) << 20
    buf = deep_ep.Buffer(group, nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                         explicitly_destroy=True)
    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    log(rank, f"deepep normal: R={R}, {S} SMs per rank, H={H}, topk {K}, E={E}; device reports "
        f"{sm_count} SMs; {args.iters} timed calls after {args.warmup} warm-up, mean, slowest rank")
    dflt_d, dflt_c = deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R)
    d_cfgs = [("default", dflt_d)] + [(c, deep_ep.Config(S, int(c), 256))
                                      for c in args.dispatch_chunks.split(",") if c]
    c_cfgs = [("default", dflt_c)] + [(c, deep_ep.Config(S, int(c), 256))
                                      for c in args.combine_chunks.split(",") if c]
    for name, cfg in d_cfgs + c_cfgs:
        need = cfg.get_nvl_buffer_size_hint(H * 2, R)
        if need > nvl_bytes:
            raise SystemExit(f"config {name} needs {need} NVL bytes > --nvl-mb {args.nvl_mb}")

    def mean_us(fn, warmup, iters):
        t = time_seq(torch, dist, group, fn, 2, warmup, iters)(0, 1)
        return slowest(dist, group, R, stats(t)[0])

    def tune(make, cfgs):
        """The best of DeepEP's candidate configs (short runs), then the figure (a full run)."""
        best = None
        for name, cfg in cfgs:
            t = mean_us(make(cfg), 3, 10)
            if best is None or t < best[0]:
                best = (t, name, cfg)
        return mean_us(make(best[2]), args.warmup, args.iters), best[1], best[2]

    for N in [int(t) for t in args.tokens.split(",")]:
        torch.manual_seed(1000 + rank)
        x = (torch.rand((N, H), device="cuda") * 2 - 1).to(torch.bfloat16)
        x8 = cast_fp8(torch, x)
        idx = routing(torch, N, E, K, 77 + rank).to(deep_ep.topk_idx_t)
        w = torch.ones((N, K), dtype=torch.float32, device="cuda")
        _, _, _, in_rank, _ = buf.get_dispatch_layout(idx, E)

        def dispatch_full(xx, cfg):
            """What a full dispatch is here: the layout, then the dispatch (the host waits for
            the count); DeepEP's outputs, the handle at [4]."""
            pr, _, pe, ir, _ = buf.get_dispatch_layout(idx, E)
            return buf.dispatch(xx, num_tokens_per_rank=pr, is_token_in_rank=ir,
                                num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w,
                                config=cfg)

        def full(xx, cfg):
            def f(mark):
                mark(0)
                dispatch_full(xx, cfg)
                mark(1)
            return f

        def synced(xx, cfg):
            def f(mark):
                mark(0)
                h = dispatch_full(xx, cfg)[4]
                mark(1)
                torch.cuda.synchronize()
                dist.barrier(group=group)
                mark(2)
                buf.dispatch(xx, handle=h, config=cfg)
                mark(3)
            return f

        res, recv, dcfg = {}, {}, {}
        for dt, xx in (("bf16", x), ("fp8", x8)):
            recv[dt] = dispatch_full(xx, dflt_d)

            def cached(cfg, xx=xx, h=recv[dt][4]):
                def f(mark):
                    mark(0)
                    buf.dispatch(xx, handle=h, config=cfg)
                    mark(1)
                return f
            t, cname, ccfg = tune(cached, d_cfgs)
            dcfg[dt] = (cname, ccfg)
            res[f"dispatch_{dt}_cached"] = (t, cname)
            res[f"dispatch_{dt}_full"] = (mean_us(full(xx, ccfg), args.warmup, args.iters), cname)
            # epcomm bench's dispatch_sync_* loop: a full dispatch, the stream's end and a
            # barrier (untimed), a cached dispatch along the new handle; each timed apart.
            ev = time_seq(torch, dist, group, synced(xx, ccfg), 4, args.warmup, args.iters)
            for k, (i, j) in (("full", (0, 1)), ("cached", (2, 3))):
                res[f"dispatch_{dt}_sync_{k}"] = (slowest(dist, group, R, stats(ev(i, j))[0]),
                                                  cname)

        recv_x, h16 = recv["bf16"][0], recv["bf16"][4]
        # Check: the combine of the dispatched rows gives x * (ranks the token went to), exactly.
        comb = buf.combine(recv_x, h16, config=dflt_c)[0]
        want = (x.float() * in_rank.sum(dim=1, keepdim=True).float()).to(torch.bfloat16)
        bad = slowest(dist, group, R, int((comb != want).sum().item()))

        def combine(cfg):
            def f(mark):
                mark(0)
                buf.combine(recv_x, h16, config=cfg)
                mark(1)
            return f
        t, cname, ccfg = tune(combine, c_cfgs)
        res["combine"] = (t, cname)
        # The experts' write (a copy of their output rows into the tensor DeepEP combines)
        # + combine.
        ybuf = torch.empty_like(recv_x)

        def write_combine(mark):
            mark(0)
            ybuf.copy_(recv_x)
            buf.combine(ybuf, h16, config=ccfg)
            mark(1)
        res["write_combine"] = (mean_us(write_combine, args.warmup, args.iters), cname)

        # What a layer calls each step: layout, a full bf16 dispatch (the host waits for the
        # count), the combine of its rows; the configs tuned above.
        def layer(mark):
            mark(0)
            out = dispatch_full(x, dcfg["bf16"][1])
            buf.combine(out[0], out[4], config=ccfg)
            mark(1)
        res["layer"] = (mean_us(layer, args.warmup, args.iters), f"{dcfg['bf16'][0]}/{cname}")
        nrecv = slowest(dist, group, R, int(recv_x.size(0)))
        for op, (t, cname) in res.items():
            emit(rank, impl="deepep", mode="normal", R=R, sms=S, tokens=N, op=op, us=round(t, 1),
                 chunk=cname)
        emit(rank, impl="deepep", mode="normal", R=R, sms=S, tokens=N, op="check",
             mismatches=bad, max_recv_rows=nrecv)
        log(rank, f"deepep normal N={N}: " + ", ".join(f"{k} {v[0]:.1f} us (chunk {v[1]})"
                                                      for k, v in res.items())
            + f"; combine check: {bad} mismatches")
        recv = recv_x = h16 = comb = ybuf = None  # freed before the next size (closures hold cells)
    dist.barrier(group=group)
    buf.destroy()
    dist.barrier(group=group)
    dist.destroy_process_group()


def ll_worker(rank, args, port):
    torch, dist, group = setup(rank, args.ranks, port)
    import deep_ep
    R, T, H, K = args.ranks, args.tokens_ll, args.hidden, args.topk
    E = args.experts - args.experts % R
    L = E // R
    hook = bool(args.hook)
    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    log(rank, f"deepep low-latency: R={R}, T={T}, H={H}, topk {K}, E={E}; "
        f"{'send, then the receive hook' if hook else 'one kernel per call'}; device reports "
        f"{sm_count} SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="
        f"{os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', 'unset')}); RDMA buffer "
        f"{rdma >> 20} MiB; {args.iters} calls after {args.warmup} warm-up, median/p90")
    t0 = time.time()
    buf = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=L,
                         allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True)
    log(rank, f"deepep low-latency: buffer ready in {time.time() - t0:.1f} s")
    torch.manual_seed(2000 + rank)
    x = (torch.rand((T, H), device="cuda") * 2 - 1).to(torch.bfloat16)
    idx = routing(torch, T, E, K, 99 + rank).to(deep_ep.topk_idx_t)
    w = torch.full((T, K), 1.0 / K, dtype=torch.float32, device="cuda")
    y_any = (torch.rand((L, R * T, H), device="cuda") * 2 - 1).to(torch.bfloat16)

    def dispatch(fp8, mark, a, b):
        r = buf.low_latency_dispatch(x, idx, T, E, use_fp8=fp8, async_finish=False,
                                     return_recv_hook=hook)
        mark(a)
        if hook:
            r[4]()
        mark(b)
        return r

    def combine(h, y, zc, mark, a, b):
        out, _, hk = buf.low_latency_combine(y, idx, w, h, zero_copy=zc, async_finish=False,
                                             return_recv_hook=hook)
        mark(a)
        if hook:
            hk()
        mark(b)
        return out

    res = {}

    def put(name, t):
        _, med, p90 = stats(t)
        res[name] = (slowest(dist, group, R, med), slowest(dist, group, R, p90))

    # Dispatch + combine pairs (a handle is combined once); y = the rows as dispatched (bf16) or
    # a tensor of the right shape (fp8). Points: 0 | dispatch send 1 | receive 2 | combine send 3
    # | receive 4.
    for fp8 in (False, True):
        tag = "fp8" if fp8 else "bf16"

        def pair(mark, fp8=fp8):
            mark(0)
            r = dispatch(fp8, mark, 1, 2)
            combine(r[2], y_any if fp8 else r[0], False, mark, 3, 4)
        ev = time_seq(torch, dist, group, pair, 5, args.warmup, args.iters)
        put(f"dispatch_{tag}", ev(0, 2))
        put(f"combine_{tag}y", ev(2, 4))
        if hook:
            put(f"dispatch_{tag}_send", ev(0, 1))
            put(f"dispatch_{tag}_recv", ev(1, 2))
            put(f"combine_{tag}y_send", ev(2, 3))
            put(f"combine_{tag}y_recv", ev(3, 4))
    # Check: y = the dispatched rows, weights 1/K: out = x * (selected / K), exact in fp32.
    nomark = lambda i: None  # noqa: E731
    r = dispatch(False, nomark, 0, 0)
    out = combine(r[2], r[0], False, nomark, 0, 0)
    want = (x.float() * ((idx >= 0).sum(dim=1, keepdim=True).float() / K)).to(torch.bfloat16)
    bad = slowest(dist, group, R, int((out != want).sum().item()))

    # Zero copy: the experts' outputs written into DeepEP's next combine buffer (not timed).
    def zc_pair(mark):
        r = dispatch(False, nomark, 0, 0)
        zb = buf.get_next_low_latency_combine_buffer(r[2])
        zb.copy_(r[0])
        mark(0)
        combine(r[2], zb, True, mark, 1, 2)
    try:
        ev = time_seq(torch, dist, group, zc_pair, 3, args.warmup, args.iters)
        put("combine_zero_copy", ev(0, 2))
    except Exception as e:  # noqa: BLE001
        log(rank, f"deepep low-latency: zero copy not timed: {e}")
    for op, (med, p90) in res.items():
        emit(rank, impl="deepep", mode="ll", R=R, tokens=T, experts=E, hook=int(hook), op=op,
             us=round(med, 1), p90=round(p90, 1))
    emit(rank, impl="deepep", mode="ll", R=R, tokens=T, experts=E, hook=int(hook), op="check",
         mismatches=bad, sms_seen=sm_count,
         mps_pct=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", ""))
    log(rank, "deepep low-latency (median us): " + ", ".join(f"{k} {v[0]:.1f}"
                                                             for k, v in res.items())
        + f"; combine check: {bad} mismatches")
    dist.barrier(group=group)
    buf.destroy()
    dist.barrier(group=group)
    dist.destroy_process_group()


def spawn(worker, args):
    import random
    import torch.multiprocessing as mp
    port = 20000 + random.randrange(20000)
    mp.spawn(worker, args=(args, port), nprocs=args.ranks, join=True)


# ----------------------------------------------------------------------------- report

# epcomm bench's rows (JSON phase keys) of a bf16 / fp8 run -> the op names of the table
EP_NORMAL = {
    "bf16": {"dispatch": "dispatch_bf16_full", "dispatch_cached": "dispatch_bf16_cached",
             "dispatch_cached_caller": "dispatch_bf16_cached_copy",
             "dispatch_cached_reg": "dispatch_bf16_cached_reg", "combine_view": "combine_view",
             "combine": "combine_tensor", "combine_cbuf": "combine_cbuf",
             "write_combine_cbuf": "write_combine_cbuf",
             "write_combine_tensor": "write_combine_tensor", "combine_reg": "combine_reg",
             "write_combine_reg": "write_combine_reg"},
    "fp8": {"dispatch": "dispatch_fp8_full", "dispatch_cached": "dispatch_fp8_cached"},
}
for _t in ("bf16", "fp8"):  # full and cached paired in one loop (full - cached only)
    EP_NORMAL[_t].update({"dispatch_pair_full": f"dispatch_{_t}_pair_full",
                          "dispatch_pair_cached": f"dispatch_{_t}_pair_cached"})
    # a full dispatch, the stream's end and a barrier, a cached one (both dtypes)
    EP_NORMAL[_t].update({"dispatch_sync_full": f"dispatch_{_t}_sync_full",
                          "dispatch_sync_cached": f"dispatch_{_t}_sync_cached"})
# the same pair with a combine after each dispatch (bf16 only)
EP_NORMAL["bf16"].update({"dispatch_lpair_full": "dispatch_bf16_lpair_full",
                          "dispatch_lpair_cached": "dispatch_bf16_lpair_cached"})
# epcomm op -> the DeepEP op it is compared with
VS_NORMAL = [
    ("dispatch_fp8_full", "dispatch_fp8_full", "fp8 dispatch, full (views)"),
    ("dispatch_fp8_cached", "dispatch_fp8_cached", "fp8 dispatch, cached (views)"),
    ("dispatch_bf16_full", "dispatch_bf16_full", "bf16 dispatch, full (views)"),
    ("dispatch_bf16_cached", "dispatch_bf16_cached", "bf16 dispatch, cached (views)"),
    ("dispatch_bf16_cached_copy", "dispatch_bf16_cached", "bf16 dispatch, cached, caller tensors"),
    ("dispatch_bf16_cached_reg", "dispatch_bf16_cached",
     "bf16 dispatch, cached, registered caller tensors"),
    ("combine_view", "combine", "combine, x = dispatch view"),
    ("combine_tensor", "combine", "combine, x = separate tensor"),
    ("combine_cbuf", "combine", "combine, x = ep_get_combine_buffer"),
    ("write_combine_cbuf", "write_combine", "experts' write + combine (buffer)"),
    ("write_combine_tensor", "write_combine", "experts' write + combine (tensor)"),
    ("combine_reg", "combine", "combine, x = registered tensor"),
    ("write_combine_reg", "write_combine", "experts' write + combine (registered tensor)"),
]
EP_LL = {
    "bf16": {"dispatch": "dispatch_bf16", "combine": "combine_caller",
             "combine_view": "combine_view", "combine_zero_copy": "combine_zero_copy",
             "dispatch_send": "dispatch_bf16_send", "dispatch_recv": "dispatch_bf16_recv",
             "combine_send": "combine_send", "combine_recv": "combine_recv"},
    "fp8": {"dispatch": "dispatch_fp8"},
}
VS_LL = [
    ("dispatch_bf16", "dispatch_bf16", "dispatch bf16"),
    ("dispatch_fp8", "dispatch_fp8", "dispatch fp8"),
    ("combine_caller", "combine_bf16y", "combine, y in a tensor"),
    ("combine_zero_copy", "combine_zero_copy", "combine, zero copy"),
    ("dispatch_bf16_send", "dispatch_bf16_send", "dispatch bf16: send phase"),
    ("dispatch_bf16_recv", "dispatch_bf16_recv", "dispatch bf16: receive phase"),
    ("combine_send", "combine_bf16y_send", "combine: send phase"),
    ("combine_recv", "combine_bf16y_recv", "combine: receive phase"),
    ("dispatch_bf16", "dispatch_bf16_1k", "dispatch bf16 (DeepEP one kernel)"),
    ("dispatch_fp8", "dispatch_fp8_1k", "dispatch fp8 (DeepEP one kernel)"),
    ("combine_caller", "combine_bf16y_1k", "combine, y in a tensor (DeepEP one kernel)"),
]


def parse_epcomm(path):
    """(mode, R, sms, tokens) and {op: us} from one `epcomm bench --backend cuda --json` file:
    by the statistic tools/deepep_time.py gives DeepEP: normal mode each rank's mean, low latency
    each rank's median, the slowest rank's."""
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        return None, {}
    cfg = d.get("config", {})
    mode, dtype = cfg.get("mode"), cfg.get("dtype")
    key = (mode, cfg.get("ranks"), cfg.get("threads") if mode == "normal" else 0, cfg.get("tokens"))
    table = (EP_NORMAL if mode == "normal" else EP_LL).get(dtype, {})
    stat = "mean" if mode == "normal" else "median"
    ops = {}
    for k, op in table.items():
        ph = d.get("phases", {}).get(k, {})
        tm = ph.get("time_ms", {})
        ranks = [r["time_ms"] for r in ph.get("per_rank", []) if r.get("time_ms") is not None]
        if stat == "mean" and ph.get("slowest_rank_mean_ms") is not None:
            ops[op] = 1e3 * ph["slowest_rank_mean_ms"]
        elif stat == "median" and ranks:
            ops[op] = 1e3 * max(ranks)
        elif tm.get(stat) is not None:
            ops[op] = 1e3 * tm[stat]
        if tm.get("median") is not None:  # for full - cached: means at R = 8 swing by ~100 us
            ops[op + "@median"] = 1e3 * tm["median"]
    memory_rates(d, dtype, ops)
    ceiling = d.get("summary", {}).get("ratio_dispatch_ceiling")
    if mode == "normal" and ceiling is not None:  # full dispatch GB/s over the copy ceiling's
        ops[f"_ceiling_{dtype}"] = ceiling
    if d.get("summary", {}).get("check") != "pass":
        ops["_check"] = "FAILED"
    sm = d.get("summary", {})
    fell = [f"{what}: {sm[took_k]} of {sm[calls_k]} calls" for calls_k, took_k, what in PATHS
            if calls_k in sm and took_k in sm and sm[took_k] < sm[calls_k]]
    if fell:
        ops[f"_fell_{dtype}"] = "; ".join(fell)
    return key, ops


# The bench's fast-path counters (summary: calls of the row, fewest on a receiving rank that
# took the path): fewer than all is a fallback the row's time silently includes.
PATHS = [("caller_calls", "caller_pulled_min", "caller tensors pulled (EP_CUDA_PULL)"),
         ("alloc_calls", "alloc_pulled_min", "allocator outputs pulled (EP_CUDA_PULL)"),
         ("combine_calls", "combine_copied_min",
          "separate tensor copied into the combine buffer (EP_CUDA_COMBINE_COPY)"),
         ("alloc_reg_calls", "alloc_reg_in_place_min",
          "registered allocator outputs written in place")]


def memory_rates(d, dtype, ops):
    """From a bf16 run: the bytes of x per rank (_xbytes), the received rows' bytes per rank
    (_rbytes, the dispatch's logical bytes) and the copy ceiling's memory traffic, every rank's
    cudaMemcpy together, read + write (_mem_bps)."""
    cfg, ph = d.get("config", {}), d.get("phases", {})
    disp, mc = ph.get("dispatch", {}).get("per_rank", []), ph.get("memcpy", {})
    t_ms = mc.get("slowest_rank_mean_ms") or mc.get("time_ms", {}).get("mean")  # older files: mean
    if dtype != "bf16" or not disp or not mc.get("per_rank") or not t_ms:
        return
    R = cfg.get("ranks", 0)
    ops["_xbytes"] = cfg.get("tokens", 0) * cfg.get("hidden", 0) * 2
    ops["_rbytes"] = sum(r["logical_bytes"] for r in disp) / len(disp)
    ops["_mem_bps"] = R * 2 * mc["per_rank"][0]["logical_bytes"] / (t_ms / 1e3)


# Memory passes of a copy-out call, in units of (x's bytes, the received rows' bytes) per rank:
# a dispatch into unregistered arrays reads x and writes each row to the receiver's area, which
# the receiver reads and writes out (pushed), or stages x once and the receivers read the staged
# rows and write them out (pulled, EP_CUDA_PULL); a combine of an unregistered tensor must copy
# its rows where the peers can read them (or push them) before they are read and reduced.
FLOORS = [("bf16 dispatch into caller tensors, pushed", (1, 3), "dispatch_bf16_cached"),
          ("bf16 dispatch into caller tensors, pulled", (2, 2), "dispatch_bf16_cached"),
          ("combine, x = separate tensor", (1, 3), "combine")]
# Below this much data (every rank's x and rows; four times the L2 of 50 MB on an H100, 60 on an
# H200) the L2 holds a good part of it, and a floor from the memory's rate says little.
FLOOR_MIN_BYTES = 240e6


def floors(key, e, dp):
    """Lines: each copy-out cell's time if every byte it must move crossed memory at the copy
    ceiling's rate, and the most any implementation of that form could then beat DeepEP by."""
    mode, R, sms, N = key
    if "_mem_bps" not in e or R * (e["_xbytes"] + e["_rbytes"]) < FLOOR_MIN_BYTES:
        return []
    out = []
    for label, (nx, nr), dop in FLOORS:
        floor = R * (nx * e["_xbytes"] + nr * e["_rbytes"]) / e["_mem_bps"] * 1e6
        dv = dp.get((mode, R, sms, N, dop))
        best = f", at most {dv / floor:.2f}x DeepEP ({dv:.1f} us)" if dv else ""
        out.append(f"{label}: {nx} x + {nr} rows per rank, {floor:.1f} us at the copy "
                   f"ceiling's {e['_mem_bps'] / 1e12:.2f} TB/s{best}")
    return out


def parse_deepep(path):
    out = []
    for line in open(path, errors="replace"):
        i = line.find("DEEPEP {")
        if i >= 0:
            try:
                out.append(json.loads(line[i + 7:]))
            except ValueError:
                pass
    return out


# bench/py_combine_input.py's figures (epcomm from PyTorch) against DeepEP's write + combine.
VS_PYTHON = [
    ("py_write_combine_tensor", "write_combine", "Python: experts' write + combine (tensor)"),
    ("py_write_combine_mem_pool", "write_combine", "Python: write + combine (mem_pool tensor)"),
    ("py_write_combine_combine_buffer", "write_combine", "Python: write + combine (combine buf.)"),
    # a layer's step (layout + dispatch with default outputs + combine), six ways in one run
    ("py_layer_dispatch_combine", "layer", "Python: layer step, defaults (pool+late)"),
    ("py_layer_dispatch_combine_nospares", "layer", "Python: layer step, spares off"),
    ("py_layer_dispatch_combine_promise", "layer", "Python: layer step, pool off, late promised"),
    ("py_layer_dispatch_combine_pool_nolate", "layer",
     "Python: layer step, out pool, late hello off"),
    ("py_layer_dispatch_combine_plain", "layer", "Python: layer step, no out pool"),
    ("py_layer_dispatch_combine_early", "layer", "Python: layer step, no pool + early data"),
    ("py_layer_dispatch_combine_pool_early", "layer",
     "Python: layer step, out pool + early data"),
]


# The Python rows that must have moved their rows in place (Buffer.in_place_counts: combines,
# dispatches, or [dispatches, combines] for the layer step), else their ratio is a fallback's.
PY_IN_PLACE = {"write_combine_mem_pool": "combines", "write_combine_combine_buffer": "combines",
               "dispatch_worst_mem_pool": "dispatches", "layer_dispatch_combine": "both",
               "layer_dispatch_combine_pool_nolate": "the layer's combines",
               "layer_dispatch_combine_pool_early": "the layer's combines"}


def fallbacks(key, figures):
    """Notes for the rows of PY_IN_PLACE whose calls did not all go in place (rank 0's)."""
    out = []
    for name, what in PY_IN_PLACE.items():
        f = figures.get(name)
        if not f or "in_place" not in f:
            continue
        got = f["in_place"] if isinstance(f["in_place"], list) else [f["in_place"]]
        if what == "the layer's combines":  # its dispatches copy out: [dispatches, combines]
            if got and got[0] > 0:
                out.append(f"Python R={key[1]} tokens {key[3]}: {name}: {got[0]} dispatches in "
                           f"place, so the late hello was on: the row is not what it says")
            got = got[1:]
        if min(got) < f.get("calls", 0):
            out.append(f"Python R={key[1]} tokens {key[3]}: {name}: in place {got} of "
                       f"{f['calls']} calls ({what}): its figure is (partly) a fallback's")
    return out


def parse_python(path):
    """(("normal", R, sms, tokens), {op: mean us}, notes) of one `py_combine_input.py --json`
    file."""
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        return None, {}, []
    key = ("normal", d.get("ranks"), d.get("sms"), d.get("tokens"))
    figures = d.get("figures", {})
    # A spike (one call over twice the median) weighs on these means: named beside the table.
    spikes = [f"Python R={key[1]} tokens {key[3]}: spike: {s}" for s in d.get("spikes", [])]
    # DeepEP's statistic (the slowest rank's mean) where the file has it.
    return (key, {"py_" + k: v.get("rank_mean_us", v["mean_us"]) for k, v in figures.items()},
            fallbacks(key, figures) + spikes)


def report(d):
    import glob
    ep = {}
    for p in sorted(glob.glob(os.path.join(d, "epcomm-*.json"))):
        key, ops = parse_epcomm(p)
        if key:
            ep.setdefault(key, {}).update(ops)  # the bf16 and the fp8 run of one size
    notes = []
    for p in sorted(glob.glob(os.path.join(d, "py-*.json"))):
        key, ops, fell = parse_python(p)
        if key:
            ep.setdefault(key, {}).update(ops)
            notes += fell
    dp = {}
    for p in sorted(glob.glob(os.path.join(d, "deepep-*.log"))):
        rows = parse_deepep(p)
        for r in rows:
            if r.get("op") == "check":
                if r.get("mps_pct"):
                    notes.append(f"DeepEP low-latency R={r['R']}: run with "
                                 f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={r['mps_pct']} (it saw "
                                 f"{r.get('sms_seen')} SMs); epcomm without")
                if r.get("mismatches"):
                    notes.append(f"DeepEP {r['mode']} R={r['R']} tokens {r['tokens']}: "
                                 f"combine check {r['mismatches']} mismatches")
                continue
            if r["mode"] == "normal":
                dp[("normal", r["R"], r["sms"], r["tokens"], r["op"])] = r["us"]
            else:  # DeepEP's one-kernel form (no receive hook) apart
                op = r["op"] + ("" if r.get("hook", 1) else "_1k")
                dp[("ll", r["R"], 0, r["tokens"], op)] = r["us"]
        if not rows:
            tail = open(p, errors="replace").read().strip().splitlines()[-3:]
            notes.append(f"{os.path.basename(p)}: no DeepEP figures ({' | '.join(tail)[:300]})")
    print("\nside by side, same GPU, same run (x = DeepEP time / epcomm time: > 1 means epcomm is "
          "faster); us")
    fmt = "{:<6} {:>3} {:>4} {:>6}  {:<48} {:>9} {:>9} {:>7}"
    print(fmt.format("mode", "R", "SMs", "tokens", "operation", "epcomm", "DeepEP", "x"))
    for key in sorted(ep, key=lambda k: (k[0], k[1], -k[3])):
        mode, R, sms, N = key
        for eop, dop, label in (VS_NORMAL + VS_PYTHON if mode == "normal" else VS_LL):
            e = ep[key].get(eop)
            dv = dp.get((mode, R, sms, N, dop))
            if (e is None and dv is None) or (dv is None and dop.endswith("_1k")) or \
                    (e is None and eop.startswith("py_")):  # the python step was not run
                continue
            x = f"{dv / e:.2f}" if e and dv else "-"
            print(fmt.format(mode, R, sms or "", N, label, f"{e:.1f}" if e else "-",
                             f"{dv:.1f}" if dv else "-", x))
        if mode == "normal":
            f, c = ep[key].get("dispatch_fp8_full"), ep[key].get("dispatch_fp8_cached")
            b, bc = ep[key].get("dispatch_bf16_full"), ep[key].get("dispatch_bf16_cached")
            if f and c and b and bc:
                def gaps(what, get, dts=("fp8", "bf16")):  # "; what: fp8 X, bf16 Y", by get
                    m = [(get(t, "full"), get(t, "cached")) for t in dts]
                    return ("" if None in sum(m, ()) else f"; {what}: " +
                            ", ".join(f"{t} {a - b:.1f}" for t, (a, b) in zip(dts, m)))

                def med(infix):  # epcomm's medians, rows dispatch_{t}{infix}_{k}
                    return lambda t, k: ep[key].get(f"dispatch_{t}{infix}_{k}@median")
                lps = gaps("paired, each followed by a combine", med("_lpair"), ("bf16",))
                # DeepEP's own, by the same statistic: issue 15's goal is absolute, and DeepEP's
                # gap is what a user moving from it has now.
                deepep = gaps("DeepEP's, by the same statistic",
                              lambda t, k: dp.get((mode, R, sms, N, f"dispatch_{t}_{k}")))
                print(f"{'':<6} {R:>3} {sms:>4} {N:>6}  epcomm full - cached (count exchange), "
                      f"by the table's statistic: fp8 {f - c:.1f}, bf16 {b - bc:.1f} us"
                      f"{gaps('medians of the slowest rank per iteration', med(''))}"
                      f"{gaps('paired in one loop, medians', med('_pair'))}{lps}{deepep}")
                # Both after the same drain and barrier (on one GPU a cached dispatch right
                # after a full one is slower than in a loop of its own), by the table's
                # statistic for both.
                ep_sync = gaps("epcomm", lambda t, k: ep[key].get(f"dispatch_{t}_sync_{k}"))
                dp_sync = gaps("DeepEP",
                               lambda t, k: dp.get((mode, R, sms, N, f"dispatch_{t}_sync_{k}")))
                if ep_sync and dp_sync:
                    print(f"{'':<6} {R:>3} {sms:>4} {N:>6}  full - cached, each cached dispatch "
                          f"after the full one, the stream's end and a barrier{ep_sync}{dp_sync}")
            # Issue 15's small-batch goal: a full dispatch + the combine of its view, both timed
            # alone, their sums compared.
            pairs = []
            for t in ("bf16", "fp8"):
                e = [ep[key].get(f"dispatch_{t}_full"), ep[key].get("combine_view")]
                dv = [dp.get((mode, R, sms, N, f"dispatch_{t}_full")),
                      dp.get((mode, R, sms, N, "combine"))]
                if None not in e and None not in dv:
                    pairs.append(f"{t} {sum(e):.1f} / {sum(dv):.1f} us = {sum(dv) / sum(e):.2f}x")
            if pairs:
                print(f"{'':<6} {R:>3} {sms:>4} {N:>6}  full dispatch + combine of its view, "
                      f"epcomm / DeepEP: {', '.join(pairs)}")
            shares = [f"{t} {ep[key][f'_ceiling_{t}']:.3f}" for t in ("fp8", "bf16")
                      if ep[key].get(f"_ceiling_{t}") is not None]
            if shares:
                print(f"{'':<6} {R:>3} {sms:>4} {N:>6}  epcomm full dispatch / copy ceiling "
                      f"(the bench's ratio of GB/s medians): {', '.join(shares)}")
            for line in floors(key, ep[key], dp):
                print(f"{'':<6} {R:>3} {sms:>4} {N:>6}  memory floor: {line}")
        if ep[key].get("_check"):
            notes.append(f"epcomm {mode} R={R} tokens {N}: check FAILED")
        for t in ("bf16", "fp8"):
            if ep[key].get(f"_fell_{t}"):
                notes.append(f"epcomm {mode} R={R} tokens {N} {t}: fast path not always taken: "
                             f"{ep[key][f'_fell_{t}']}")
    for k in sorted(set((m, R, s, N) for (m, R, s, N, _) in dp) - set(ep)):
        notes.append(f"DeepEP {k} has figures but no epcomm log matched")
    for n in notes:
        print("note:", n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("normal")
    n.add_argument("--ranks", type=int, required=True)
    n.add_argument("--sms", type=int, default=24)
    n.add_argument("--tokens", default="4096")
    n.add_argument("--hidden", type=int, default=7168)
    n.add_argument("--topk", type=int, default=8)
    n.add_argument("--experts", type=int, default=256)
    n.add_argument("--iters", type=int, default=30)
    n.add_argument("--warmup", type=int, default=10)
    n.add_argument("--nvl-mb", type=int, default=1024)
    n.add_argument("--dispatch-chunks", default="4,8,16,24,32")
    n.add_argument("--combine-chunks", default="2,4,8,12,16")
    ll = sub.add_parser("ll")
    ll.add_argument("--ranks", type=int, required=True)
    ll.add_argument("--tokens", dest="tokens_ll", type=int, default=128)
    ll.add_argument("--hidden", type=int, default=7168)
    ll.add_argument("--topk", type=int, default=8)
    ll.add_argument("--experts", type=int, default=288)
    ll.add_argument("--iters", type=int, default=200)
    ll.add_argument("--warmup", type=int, default=20)
    ll.add_argument("--hook", type=int, default=1)
    rp = sub.add_parser("report")
    rp.add_argument("dir")
    args = ap.parse_args()
    if args.cmd == "report":
        return report(args.dir)
    spawn(normal_worker if args.cmd == "normal" else ll_worker, args)


if __name__ == "__main__":
    sys.exit(main())
