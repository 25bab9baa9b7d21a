"""Low-latency mode of epcomm.Buffer (DeepEP's low_latency_dispatch / low_latency_combine).

DeepEP gives the sizes (tokens per rank T, hidden H, experts E) with each call, epcomm needs
them when the buffer is made: the first low-latency call makes the low-latency buffer
(collective, as the call itself is), a call with other sizes makes a new one. Results live in
the buffer (zero copy) and are double-buffered: a low-latency handle keeps its result slot until
it is garbage-collected, and a third live handle makes the dispatch fail with BusyError instead
of overwriting a result (DeepEP overwrites).

A handle is combined once by the library. DeepEP programs may combine one handle twice (its
test does: once with a copy, once zero-copy); the second combine is then preceded by a fresh
low-latency dispatch of the same routing (the rows' order depends on the routing only, so the
expert outputs keep their places), which costs one more dispatch.
"""

import weakref

import torch

from . import _C
from ._errors import BusyError, DestroyedError, InvalidArgumentError, UnsupportedError
from ._handles import Info, LowLatencyHandle, Ref
from ._tensors import need_shape, need_tensor, over, ptr

_BF16, _FP8, _F32, _I32, _I64 = (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32,
                                 torch.int64)


class LowLatency:
    def __init__(self):
        self._ll_sizes = None            # (T, H, E, K) of self._llbuf
        self._ll_views = {}              # C view tuple -> tensors over the result slot
        self._ll_live = weakref.WeakSet()  # Infos of the low-latency handles alive
        self._ll_deferred = []           # C handles whose destroy met a call in flight
        self._ll_zeros = None            # bf16 [T][H]: the tokens of a routing-only dispatch

    # ---------------------------------------------------------------- the buffer
    def _ll_create(self, sizes):
        T, H, E, K = sizes
        bid = self._create(0, (T, H, E, K))
        q = _C.buffer_query(bid)
        if not q[1] & _C.CAP_LOW_LATENCY:  # the same on every rank: all destroy and raise alike
            _C.buffer_destroy(bid)
            raise UnsupportedError(f"Buffer: the {self.device.type} backend of this build of "
                                   f"epcomm has no low-latency mode")
        self._llbuf, self._ll_sizes = bid, tuple(q[9:13])
        self._ll_views = {}

    def _ll_buf(self, op, T, H, E, topk):
        if self._group is None:
            raise DestroyedError(f"{op}: the buffer was destroyed")
        if self._llbuf is not None:
            T0, H0, E0, K0 = self._ll_sizes
            if (T, H, E) == (T0, H0, E0) and topk <= K0:
                return self._llbuf
            if len(self._ll_live):
                raise InvalidArgumentError(
                    f"{op}: sizes (T={T}, hidden={H}, experts={E}, topk={topk}) differ from the "
                    f"low-latency buffer's (T={T0}, hidden={H0}, experts={E0}, topk<={K0}) while "
                    f"{len(self._ll_live)} of its results are alive: drop their handles first")
            old, self._llbuf = self._llbuf, None
            _C.buffer_destroy(old)
        self._ll_create((T, H, E, max(topk, 16)))
        return self._llbuf

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """DeepEP clears its low-latency buffer after normal-mode use; epcomm's modes never share
        memory, so this only makes the low-latency buffer for these sizes now (collective)."""
        self._ll_buf("Buffer.clean_low_latency_buffer", int(num_max_dispatch_tokens_per_rank),
                     int(hidden), int(num_experts), 1)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts):
        """Bytes of the buffer epcomm makes for these low-latency sizes (topk up to 16)."""
        return _C.buffer_size_hint(int(num_ranks), _C.BACKEND_AUTO, 0, 0,
                                   int(num_max_dispatch_tokens_per_rank), int(hidden),
                                   int(num_experts), 0, 0.0, -1, 0)

    def _ll_free(self, hid):
        try:
            _C.ll_handle_destroy(hid)
        except BusyError:  # a call on the buffer is in flight (another thread): after it
            self._ll_deferred.append(hid)

    def _ll_flush(self):
        while self._ll_deferred:
            _C.ll_handle_destroy(self._ll_deferred.pop())

    # ---------------------------------------------------------------- views
    def _ll_tensors(self, hid):
        """(recv_x or (recv_x, scales), recv_count, src_info, layout_range): tensors over the
        result slot; made once per slot and format, aliased for each call."""
        v = _C.ll_view(hid)
        made = self._ll_views.get(v)
        if made is None:
            made = self._ll_views[v] = self._ll_make_views(v)
        recv_x, scales, count, src, rng = (None if t is None else t[:] for t in made)
        return (recv_x if scales is None else (recv_x, scales)), count, src, rng

    def _ll_make_views(self, v):
        L, RT, H, NS, fp8, _, ue8m0, px, ps, pc, psrc, prange, layout = v
        dev, R = self.device, self.group_size
        rows = L * RT
        recv_x = over(px, rows * H * (1 if fp8 else 2), _FP8 if fp8 else _BF16, (L, RT, H), dev)
        scales = None
        if fp8:
            # DeepEP packs four exponent bytes in an int32 (hidden % 512 == 0); floats else.
            packed = ue8m0 and NS % 4 == 0
            dtype, cols = (_I32, NS // 4) if packed else (torch.uint8 if ue8m0 else _F32, NS)
            nbytes = rows * NS * (1 if ue8m0 else 4)
            if layout:  # column-major: memory [L][cols][RT], seen as DeepEP's [L][RT][cols]
                scales = over(ps, nbytes, dtype, (L, cols, RT), dev).transpose(1, 2)
            else:
                scales = over(ps, nbytes, dtype, (L, RT, cols), dev)
        count = over(pc, L * 4, _I32, (L,), dev)
        src = over(psrc, rows * 4, _I32, (L, RT), dev)
        rng = over(prange, L * R * 8, _I64, (L, R), dev)
        return recv_x, scales, count, src, rng

    # ---------------------------------------------------------------- dispatch
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False):
        """DeepEP's low_latency_dispatch: (recv_x bf16 [L][R*T][H], or (fp8 [L][R*T][H], scales
        float32 [L][R*T][H/128] | with use_ue8m0 int32 [L][R*T][H/512] of exponent bytes),
        recv_count int32 [L], handle, EventOverlap, hook or None). Rows of expert l are
        0..recv_count[l], by source rank then token (docs/SEMANTICS.md §6). Collective."""
        op = "Buffer.low_latency_dispatch"
        if dispatch_wait_recv_cost_stats is not None:
            raise UnsupportedError(f"{op}: dispatch_wait_recv_cost_stats is not supported")
        if async_finish and return_recv_hook:
            raise InvalidArgumentError(f"{op}: async_finish and return_recv_hook exclude each "
                                       f"other")
        need_tensor(x, op, "x", _BF16, 2, self.device)
        n, H = x.shape
        topk = self._topk(op, topk_idx, n)
        T, E = int(num_max_dispatch_tokens_per_rank), int(num_experts)
        buf = self._ll_buf(op, T, H, E, topk)
        L = E // self.group_size
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            need_tensor(stats, op, "cumulative_local_expert_recv_stats", _I32, 1, self.device)
            need_shape(stats, op, "cumulative_local_expert_recv_stats", (L,), "[local experts]")
        self._ll_flush()
        # DeepEP's fp8 scales are column-major ([L][R*T][..] views of [L][..][R*T] memory), what
        # grouped GEMMs read; packed UE8M0 needs H % 512 == 0, else one byte each, row-major.
        cols = _C.SCALES_COL_MAJOR if use_fp8 and (not use_ue8m0 or H % 512 == 0) else 0
        launch = self._launch(None, async_finish, False, on_compute=return_recv_hook)
        try:
            hid = _C.ll_dispatch(buf, ptr(x), n, ptr(topk_idx), topk, int(use_fp8),
                                 int(round_scale), int(use_ue8m0), int(return_recv_hook),
                                 launch.stream, cols)
        except BaseException:
            launch.abort()
            raise
        ref = Ref(hid, True, self)
        recv_x, count, src, rng = self._ll_tensors(hid)
        info = Info(ref, self, num_tokens=n, hidden=H, topk=topk, dims=(T, H, E, L),
                    topk_idx=topk_idx.clone())
        self._ll_live.add(info)
        handle = LowLatencyHandle(src, rng, T, H, E, info)
        hook = None
        if return_recv_hook:
            info.state = "sent"
            hook = self._ll_dispatch_hook(info, buf, count, stats, launch, (x, topk_idx))
        elif stats is not None:
            self._on_launch_stream(launch, lambda: stats.add_(count))
        tensors = (x, topk_idx, *(recv_x if isinstance(recv_x, tuple) else (recv_x,)), count, src,
                   rng, stats)
        return recv_x, count, handle, launch.finish(tensors, extra=True), hook

    def _on_launch_stream(self, launch, fn):
        """Runs fn ordered after the call: on its stream (CUDA), or now (CPU)."""
        if not self._cuda:
            return fn()
        with launch.ordered():
            return fn()

    def _ll_dispatch_hook(self, info, buf, count, stats, launch, keep):
        # The hook holds the handle until it is called, and no longer: a hook kept in a variable
        # must not keep a result slot. The receive runs where its dispatch ran (CUDA: on that
        # stream), and so does the update of the statistics.
        # `keep` (x, topk_idx): on CUDA the send reads them beside the caller's next kernels until
        # the receive (docs/LOW_LATENCY.md), so their memory must not be reused before.
        pending = [(info, keep)]

        def hook():
            if not pending:
                raise InvalidArgumentError("low_latency_dispatch hook: already called")
            held, _ = pending.pop()
            _C.ll_recv(buf, held.ref.id)
            held.state = "received"
            if stats is not None:
                self._on_launch_stream(launch, lambda: stats.add_(count))
        return hook

    # ---------------------------------------------------------------- combine
    def get_next_low_latency_combine_buffer(self, handle):
        """bf16 [L][R*T][H]: where the experts may write their outputs so that
        low_latency_combine(..., zero_copy=True) moves no copy of them. Local."""
        op = "Buffer.get_next_low_latency_combine_buffer"
        info = self._handle_info(handle, op, LowLatencyHandle)
        if info.combine_buffer is not None:
            return info.combine_buffer
        T, H, E, L = info.dims
        if info.state == "sent":
            raise InvalidArgumentError(f"{op}: the dispatch's receive hook has not been called")
        if info.state == "received":
            y = _C.ll_get_combine_buffer(self._llbuf, info.ref.id)
            t = over(y, L * self.group_size * T * H * 2, _BF16, (L, self.group_size * T, H),
                     self.device)
        else:  # combined already: its next combine is re-sent (module comment), from here
            t = self._empty((L, self.group_size * T, H), _BF16)
        info.combine_buffer = t
        return t

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None):
        """DeepEP's low_latency_combine: (combined_x bf16 [N][H], EventOverlap, hook or None).
        out[t] = sum over k of w[t][k] * y(t, k), one fused multiply-add per step, one rounding
        to bf16 (docs/SEMANTICS.md §6.5). A slot of topk_idx may be set to -1 to leave that
        expert out. Collective."""
        op = "Buffer.low_latency_combine"
        if use_logfmt:
            raise UnsupportedError(f"{op}: use_logfmt=True (LogFMT) is not supported")
        if combine_wait_recv_cost_stats is not None:
            raise UnsupportedError(f"{op}: combine_wait_recv_cost_stats is not supported")
        if async_finish and return_recv_hook:
            raise InvalidArgumentError(f"{op}: async_finish and return_recv_hook exclude each "
                                       f"other")
        info = self._handle_info(handle, op, LowLatencyHandle)
        y, out = self._ll_combine_args(op, info, x, topk_idx, topk_weights, zero_copy, out)
        buf = self._llbuf
        if buf is None:
            raise DestroyedError(f"{op}: the buffer was destroyed")
        self._ll_flush()
        launch = self._launch(None, async_finish, False, on_compute=return_recv_hook)
        target = info
        try:
            if info.state != "received":
                target = self._ll_routing_dispatch(op, buf, info, launch.stream)
            _C.ll_combine(buf, target.ref.id, ptr(y), ptr(topk_idx),
                          ptr(topk_weights), int(return_recv_hook), launch.stream,
                          ptr(out))
        except BaseException:
            launch.abort()
            if target is not info:
                target.ref.free()
            raise
        info.state = "combined"  # a next combine of this handle is re-sent
        hook = None
        if return_recv_hook:
            hook = self._ll_combine_hook(buf, target, target is not info,
                                         (out, x, y, topk_idx, topk_weights))
        elif target is not info:
            target.ref.free()
        tensors = (x, y, topk_idx, topk_weights, out)
        return out, launch.finish(tensors, extra=True), hook

    def _ll_combine_args(self, op, info, x, topk_idx, topk_weights, zero_copy, out):
        T, H, E, L = info.dims
        need_tensor(x, op, "x", _BF16, 3, self.device)
        need_shape(x, op, "x", (L, self.group_size * T, H), "[local experts][R*T][hidden]")
        need_tensor(topk_idx, op, "topk_idx", _I64, 2, self.device)
        need_shape(topk_idx, op, "topk_idx", (info.num_tokens, info.topk), "the dispatch's")
        need_tensor(topk_weights, op, "topk_weights", _F32, 2, self.device)
        need_shape(topk_weights, op, "topk_weights", (info.num_tokens, info.topk), "as topk_idx")
        if info.state == "sent":
            raise InvalidArgumentError(f"{op}: the dispatch's receive hook has not been called")
        if out is None:
            out = self._empty((info.num_tokens, H), _BF16)
        else:
            need_tensor(out, op, "out", _BF16, 2, self.device)
            need_shape(out, op, "out", (info.num_tokens, H), "[num_tokens][hidden]")
        y = x
        if zero_copy:
            if info.combine_buffer is None:
                raise InvalidArgumentError(f"{op}: zero_copy=True: write the expert outputs into "
                                           f"get_next_low_latency_combine_buffer(handle) first")
            y = info.combine_buffer
        return y, out

    def _ll_routing_dispatch(self, op, buf, info, stream):
        """A dispatch of the handle's routing (its topk_idx as dispatched), for a second
        combine of one handle: bf16 zeros, since only the rows' places matter."""
        T, H = info.dims[:2]
        if self._ll_zeros is None or tuple(self._ll_zeros.shape) != (T, H):
            self._ll_zeros = torch.zeros((T, H), dtype=_BF16, device=self.device)
        hid = _C.ll_dispatch(buf, ptr(self._ll_zeros), info.num_tokens,
                             ptr(info.topk_idx), info.topk, 0, 0, 0, 0, stream)
        return Info(Ref(hid, True, self), self, state="received")

    @staticmethod
    def _ll_combine_hook(buf, target, temporary, keep):
        # Held until the hook is called, as the dispatch hook does; `out` too: the receive
        # writes it, even when the caller dropped the tensor the combine returned; and the
        # send's inputs: on CUDA the send runs beside the caller's next kernels and reads them
        # until the receive (docs/LOW_LATENCY.md), so their memory must not be reused before.
        pending = [(target, keep)]

        def hook():
            if not pending:
                raise InvalidArgumentError("low_latency_combine hook: already called")
            held, _ = pending.pop()
            _C.ll_recv(buf, held.ref.id)
            if temporary:
                held.ref.free()
        return hook

    # ---------------------------------------------------------------- shrink (not supported)
    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        raise UnsupportedError("Buffer.low_latency_update_mask_buffer: masking ranks (shrink "
                               "mode) is not supported")

    def low_latency_query_mask_buffer(self, mask_status):
        raise UnsupportedError("Buffer.low_latency_query_mask_buffer: masking ranks (shrink "
                               "mode) is not supported")

    def low_latency_clean_mask_buffer(self):
        raise UnsupportedError("Buffer.low_latency_clean_mask_buffer: masking ranks (shrink "
                               "mode) is not supported")
