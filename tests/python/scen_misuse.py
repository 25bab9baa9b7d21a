"""Misuse: every bad argument raises an exception naming the call and the argument, before any
data moves, and the buffer stays usable. Checks made on one rank only raise before the
collective call; a bad argument found by the library fails the call on every rank (the others
get PeerInvalidError)."""

import torch

import epcomm
from common import BF16, F32, FP8, I32, I64, routing, gen
from epcomm import _C, deep_ep
from scen_ll import unsupported_ok


def _raises(cls, fn, *needles):
    try:
        fn()
    except cls as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"{cls.__name__} message lacks {n!r}: {msg}"
        return e
    except Exception as e:  # the wrong class is a failure too
        raise AssertionError(f"expected {cls.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {cls.__name__}, nothing raised")


def local_checks(ctx):
    """Wrong dtypes, shapes, devices, non-contiguous tensors, unsupported arguments."""
    dev, R = ctx.device, ctx.nranks
    E, n, H, k = 4 * R, 6, 128, 2
    with deep_ep.Buffer(ctx.pg, device=dev, explicitly_destroy=True) as buf:
        idx = routing(gen(1, ctx.rank), n, E, k).to(dev)
        x = torch.zeros((n, H), dtype=BF16, device=dev)
        d = buf.dispatch
        _raises(epcomm.ArgumentTypeError, lambda: buf.get_dispatch_layout(idx.int(), E),
                "get_dispatch_layout", "topk_idx", "torch.int32", "torch.int64")
        _raises(epcomm.ArgumentTypeError, lambda: d(x.float(), topk_idx=idx, num_experts=E),
                "Buffer.dispatch: x: dtype torch.float32")
        _raises(epcomm.ArgumentTypeError, lambda: d(x.to(FP8), topk_idx=idx, num_experts=E),
                "x", "scales")
        _raises(epcomm.ArgumentTypeError, lambda: d((x.to(FP8), torch.ones(n, 1, dtype=I32,
                                                                           device=dev)),
                                                    topk_idx=idx, num_experts=E), "scales")
        _raises(epcomm.ArgumentTypeError, lambda: d("tokens", topk_idx=idx, num_experts=E),
                "x: expected a torch.Tensor")
        _raises(epcomm.InvalidArgumentError, lambda: d(x[0], topk_idx=idx, num_experts=E),
                "x", "dimensions")
        _raises(epcomm.InvalidArgumentError,
                lambda: d(torch.zeros((H, n), dtype=BF16, device=dev).T, topk_idx=idx,
                          num_experts=E), "x", "not contiguous")
        _raises(epcomm.InvalidArgumentError, lambda: d(x, topk_idx=idx[:, ::2], num_experts=E),
                "topk_idx", "not contiguous")
        _raises(epcomm.InvalidArgumentError, lambda: d(x, topk_idx=idx[:3], num_experts=E),
                "topk_idx", "rows")
        _raises(epcomm.InvalidArgumentError,
                lambda: d(x, topk_idx=idx, topk_weights=torch.ones(n, k + 1, device=dev),
                          num_experts=E), "topk_weights", "shape")
        _raises(epcomm.InvalidArgumentError, lambda: d(x, topk_idx=idx), "num_experts")
        _raises(epcomm.InvalidArgumentError,
                lambda: d(x.to("meta"), topk_idx=idx, num_experts=E), "x", "meta")
        _raises(epcomm.InvalidArgumentError, lambda: d(x, is_token_in_rank=None), "topk_idx")
        _raises(epcomm.ArgumentTypeError, lambda: buf.combine(x, ("not", "a", "handle")),
                "Buffer.combine", "handle")
        # DeepEP arguments epcomm does not implement name themselves.
        _raises(epcomm.UnsupportedError, lambda: buf.low_latency_dispatch(
            x, idx, 8, E, dispatch_wait_recv_cost_stats=torch.zeros(R, R, dtype=I64)),
            "dispatch_wait_recv_cost_stats")
        _raises(epcomm.UnsupportedError, lambda: buf.low_latency_update_mask_buffer(1, True),
                "shrink")
        _raises(epcomm.UnsupportedError, lambda: buf.get_local_buffer_tensor(BF16), "raw buffer")
        _raises(epcomm.UnsupportedError, lambda: deep_ep.Buffer(ctx.pg, enable_shrink=True),
                "enable_shrink")
        # The binding's on_wait (the Buffer passes a callable or None): anything else is a
        # TypeError before the collective call, on every rank alike.
        _raises(TypeError, lambda: _C.dispatch(
            buf._normal, x.data_ptr(), _C.DTYPE_BF16, n, H, 0, 0, 0, 0, idx.data_ptr(), 0, k, E,
            1, 0, 0, _C.OUTPUT_ALLOC, 0, 0, lambda rows: (0, 0, 0, 0, 0), 0, 0, 0, 0, 0, 0, 0,
            "not callable"), "on_wait")
        # Still usable after all of that: a collective round.
        tpr, _, tpe, itr, _ = buf.get_dispatch_layout(idx, E)
        recv_x, *_ , handle, _ = buf.dispatch(x, topk_idx=idx, num_tokens_per_expert=tpe)
        out, _, _ = buf.combine(recv_x, handle)
        assert out.shape == (n, H)


@unsupported_ok
def ll_checks(ctx):
    dev, R = ctx.device, ctx.nranks
    T, H, E, k = 8, 256, 2 * R, 2
    with epcomm.Buffer(ctx.pg, device=dev, low_latency_mode=True) as buf:
        idx = routing(gen(2, ctx.rank), T, E, k, dup=0).to(dev)
        x = torch.zeros((T, H), dtype=BF16, device=dev)
        ld = buf.low_latency_dispatch
        _raises(epcomm.ArgumentTypeError, lambda: ld(x.half(), idx, T, E), "x", "float16")
        _raises(epcomm.InvalidArgumentError, lambda: ld(x, idx, T, E, async_finish=True,
                                                        return_recv_hook=True), "exclude")
        _raises(epcomm.InvalidArgumentError, lambda: ld(
            x, idx, T, E, cumulative_local_expert_recv_stats=torch.zeros(E, dtype=I32,
                                                                         device=dev)),
            "cumulative_local_expert_recv_stats", "shape")
        recv, count, handle, _, hook = ld(x, idx, T, E, use_fp8=False, return_recv_hook=True)
        w = torch.ones((T, k), dtype=F32, device=dev)
        y = torch.zeros((E // R, R * T, H), dtype=BF16, device=dev)
        _raises(epcomm.InvalidArgumentError, lambda: buf.low_latency_combine(y, idx, w, handle),
                "receive hook")
        hook()
        _raises(epcomm.InvalidArgumentError, hook, "already called")
        _raises(epcomm.UnsupportedError, lambda: buf.low_latency_combine(y, idx, w, handle,
                                                                         use_logfmt=True),
                "use_logfmt")
        _raises(epcomm.InvalidArgumentError, lambda: buf.low_latency_combine(y[:, :4], idx, w,
                                                                             handle), "x", "shape")
        _raises(epcomm.InvalidArgumentError,
                lambda: buf.low_latency_combine(y, idx, w, handle, zero_copy=True),
                "get_next_low_latency_combine_buffer")
        _raises(epcomm.InvalidArgumentError,
                lambda: buf.low_latency_combine(y, idx, w, handle, out=torch.empty(
                    (T, H + 8), dtype=BF16, device=dev)), "out", "shape")
        out, _, _ = buf.low_latency_combine(y, idx, w, handle)
        assert out.shape == (T, H)


def library_errors(ctx):
    """Errors found by the C library: the class of its status, its message (naming the entry),
    PeerInvalidError on the other ranks; the buffer stays usable."""
    dev, R, me = ctx.device, ctx.nranks, ctx.rank
    E, n, H, k = 2 * R, 4, 64, 2
    with epcomm.Buffer(ctx.pg, device=dev) as buf:
        idx = routing(gen(3, me), n, E, k).to(dev)
        x = torch.zeros((n, H), dtype=BF16, device=dev)
        bad = idx.clone()
        bad[2, 1] = E + 5
        if me == 0:
            e = _raises(epcomm.InvalidArgumentError,
                        lambda: buf.dispatch(x, topk_idx=bad, num_experts=E), "topk_idx[2][1]")
            assert e.status == "EP_ERR_OUT_OF_RANGE" and e.code == 3, (e.status, e.code)
        else:
            e = _raises(epcomm.PeerInvalidError,
                        lambda: buf.dispatch(x, topk_idx=idx, num_experts=E), "rank 0")
            assert e.status == "EP_ERR_PEER_INVALID"
        # Ranks that disagree on hidden: MismatchError on every rank, naming the field.
        xh = torch.zeros((n, H + 8 * me), dtype=BF16, device=dev)
        _raises(epcomm.MismatchError, lambda: buf.dispatch(xh, topk_idx=idx, num_experts=E),
                "hidden")
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
        out, _, _ = buf.combine(recv_x, handle)
        assert out.shape == (n, H) and isinstance(e, epcomm.EpcommError)
