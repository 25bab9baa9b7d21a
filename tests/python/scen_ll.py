"""Low-latency mode, as DeepEP's tests/test_low_latency.py exercises it (written afresh): the
four casts (bf16, fp8, fp8 with power-of-two scales, fp8 with UE8M0 exponent bytes), with and
without receive hooks, cumulative receive statistics, combine with weights and masked slots,
into a given `out`, a handle combined twice, zero copy; every output compared bit for bit with
the reference (tools/ref/ref.c)."""

import torch

import epcomm
import ref
from common import BF16, F32, FP8, I32, I64, Check, bf16, gen, routing
from epcomm import deep_ep


def _world(R, seed, sizes, H, E, topk):
    xs, idxs, ws = [], [], []
    for r in range(R):
        g = gen(seed, r)
        xs.append(bf16(g, sizes[r], H, scale=3.0))
        idxs.append(routing(g, sizes[r], E, topk, dup=0))
        ws.append(torch.rand((sizes[r], topk), generator=g))
    return xs, idxs, ws


def _expert_outputs(seed, R, L, T, H):
    return [bf16(gen(seed + 31, r), L, R * T, H) for r in range(R)]


def _check_dispatch(ck, recv_x, count, handle, want, fmt, H, what):
    """Rows past recv_count are unspecified: only rows 0..count[l] of each expert compare."""
    ck.bits(count, want["count"], f"{what}: recv_count")
    ck.bits(handle[1], want["layout_range"], f"{what}: handle[1] recv_layout_range")
    fp8 = fmt != "bf16"
    x = recv_x[0] if fp8 else recv_x
    ck.eq(x.dtype, FP8 if fp8 else BF16, f"{what}: recv_x dtype")
    for l, c in enumerate(want["count"].tolist()):
        ck.bits(handle[0][l, :c], want["src_info"][l, :c], f"{what}: recv_src_info[{l}]")
        ck.bits(x[l, :c], want["x"][l, :c], f"{what}: recv_x[{l}]")
        if fmt == "ue8m0":  # DeepEP's packing: 4 exponent bytes per int32 ([.., H/512])
            sc = recv_x[1]
            ck.eq(sc.dtype, I32 if H % 512 == 0 else torch.uint8, f"{what}: ue8m0 scales dtype")
            ck.bits(sc[l, :c], want["scales"][l, :c], f"{what}: ue8m0 exponent bytes[{l}]")
        elif fp8:
            ck.bits(recv_x[1][l, :c], want["scales"][l, :c], f"{what}: recv_x_scales[{l}]")


FMTS = {"bf16": (False, False, False), "fp8": (True, False, False),
        "fp8_round": (True, True, False), "ue8m0": (True, True, True)}


def unsupported_ok(fn):
    """A backend without low-latency mode (the CUDA backend of a build that has none) makes the
    scenario return why, on every rank alike; the test then skips."""
    def run(ctx, **kwargs):
        try:
            return fn(ctx, **kwargs)
        except epcomm.UnsupportedError as e:
            if "no low-latency mode" not in str(e):
                raise
            return f"unsupported: {e}"
    run.__name__ = fn.__name__
    return run


@unsupported_ok
def dispatch_combine(ctx, seed, sizes, T, H, E, topk, fmt="bf16", hook=False, rounds=2,
                     masked_combine=True, twice=True):
    """DeepEP's low-latency round: dispatch (stats, hook or event), check against the reference,
    combine (hook or event) into `out`, a second combine of the same handle."""
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    use_fp8, round_scale, use_ue8m0 = FMTS[fmt]
    L = E // R
    ck = Check(me, f"low-latency {fmt} hook={hook} R={R}")
    buf = deep_ep.Buffer(ctx.pg, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                         low_latency_mode=True, num_qps_per_rank=L, explicitly_destroy=True,
                         device=dev)
    try:
        for rnd in range(rounds):
            xs, idxs, ws = _world(R, seed + rnd, sizes, H, E, topk)
            want = ref.ll_dispatch(T, E, xs, idxs, use_fp8, round_scale, use_ue8m0)[me]
            stats = torch.zeros(L, dtype=I32, device=dev)
            recv_x, count, handle, event, hk = buf.low_latency_dispatch(
                xs[me].to(dev), idxs[me].to(dev), T, E, cumulative_local_expert_recv_stats=stats,
                use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                async_finish=not hook, return_recv_hook=hook)
            hk() if hook else event.current_stream_wait()
            what = f"round {rnd}"
            _check_dispatch(ck, recv_x, count, handle, want, fmt, H, what)
            ck.bits(stats, want["count"], f"{what}: cumulative_local_expert_recv_stats")
            ck.true(tuple(handle[2:]) == (T, H, E), f"{what}: handle[2:] is (T, hidden, experts)")

            ys = _expert_outputs(seed + rnd, R, L, T, H)
            cidx = [i.clone() for i in idxs]
            cws = [w.clone() for w in ws]
            if masked_combine:  # a combine may leave slots out (-1): for the reference, the
                for i, w in zip(cidx, cws):  # dispatch's routing with weight 0 (finite rows)
                    i[::3, 0] = -1
                    w[::3, 0] = 0.0
            out_want = ref.ll_combine(T, E, xs, idxs, cws, ys)[me]
            out = torch.empty((sizes[me], H), dtype=BF16, device=dev)
            combined, ev, chk = buf.low_latency_combine(ys[me].to(dev), cidx[me].to(dev),
                                                        ws[me].to(dev), handle, out=out,
                                                        async_finish=not hook,
                                                        return_recv_hook=hook)
            chk() if hook else ev.current_stream_wait()
            ck.true(combined is out, f"{what}: combine returns the given out")
            ck.bits(combined, out_want, f"{what}: combined_x")
            if twice:  # DeepEP's test combines one handle twice
                again, ev, chk = buf.low_latency_combine(ys[me].to(dev), cidx[me].to(dev),
                                                         ws[me].to(dev), handle,
                                                         return_recv_hook=hook)
                if hook:
                    chk()
                ck.bits(again, out_want, f"{what}: combined_x of a second combine")
    finally:
        buf.destroy()
    ck.done()


@unsupported_ok
def zero_copy(ctx, seed, sizes, T, H, E, topk, hook=False):
    """get_next_low_latency_combine_buffer + zero_copy=True, first on a fresh handle (the
    library's zero-copy area), then on a handle combined already (DeepEP's test order)."""
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    L = E // R
    ck = Check(me, f"zero-copy combine hook={hook}")
    buf = deep_ep.Buffer(ctx.pg, 0, 0, low_latency_mode=True, explicitly_destroy=True, device=dev)
    try:
        xs, idxs, ws = _world(R, seed, sizes, H, E, topk)
        ys = _expert_outputs(seed, R, L, T, H)
        out_want = ref.ll_combine(T, E, xs, idxs, ws, ys)[me]
        for order in ("zero-copy first", "zero-copy second"):
            _, _, handle, _, hk = buf.low_latency_dispatch(
                xs[me].to(dev), idxs[me].to(dev), T, E, use_fp8=False, return_recv_hook=hook)
            if hook:
                hk()
            if order == "zero-copy second":
                first, _, _ = buf.low_latency_combine(ys[me].to(dev), idxs[me].to(dev),
                                                      ws[me].to(dev), handle)
                ck.bits(first, out_want, f"{order}: the copying combine")
            zc = buf.get_next_low_latency_combine_buffer(handle)
            ck.true(tuple(zc.shape) == (L, R * T, H) and zc.dtype == BF16,
                    f"{order}: combine buffer shape {tuple(zc.shape)}")
            zc[:, :, :] = ys[me].to(dev)
            out, _, chk = buf.low_latency_combine(ys[me].to(dev), idxs[me].to(dev),
                                                  ws[me].to(dev), handle, zero_copy=True,
                                                  return_recv_hook=hook)
            if hook:
                chk()
            ck.bits(out, out_want, f"{order}: combined_x")
            del handle, zc
    finally:
        buf.destroy()
    ck.done()


@unsupported_ok
def busy(ctx, T, H, E, topk):
    """Two results alive: the third dispatch fails with BusyError on every rank (DeepEP would
    overwrite one); dropping a handle frees its slot."""
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    xs, idxs, _ = _world(R, 5, [T] * R, H, E, topk)
    x, idx = xs[me].to(dev), idxs[me].to(dev)
    with epcomm.Buffer(ctx.pg, device=dev, ll_max_tokens=T, ll_hidden=H, ll_num_experts=E) as buf:
        a = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        b = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        try:
            buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
            raise AssertionError("a third live result was not refused")
        except epcomm.BusyError as e:
            assert e.status == "EP_ERR_BUSY" and "destroy one" in str(e), str(e)
        del a
        c = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        del b, c
        # Hooks kept in variables (as loops keep them) hold no slot once called.
        w = torch.ones((T, topk), dtype=F32, device=dev)
        y = torch.zeros((E // R, R * T, H), dtype=BF16, device=dev)
        for _ in range(50):  # and a dropped combine output is not written after it is freed
            _, _, handle, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False,
                                                             return_recv_hook=True)
            hook()
            _, _, chook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
            chook()
            del handle


@unsupported_ok
def sizes_change(ctx, H, E, topk):
    """A call with other sizes makes a new low-latency buffer (collectively); not while results
    of the old one are alive."""
    R, me, dev = ctx.nranks, ctx.rank, ctx.device
    with epcomm.Buffer(ctx.pg, device=dev, low_latency_mode=True) as buf:
        for T in (4, 8):
            xs, idxs, _ = _world(R, T, [T] * R, H, E, topk)
            r = buf.low_latency_dispatch(xs[me].to(dev), idxs[me].to(dev), T, E, use_fp8=False)
            want = ref.ll_dispatch(T, E, xs, idxs)[me]
            assert torch.equal(r[1].cpu(), want["count"]), "recv_count after a size change"
            if T == 8:
                try:
                    buf.low_latency_dispatch(xs[me].to(dev), idxs[me].to(dev), 16, E,
                                             use_fp8=False)
                    raise AssertionError("sizes changed with a result alive")
                except epcomm.InvalidArgumentError as e:
                    assert "drop their handles" in str(e), str(e)
            del r
