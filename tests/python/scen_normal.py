"""Normal mode, as DeepEP's tests/test_intranode.py exercises it (written afresh): layout,
dispatch in bf16 and fp8 (column-major scales), with and without top-k (routing by
is_token_in_rank), cached dispatch, worst-case tokens, combine with weights and biases, the
stream flags; every output compared bit for bit with the reference (tools/ref/ref.c)."""

import contextlib
import os

import torch

import epcomm
import ref
from common import BF16, F32, FP8, I32, Check, bf16, gen, ipc_exportable, routing
from epcomm import deep_ep


def _world(R, seed, sizes, H, E, topk, fp8):
    """Every rank's inputs: x (bf16, or fp8 bytes), scales, topk_idx, topk_weights, and a second
    x for the cached dispatch."""
    xs, scs, idxs, ws, x2s = [], [], [], [], []
    S = (H + 127) // 128
    for r in range(R):
        g = gen(seed, r)
        n = sizes[r]
        if fp8:
            xs.append(torch.randint(0, 256, (n, H), generator=g, dtype=torch.uint8).view(FP8))
            x2s.append(torch.randint(0, 256, (n, H), generator=g, dtype=torch.uint8).view(FP8))
            scs.append(torch.rand((n, S), generator=g) + 0.5)
        else:
            xs.append(bf16(g, n, H))
            x2s.append(bf16(g, n, H))
        idxs.append(routing(g, n, E, topk))
        ws.append(torch.rand((n, topk), generator=g))
    return xs, (scs if fp8 else None), idxs, ws, x2s


def _combine_inputs(seed, R, nrs, H, bias_count, sizes):
    """Every rank's expert outputs y [nr][H] and every source rank's biases."""
    ys, b0, b1 = [], [], []
    for r in range(R):
        g = gen(seed + 17, r)
        ys.append(bf16(g, nrs[r], H))
        b0.append(bf16(g, sizes[r], H) if bias_count >= 1 else None)
        b1.append(bf16(g, sizes[r], H) if bias_count >= 2 else None)
    return ys, (b0 if bias_count >= 1 else None), (b1 if bias_count >= 2 else None)


def _dev(t, device):
    return None if t is None else t.to(device)


def _x_arg(xs, scs, rank, device, column_major=True):
    if scs is None:
        return xs[rank].to(device)
    sc = scs[rank]
    if column_major:  # as DeepEP's test passes them: [n][S] with strides (1, n)
        sc = sc.T.contiguous().T
    return xs[rank].to(device), sc.to(device)


def dispatch_combine(ctx, seed, sizes, H, E, topk, fp8=False, with_topk=True, weights=True,
                     alignment=1, bias=2, async_finish=False, previous=False, comm_alloc=False):
    """One DeepEP-style round: layout, dispatch, cached dispatch, worst-case dispatch, combine."""
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    xs, scs, idxs, ws, x2s = _world(R, seed, sizes, H, E, topk, fp8)
    want, st = ref.dispatch(xs, idxs, ws if weights else None, E, alignment, scs)
    mine = want[me]
    ck = Check(me, f"dispatch_combine(fp8={fp8}, topk={with_topk}, R={R})")
    buf = deep_ep.Buffer(ctx.pg, int(1e8), 0, explicitly_destroy=True, device=dev)
    try:
        idx = idxs[me].to(dev)
        tpr, _, tpe, itr, _ = buf.get_dispatch_layout(idx, E)
        flags = dict(async_finish=async_finish, allocate_on_comm_stream=comm_alloc)
        if previous:
            flags["previous_event"] = buf.capture()
        args = dict(x=_x_arg(xs, scs, me, dev), num_tokens_per_rank=tpr, is_token_in_rank=itr,
                    num_tokens_per_expert=tpe, expert_alignment=alignment,
                    config=deep_ep.Buffer.get_dispatch_config(R), **flags)
        if with_topk:
            args.update(topk_idx=idx, topk_weights=ws[me].to(dev) if weights else None)
        recv_x, r_idx, r_w, per_expert, handle, event = buf.dispatch(**args)
        if async_finish:
            event.current_stream_wait()
        _check_recv(ck, recv_x, fp8, mine, "dispatch")
        ck.bits(handle[0], mine["rank_prefix"], "handle[0] rank_prefix_matrix")
        ck.bits(handle[3], mine["src_idx"], "handle[3] recv_src_idx")
        ck.eq(per_expert, mine["tokens_per_expert"], "num_recv_tokens_per_expert_list")
        if with_topk:
            ck.bits(r_idx, mine["topk_idx"], "recv_topk_idx")
            ck.bits(r_w, mine["topk_weights"] if weights else None, "recv_topk_weights")
        else:
            ck.true(r_idx is None and r_w is None, "recv_topk_idx/weights without topk_idx")

        # Cached dispatch: new tokens along the same routing.
        want2, st2 = ref.dispatch(x2s, idxs, None, E, alignment, scs)
        c_x, c_idx, c_w, c_list, c_handle, ev = buf.dispatch(_x_arg(x2s, scs, me, dev),
                                                             handle=handle, **flags)
        if async_finish:
            ev.current_stream_wait()
        _check_recv(ck, c_x, fp8, want2[me], "cached dispatch")
        ck.true(c_idx is None and c_w is None and c_list is None and c_handle is None,
                "a cached dispatch returns None for topk, list and handle")
        ref.free_dispatch(st2)

        # Worst case: fixed rows, padding -1 / 0.
        if with_topk:
            W = sum(sizes)
            w_x, w_idx, w_w, w_list, w_handle, ev = buf.dispatch(**dict(args, num_worst_tokens=W))
            if async_finish:
                ev.current_stream_wait()
            nr = mine["nr"]
            ck.eq(w_list, [], "worst-case num_recv_tokens_per_expert_list")
            wx = w_x[0] if fp8 else w_x
            ck.eq(wx.size(0), W, "worst-case rows")
            _check_recv(ck, (w_x[0][:nr], w_x[1][:nr]) if fp8 else w_x[:nr], fp8, mine,
                        "worst-case dispatch")
            ck.bits(w_idx[:nr], mine["topk_idx"], "worst-case recv_topk_idx")
            ck.true(bool((w_idx[nr:] == -1).all()), "worst-case padding topk_idx is -1")
            ck.true(bool((w_handle[3][nr:] == -1).all()), "worst-case padding src_idx is -1")
            if weights:
                ck.true(bool((w_w[nr:] == 0).all()), "worst-case padding weights are 0")

        # Combine the received rows' expert outputs, with the dispatch's weights and biases.
        nrs = [w_["nr"] for w_ in want]
        ys, b0, b1 = _combine_inputs(seed, R, nrs, H, bias, sizes)
        cw = [w_["topk_weights"] for w_ in want] if (weights and with_topk) else None
        out_want, outw_want = ref.combine(st, H, topk if with_topk else R, ys, cw, b0, b1)
        bias_arg = None if not bias else (b0[me].to(dev) if bias == 1 else
                                          (b0[me].to(dev), b1[me].to(dev)))
        out, out_w, ev = buf.combine(ys[me].to(dev), handle, topk_weights=_dev(r_w, dev),
                                     bias=bias_arg, config=deep_ep.Buffer.get_combine_config(R),
                                     **flags)
        if async_finish:
            ev.current_stream_wait()
        ck.bits(out, out_want[me], "combined_x")
        ck.bits(out_w, outw_want[me] if cw else None, "combined_topk_weights")
        if with_topk and bias == 0:  # a worst-case handle combines the same
            yw = torch.cat([ys[me], torch.zeros((sum(sizes) - nrs[me], H), dtype=BF16)])
            out3, _, _ = buf.combine(yw.to(dev), w_handle)
            ck.bits(out3, out_want[me], "combined_x after a worst-case dispatch")
        ref.free_dispatch(st)
    finally:
        buf.destroy()
    ck.done()
    return mine["nr"]


def _check_recv(ck, recv_x, fp8, want, what):
    if fp8:
        ck.true(isinstance(recv_x, tuple) and recv_x[0].dtype == FP8 and recv_x[1].dtype == F32,
                f"{what}: recv_x is (fp8, float32 scales)")
        ck.bits(recv_x[0], want["x"], f"{what}: recv_x (fp8)")
        ck.bits(recv_x[1], want["scales"], f"{what}: recv_x_scales")
    else:
        ck.true(recv_x.dtype == BF16, f"{what}: recv_x dtype {recv_x.dtype}")
        ck.bits(recv_x, want["x"], f"{what}: recv_x (bf16)")


def layout(ctx, seed, n, E, topk):
    R, me = ctx.nranks, ctx.rank
    idx = routing(gen(seed, me), n, E, topk)
    ck = Check(me, "layout")
    with epcomm.Buffer(ctx.pg, device=ctx.device) as buf:
        tpr, rdma, tpe, itr, ev = buf.get_dispatch_layout(idx.to(ctx.device), E)
    wtpr, wtpe, witr = ref.layout(idx, E, R)
    ck.true(rdma is None and isinstance(ev, deep_ep.EventOverlap), "layout's 2nd and 5th values")
    ck.true(tpr.dtype == I32 and tpe.dtype == I32 and itr.dtype == torch.bool, "layout dtypes")
    ck.bits(tpr, wtpr, "num_tokens_per_rank")
    ck.bits(tpe, wtpe, "num_tokens_per_expert")
    ck.bits(itr, witr, "is_token_in_rank")
    ck.done()


def dispatch_odd_sizes(ctx, seed, H, E, topk):
    """A rank with no tokens, tokens going nowhere, hidden not a multiple of 128."""
    sizes = [0 if r == 1 else 5 + 3 * r for r in range(ctx.nranks)]
    return dispatch_combine(ctx, seed, sizes, H, E, topk, bias=1)


def cached_other_format(ctx, seed, sizes, H, E, topk):
    """DeepEP resends a bf16 dispatch's layout with fp8 tokens (its tuning loop does): the rows
    are those of the same routing in the new format."""
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    xs, _, idxs, ws, _ = _world(R, seed, sizes, H, E, topk, False)
    x8s, scs, _, _, _ = _world(R, seed + 1, sizes, H, E, topk, True)
    want, st = ref.dispatch(x8s, idxs, None, E, 1, scs)
    ck = Check(me, "cached dispatch in another format")
    with deep_ep.Buffer(ctx.pg, device=dev) as buf:
        _, _, _, _, handle, _ = buf.dispatch(xs[me].to(dev), topk_idx=idxs[me].to(dev),
                                             topk_weights=ws[me].to(dev), num_experts=E)
        recv, *_ = buf.dispatch(_x_arg(x8s, scs, me, dev), handle=handle)
        _check_recv(ck, recv, True, want[me], "fp8 along a bf16 handle")
    ref.free_dispatch(st)
    ck.done()


def _routing_args(buf, idxs, ws, me, E, dev):
    """Rank me's routing as DeepEP passes it to a dispatch: get_dispatch_layout's counts and
    mask, the topk ids and weights, on the device."""
    idx = idxs[me].to(dev)
    tpr, _, tpe, itr, _ = buf.get_dispatch_layout(idx, E)
    return dict(num_tokens_per_rank=tpr, is_token_in_rank=itr, num_tokens_per_expert=tpe,
                topk_idx=idx, topk_weights=ws[me].to(dev))


def combine_buffer(ctx, seed, sizes, H, E, topk, fp8):
    """Buffer.get_combine_buffer: the experts write there and the combine reads it where it is
    (CUDA); the same bits as the reference, after a bf16 or an fp8 dispatch, twice in a row (the
    buffer is asked for again after a combine)."""
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    xs, scs, idxs, ws, _ = _world(R, seed, sizes, H, E, topk, fp8)
    want, st = ref.dispatch(xs, idxs, ws, E, 1, scs)
    ck = Check(me, f"combine_buffer(fp8={fp8}, R={R})")
    buf = deep_ep.Buffer(ctx.pg, int(1e8), 0, explicitly_destroy=True, device=dev)
    try:
        _, _, r_w, _, handle, _ = buf.dispatch(_x_arg(xs, scs, me, dev),
                                               **_routing_args(buf, idxs, ws, me, E, dev))
        nrs = [w_["nr"] for w_ in want]
        for rnd in range(2):
            ys, b0, _ = _combine_inputs(seed + rnd, R, nrs, H, 1, sizes)
            out_want, outw_want = ref.combine(st, H, topk, ys, [w_["topk_weights"] for w_ in want],
                                              b0, None)
            y = buf.get_combine_buffer(handle)
            on_dev = y.device.type == torch.device(dev).type
            ck.true(y.dtype == BF16 and tuple(y.shape) == (nrs[me], H) and on_dev,
                    f"the combine buffer is bf16 [{nrs[me]}][{H}] on {dev}: {y.dtype} "
                    f"{tuple(y.shape)} {y.device}")
            y.copy_(ys[me].to(dev))  # the experts' write
            c0 = buf.in_place_counts()[0]
            out, out_w, _ = buf.combine(y, handle, topk_weights=r_w, bias=b0[me].to(dev))
            _check_in_place(ck, buf, c0, dev, f"the combine buffer, round {rnd}")
            ck.bits(out, out_want[me], f"combined_x from the combine buffer, round {rnd}")
            ck.bits(out_w, outw_want[me], f"combined_topk_weights from the combine buffer, "
                                          f"round {rnd}")
    finally:
        buf.destroy()
    ref.free_dispatch(st)
    ck.done()


def _check_in_place(ck, buf, before, dev, what):
    """CUDA: the combine just made read x where it lies (one more combine in place); cpu: the
    counter stays 0 (that backend has no staging pass to avoid)."""
    now = buf.in_place_counts()[0]
    want = before + 1 if torch.device(dev).type == "cuda" else 0
    ck.true(now == want, f"combines in place after the combine from {what}: {now}, want {want}")


def mem_pool_combine(ctx, seed, sizes, H, E, topk):
    """Buffer.mem_pool: expert outputs made under torch.cuda.use_mem_pool lie in the registered
    arena and the combine reads them in place (in_place_counts), with the reference's bits, two
    rounds of fresh tensors; a worst-case dispatch under the pool has its recv_x written in place
    by the senders; a tensor of the pool stays valid after the buffer is destroyed. On
    the cpu backend: UnsupportedError, on every rank, nothing collective started."""
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    xs, _, idxs, ws, _ = _world(R, seed, sizes, H, E, topk, False)
    want, st = ref.dispatch(xs, idxs, ws, E, 1, None)
    ck = Check(me, f"mem_pool_combine(R={R})")
    buf = deep_ep.Buffer(ctx.pg, int(1e8), 0, explicitly_destroy=True, device=dev)
    for bad in (0, -1, 1.5):  # checked before anything else, on every backend
        try:
            buf.mem_pool(bad)
            ck.true(False, f"mem_pool({bad!r}) raises InvalidArgumentError")
        except epcomm.InvalidArgumentError as e:
            ck.true("nbytes" in str(e), f"the error names nbytes: {e}")
    if torch.device(dev).type != "cuda":
        try:
            buf.mem_pool(1 << 20)
            ck.true(False, "mem_pool on a cpu buffer raises UnsupportedError")
        except epcomm.UnsupportedError as e:
            ck.true("CUDA buffers" in str(e), f"the error says why: {e}")
        buf.destroy()
        ref.free_dispatch(st)
        ck.done()
        return
    kept = None
    try:
        routing = _routing_args(buf, idxs, ws, me, E, dev)
        _, _, r_w, _, handle, _ = buf.dispatch(xs[me].to(dev), **routing)
        nrs = [w_["nr"] for w_ in want]
        mp = buf.mem_pool(8 << 20)
        ck.true(mp.registration.active, "the pool's arena is registered")
        # A worst-case dispatch whose outputs come from the pool: the senders write recv_x in
        # place (its rows are known before the count exchange, and registered).
        W, x_dev, d0 = sum(sizes), xs[me].to(dev), buf.in_place_counts()[1]
        with torch.cuda.use_mem_pool(mp.pool):
            w_x, w_idx, _, _, _, _ = buf.dispatch(x_dev, num_worst_tokens=W, **routing)
        ck.true(mp.contains(w_x), "the worst-case recv_x lies in the arena")
        d1 = buf.in_place_counts()[1]
        ck.true(d1 == d0 + 1, f"dispatches in place after the pool's dispatch: {d1}, want {d0 + 1}")
        ck.bits(w_x[:nrs[me]], want[me]["x"], "recv_x written in place by the senders")
        ck.bits(w_idx[:nrs[me]], want[me]["topk_idx"], "recv_topk_idx of that dispatch")
        for rnd in range(2):
            ys, b0, _ = _combine_inputs(seed + rnd, R, nrs, H, 1, sizes)
            out_want, outw_want = ref.combine(st, H, topk, ys, [w_["topk_weights"] for w_ in want],
                                              b0, None)
            with torch.cuda.use_mem_pool(mp.pool):
                y = ys[me].to(dev) * 1  # the experts' output: a fresh tensor of the pool
            if nrs[me] > 0:
                ck.true(mp.contains(y), f"round {rnd}: the experts' output lies in the arena")
                c0 = buf.in_place_counts()[0]
            out, out_w, _ = buf.combine(y, handle, topk_weights=r_w, bias=b0[me].to(dev))
            if nrs[me] > 0:
                _check_in_place(ck, buf, c0, dev, f"a tensor of the pool, round {rnd}")
            ck.bits(out, out_want[me], f"combined_x from a tensor of the pool, round {rnd}")
            ck.bits(out_w, outw_want[me], f"combined_topk_weights, round {rnd}")
            kept = (y, ys[me])
    finally:
        buf.destroy()
    ck.true(not mp.registration.active, "the arena's registration went with the buffer")
    torch.cuda.synchronize()
    ck.bits(kept[0].cpu(), kept[1], "a tensor of the pool after the buffer's destroy")
    ref.free_dispatch(st)
    ck.done()


def out_pool_dispatch(ctx, seed, sizes, H, E, topk, fp8):
    """Buffer(out_pool_bytes): a dispatch's default recv_x comes from the Buffer's registered
    arena and the senders write its rows there (CUDA: the data kernel's late hello, counted by
    in_place_counts), a cached dispatch's too; a combine of that recv_x reads it in place; every
    output with the reference's bits. A pool too small for a recv_x gives a plain tensor with
    the same bits; a bad out_pool_bytes is refused before anything collective."""
    from epcomm._mempool import OutPool
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    cuda = torch.device(dev).type == "cuda"
    xs, scs, idxs, ws, x2s = _world(R, seed, sizes, H, E, topk, fp8)
    want, st = ref.dispatch(xs, idxs, ws, E, 1, scs)
    want2, st2 = ref.dispatch(x2s, idxs, ws, E, 1, scs)
    ck = Check(me, f"out_pool_dispatch(fp8={fp8}, R={R})")
    for bad in (-1, 1.5, True):
        try:
            deep_ep.Buffer(ctx.pg, int(1e8), 0, device=dev, out_pool_bytes=bad).destroy()
            ck.true(False, f"out_pool_bytes={bad!r} raises InvalidArgumentError")
        except epcomm.InvalidArgumentError as e:
            ck.true("out_pool_bytes" in str(e), f"the error names out_pool_bytes: {e}")
    # The default (None): a pool of num_nvl_bytes / 2 on CUDA, none on CPU; 0: none anywhere.
    # (Memory IPC cannot export, PyTorch's expandable segments, has none: every rank alike.)
    exportable = ipc_exportable()
    for kw, want_pool in (({}, cuda and exportable), ({"out_pool_bytes": 0}, False)):
        b = deep_ep.Buffer(ctx.pg, int(1e8), 0, explicitly_destroy=True, device=dev, **kw)
        try:
            p, size = b._out_pool, b.out_pool_bytes
            ck.true((p is not None) == want_pool, f"Buffer({kw}): a pool: {p}")
            ck.true((size > 0) == want_pool, f"Buffer({kw}).out_pool_bytes: {size}")
            if p is not None:
                ck.true(int(5e7) <= size < int(5e7) + 512, f"the default pool's size: {size}")
        finally:
            b.destroy()
    saved, OutPool.MIN_BYTES = OutPool.MIN_BYTES, 0  # this test's rows are small
    late = os.environ.get("EP_CUDA_LATE_HELLO")
    os.environ["EP_CUDA_LATE_HELLO"] = "1"  # read at the buffer's creation
    nr = [w_["nr"] for w_ in want][me]
    try:
        for pool_bytes, pooled in ((64 << 20, cuda and exportable), (1 << 20, False)):
            what = f"out_pool_bytes={pool_bytes}"
            buf = deep_ep.Buffer(ctx.pg, int(1e8), 0, explicitly_destroy=True, device=dev,
                                 out_pool_bytes=pool_bytes)
            try:
                pool = buf._out_pool
                ck.true((pool is not None) == (cuda and exportable),
                        f"{what}: a pool on CUDA only: {pool}")
                d0 = buf.in_place_counts()[1]
                x, r_idx, r_w, _, handle, _ = buf.dispatch(
                    _x_arg(xs, scs, me, dev), **_routing_args(buf, idxs, ws, me, E, dev))
                rx = x[0] if fp8 else x
                inside = pool is not None and nr > 0 and pool.mem.contains(rx)
                ck.true(inside == (pooled and nr > 0), f"{what}: recv_x in the arena: {inside}")
                d1 = buf.in_place_counts()[1]
                ck.true(d1 == d0 + inside, f"{what}: dispatches in place {d0} -> {d1}")
                ck.bits(rx, want[me]["x"], f"{what}: recv_x")
                ck.bits(r_idx, want[me]["topk_idx"], f"{what}: recv_topk_idx")
                ck.bits(r_w, want[me]["topk_weights"], f"{what}: recv_topk_weights")
                if fp8:
                    ck.bits(x[1], want[me]["scales"], f"{what}: recv_x scales")
                x2, _, _, _, _, _ = buf.dispatch(_x_arg(x2s, scs, me, dev), handle=handle)
                rx2 = x2[0] if fp8 else x2
                in2 = pool is not None and nr > 0 and pool.mem.contains(rx2)
                ck.true(in2 == (pooled and nr > 0), f"{what}: cached recv_x in the arena: {in2}")
                ck.true(buf.in_place_counts()[1] == d1 + in2, f"{what}: cached in place")
                ck.bits(rx2, want2[me]["x"], f"{what}: cached recv_x")
                if not fp8:  # the combine of recv_x itself, as DeepEP's test does
                    ys = [w_["x"] for w_ in want]
                    out_want, outw_want = ref.combine(st, H, topk, ys,
                                                      [w_["topk_weights"] for w_ in want],
                                                      None, None)
                    c0 = buf.in_place_counts()[0]
                    out, out_w, _ = buf.combine(rx, handle, topk_weights=r_w)
                    if inside:
                        _check_in_place(ck, buf, c0, dev, f"{what}: recv_x of the pool")
                    ck.bits(out, out_want[me], f"{what}: combined_x of recv_x")
                    ck.bits(out_w, outw_want[me], f"{what}: combined_topk_weights")
                del x, rx, x2, rx2  # the arena goes once its tensors are gone (reused worker)
            finally:
                buf.destroy()
            if cuda:
                torch.cuda.empty_cache()
    finally:
        OutPool.MIN_BYTES = saved
        if late is None:
            os.environ.pop("EP_CUDA_LATE_HELLO")
        else:
            os.environ["EP_CUDA_LATE_HELLO"] = late
    ref.free_dispatch(st)
    ref.free_dispatch(st2)
    ck.done()


def registered_combine(ctx, seed, sizes, H, E, topk):
    """Buffer.register: a combine whose x is a slice of a registered tensor gives the same bits
    as the reference; the registration as a context manager, its end, and its going with the
    buffer."""
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    xs, _, idxs, ws, _ = _world(R, seed, sizes, H, E, topk, False)
    want, st = ref.dispatch(xs, idxs, ws, E, 1, None)
    ck = Check(me, f"registered_combine(R={R})")
    buf = deep_ep.Buffer(ctx.pg, int(1e8), 0, explicitly_destroy=True, device=dev)
    reg2 = None
    try:
        routing = _routing_args(buf, idxs, ws, me, E, dev)
        _, _, r_w, _, handle, _ = buf.dispatch(xs[me].to(dev), **routing)
        nrs = [w_["nr"] for w_ in want]
        ys, b0, _ = _combine_inputs(seed, R, nrs, H, 1, sizes)
        out_want, outw_want = ref.combine(st, H, topk, ys, [w_["topk_weights"] for w_ in want],
                                          b0, None)
        big = torch.zeros((sum(sizes) + 8, H), dtype=BF16, device=dev)
        x = big[8:8 + nrs[me]]
        with buf.register(big) as reg:
            ck.true(reg.active, "a registration is active")
            x.copy_(ys[me].to(dev))
            c0 = buf.in_place_counts()[0]
            out, out_w, _ = buf.combine(x, handle, topk_weights=r_w, bias=b0[me].to(dev))
            if nrs[me] > 0:
                _check_in_place(ck, buf, c0, dev, "a registered tensor")
            ck.bits(out, out_want[me], "combined_x from a registered tensor")
            ck.bits(out_w, outw_want[me], "combined_topk_weights from a registered tensor")
        ck.true(not reg.active, "the registration ended with its block")
        out, _, _ = buf.combine(x, handle, topk_weights=r_w, bias=b0[me].to(dev))
        ck.bits(out, out_want[me], "combined_x after the deregistration (staging path)")
        reg2 = buf.register(big)
    finally:
        buf.destroy()
    ck.true(reg2 is not None and not reg2.active, "a registration goes with its buffer")
    ref.free_dispatch(st)
    ck.done()


def spares_steps(ctx, seed, sizes, H, E, topk, steps=3, default_device=False):
    """Layer steps (layout, dispatch, combine) whose dispatch waits for its count (CUDA: the
    stream held by a sleep first, so that the host does wait): the outputs the Buffer made
    meanwhile (_spares: the combine's output, the next layout's and rank prefix) are taken by
    the calls they were made for, on the stream they were made on, and every result keeps the
    reference's bits; a combine on another stream, a layout of another size, and spares turned
    off (``_spares.enabled = False``) take none. CPU has no spares. default_device: the Buffer
    made and used under ``with torch.device(dev)``, as DeepEP's test_intranode.py runs
    (torch.set_default_device): what the package allocates for itself must still name its
    device (a page-locked count buffer on the GPU failed there)."""
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    xs, _, idxs, ws, _ = _world(R, seed, sizes, H, E, topk, False)
    want, st = ref.dispatch(xs, idxs, ws, E, 1, None)
    try:
        nrs = [w_["nr"] for w_ in want]
        ys, _, _ = _combine_inputs(seed, R, nrs, H, 0, sizes)
        out_want, _ = ref.combine(st, H, topk, ys, [w_["topk_weights"] for w_ in want], None,
                                  None)
        lay = ref.layout(idxs[me], E, R)  # host tensors for the C reference: outside the scope
        ck = Check(me, f"spares_steps(R={R}, default_device={default_device})")
        with torch.device(dev) if default_device else contextlib.nullcontext():
            _spares_scenario(ck, ctx, E, xs, idxs, ws, ys, want, out_want, lay, steps)
    finally:
        ref.free_dispatch(st)
    ck.done()


def _spares_scenario(ck, ctx, E, xs, idxs, ws, ys, want, out_want, lay, steps):
    me, dev = ctx.rank, ctx.device
    cuda = torch.device(dev).type == "cuda"
    buf = deep_ep.Buffer(ctx.pg, int(1e8), 0, explicitly_destroy=True, device=dev)
    # On the device before the sleeps: a copy from host memory would wait for them.
    x, idx, w, y = xs[me].to(dev), idxs[me].to(dev), ws[me].to(dev), ys[me].to(dev)

    def step(what, other_stream=False):
        if cuda:
            torch.cuda._sleep(20_000_000)  # ~10 ms: the count comes after the host waits
        tpr, _, tpe, itr, _ = buf.get_dispatch_layout(idx, E)
        recv_x, r_idx, r_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=tpr, is_token_in_rank=itr,
            num_tokens_per_expert=tpe, topk_idx=idx, topk_weights=w)
        ck.bits(recv_x, want[me]["x"], f"{what}: recv_x")
        ck.bits(r_idx, want[me]["topk_idx"], f"{what}: recv_topk_idx")
        ck.bits(r_w, want[me]["topk_weights"], f"{what}: recv_topk_weights")
        ck.bits(handle[0], want[me]["rank_prefix"], f"{what}: rank_prefix")
        ck.bits(tpr, lay[0], f"{what}: num_tokens_per_rank")
        ck.bits(tpe, lay[1], f"{what}: num_tokens_per_expert")
        ck.bits(itr, lay[2], f"{what}: is_token_in_rank")
        spare = handle._ep.spare
        if other_stream:
            s2 = torch.cuda.Stream(dev)
            s2.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s2):
                out, _, _ = buf.combine(y, handle)
            torch.cuda.current_stream(dev).wait_stream(s2)
        else:
            out, _, _ = buf.combine(y, handle)
        ck.bits(out, out_want[me], f"{what}: combined_x")
        return spare, out

    try:
        if not cuda:
            ck.true(buf._spares is None, "no spares on CPU")
            step("cpu")
        else:
            sp = buf._spares
            spare, out = step("first step")
            ck.true(spare is not None, "the dispatch made its combine's output while it waited")
            ck.true(spare is not None and out.data_ptr() == spare[1].data_ptr(),
                    "the combine took it")
            for i in range(1, steps):
                u0 = sp.used
                step(f"step {i + 1}")
                ck.eq(sp.used - u0, 3, f"step {i + 1}: spares taken (layout, prefix, combine)")
            u0 = sp.used
            spare, out = step("combine on another stream", other_stream=True)
            ck.eq(sp.used - u0, 2, "a combine on another stream does not take the spare")
            ck.true(out.data_ptr() != spare[1].data_ptr(), "its output is its own")
            u0 = sp.used
            buf.get_dispatch_layout(idx[: max(idx.size(0) - 1, 0)], E)
            ck.eq(sp.used - u0, 0, "a layout of another size takes no spare")
            sp.enabled = False
            try:
                spare1, _ = step("spares off")  # may still take one made before
                u0 = sp.used
                spare2, _ = step("spares off, again")
                ck.true(spare1 is None and spare2 is None and sp.used == u0,
                        f"enabled = False: none made ({spare1}, {spare2}, "
                        f"{sp.used - u0} taken)")
            finally:
                sp.enabled = True
    finally:
        buf.destroy()
    ck.true(buf._spares is None, "destroy() drops the spares")
