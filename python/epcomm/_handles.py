"""Handles as DeepEP returns them (tuples, indexed as DeepEP's are), each carrying in ``._ep``
what epcomm needs: the C handle and the call's facts. The C handle is destroyed when the tuple
is garbage-collected, because DeepEP programs never free handles: they drop them."""

from . import _C


class Ref:
    """Owns one C handle; frees it when collected (a local call, safe at any time)."""

    __slots__ = ("id", "ll", "owner")

    def __init__(self, hid, ll, owner):
        self.id, self.ll, self.owner = hid, ll, owner

    def free(self):
        hid, self.id = self.id, None
        if not hid:
            return
        if self.ll:
            self.owner._ll_free(hid)  # deferred while a call on the buffer is in flight
        else:
            _C.handle_destroy(hid)

    def __del__(self):
        try:
            self.free()
        except Exception:  # the buffer is gone: its handles went with it
            pass


class Info:
    """The epcomm side of a handle."""

    __slots__ = ("ref", "buffer", "num_tokens", "hidden", "topk", "num_recv_tokens", "capacity",
                 "weights", "state", "topk_idx", "combine_buffer", "dims", "spare",
                 "__weakref__")

    def __init__(self, ref, buffer, num_tokens=0, hidden=0, topk=0, num_recv_tokens=0,
                 capacity=0, weights=False, topk_idx=None, dims=None, state="received"):
        self.ref, self.buffer, self.num_tokens, self.hidden = ref, buffer, num_tokens, hidden
        self.topk, self.num_recv_tokens, self.capacity = topk, num_recv_tokens, capacity
        self.weights, self.topk_idx, self.dims, self.state = weights, topk_idx, dims, state
        self.combine_buffer = None
        self.spare = None  # (stream, combine output) made while the dispatch waited (_spares)


class DispatchHandle(tuple):
    """DeepEP's intranode handle: (rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head). epcomm fills
    [0] (int32 [R][R]: [i][j] = rows that ranks 0..i send to rank j), [3] (int32 [rows]: the
    row's token index in its source, -1 for worst-case padding) and [4] (the is_token_in_rank
    given to dispatch, else None); it has no channel matrices or send heads (None)."""

    def __new__(cls, rank_prefix, recv_src_idx, is_token_in_rank, info):
        self = super().__new__(cls, (rank_prefix, None, None, recv_src_idx, is_token_in_rank,
                                     None))
        self._ep = info
        return self


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle: (recv_src_info, recv_layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts); recv_src_info is int32 [L][R*T]
    (the row's token index in its source rank), recv_layout_range int64 [L][R]
    ((begin << 32) | count of the rows from each source rank)."""

    def __new__(cls, src_info, layout_range, T, H, E, info):
        self = super().__new__(cls, (src_info, layout_range, T, H, E))
        self._ep = info
        return self
