"""The reference implementation of docs/SEMANTICS.md (tools/ref/ref.c, shipped in the package as
lib/libepcomm_ref.so), through ctypes: every rank computes all ranks' results at once from the
inputs of all ranks, and compares its own part with what epcomm delivered, bit for bit."""

import ctypes as C

import torch

import epcomm

_lib = C.CDLL(epcomm._paths.reference_library())
_P = C.c_void_p


class RankInput(C.Structure):
    _fields_ = [("n", C.c_int), ("x", _P), ("scales", _P), ("topk_idx", _P),
                ("topk_weights", _P)]


class Recv(C.Structure):
    _fields_ = [("nr", C.c_int), ("x", _P), ("scales", _P), ("topk_idx", _P),
                ("topk_weights", _P), ("src_idx", _P), ("src_rank", _P), ("rank_prefix", _P),
                ("tokens_per_expert", _P)]


class LLRecv(C.Structure):
    _fields_ = [("L", C.c_int), ("RT", C.c_int), ("H", C.c_int), ("fp8", C.c_int),
                ("ue8m0", C.c_int), ("x", _P), ("q", _P), ("scales", _P), ("ue8m0_exp", _P),
                ("count", _P), ("src_info", _P), ("layout_range", _P)]


_lib.ref_layout.argtypes = [_P, C.c_int, C.c_int, C.c_int, C.c_int, _P, _P, _P]
_lib.ref_dispatch.argtypes = [C.c_int, C.c_int, C.c_int, C.c_size_t, C.c_int, C.c_int, _P, _P]
_lib.ref_free_recv.argtypes = [_P]
_lib.ref_combine.argtypes = [C.c_int, C.c_int, C.c_int, _P, _P, _P, _P, _P, _P, _P, _P]
_lib.ref_ll_dispatch.argtypes = [C.c_int] * 5 + [_P, C.c_int, C.c_int, C.c_int, _P]
_lib.ref_ll_free.argtypes = [_P]
_lib.ref_ll_combine.argtypes = [C.c_int] * 5 + [_P, _P, C.c_int, _P]


def _p(t):
    return None if t is None else t.data_ptr()


def _copy(address, n, dtype, shape):
    """A tensor copied out of memory the reference malloc'd (freed right after)."""
    if not address or n == 0:
        return torch.zeros(shape, dtype=dtype)
    esize = torch.empty(0, dtype=dtype).element_size()
    raw = (C.c_uint8 * (n * esize)).from_address(address)
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)


def _inputs(xs, scales, idxs, weights):
    arr = (RankInput * len(xs))()
    for r in range(len(xs)):
        arr[r] = RankInput(idxs[r].size(0), _p(xs[r]), _p(scales[r] if scales else None),
                           _p(idxs[r]), _p(weights[r] if weights else None))
    return arr


def layout(topk_idx, E, R):
    n, topk = topk_idx.shape
    tpr, tpe = torch.zeros(R, dtype=torch.int32), torch.zeros(E, dtype=torch.int32)
    itr = torch.zeros((n, R), dtype=torch.uint8)
    assert _lib.ref_layout(_p(topk_idx), n, topk, E, R, _p(tpr), _p(tpe), _p(itr)) == 0
    return tpr, tpe, itr.bool()


def dispatch(xs, idxs, weights, E, alignment=1, scales=None):
    """Per rank: dict of x (bytes as uint8 [nr][row]), scales, topk_idx, topk_weights, src_idx,
    rank_prefix, tokens_per_expert. xs: per rank [n][H] (bf16 or fp8), scales: per rank
    contiguous float32 [n][S] or None."""
    R, topk = len(xs), idxs[0].size(1)
    row = xs[0].size(1) * xs[0].element_size()
    S = scales[0].size(1) if scales else 0
    ins = _inputs(xs, scales, idxs, weights)
    outs = (Recv * R)()
    assert _lib.ref_dispatch(R, E, topk, row, S, alignment, ins, outs) == 0
    res = []
    for r in range(R):
        o, nr = outs[r], outs[r].nr
        res.append({"nr": nr, "x": _copy(o.x, nr * row, torch.uint8, (nr, row)),
                    "scales": _copy(o.scales, nr * S, torch.float32, (nr, S)) if S else None,
                    "topk_idx": _copy(o.topk_idx, nr * topk, torch.int64, (nr, topk)),
                    "topk_weights": _copy(o.topk_weights, nr * topk, torch.float32, (nr, topk))
                    if weights else None,
                    "src_idx": _copy(o.src_idx, nr, torch.int32, (nr,)),
                    "rank_prefix": _copy(o.rank_prefix, R * R, torch.int32, (R, R)),
                    "tokens_per_expert": _copy(o.tokens_per_expert, E // R, torch.int32,
                                               (E // R,)).tolist()})
    return res, (ins, outs)


def free_dispatch(state):
    _, outs = state
    for r in range(len(outs)):
        _lib.ref_free_recv(C.byref(outs[r]))


def combine(state, H, topk, ys, ws=None, bias0=None, bias1=None):
    """Per source rank: (out bf16 [n][H], out_w float32 [n][topk] or None)."""
    ins, outs = state
    R = len(outs)
    arr = lambda ts: None if ts is None else (_P * R)(*[_p(t) for t in ts])  # noqa: E731
    out = [torch.zeros((ins[r].n, H), dtype=torch.bfloat16) for r in range(R)]
    out_w = [torch.zeros((ins[r].n, topk), dtype=torch.float32) for r in range(R)] if ws else None
    assert _lib.ref_combine(R, H, topk, ins, outs, arr(ys), arr(ws), arr(bias0), arr(bias1),
                            arr(out), arr(out_w)) == 0
    return out, out_w


def ll_dispatch(T, E, xs, idxs, use_fp8=False, round_scale=False, use_ue8m0=False):
    """Per rank: dict of x (bf16 or e4m3 bytes [L][RT][H]), scales (float32 or ue8m0 bytes
    [L][RT][H/128]), count, src_info, layout_range."""
    R, H, topk = len(xs), xs[0].size(1), idxs[0].size(1)
    ins = _inputs(xs, None, idxs, None)
    outs = (LLRecv * R)()
    assert _lib.ref_ll_dispatch(R, T, E, H, topk, ins, int(use_fp8), int(round_scale),
                                int(use_ue8m0), outs) == 0
    L, RT, NS = E // R, R * T, H // 128
    res = []
    for r in range(R):
        o = outs[r]
        d = {"count": _copy(o.count, L, torch.int32, (L,)),
             "src_info": _copy(o.src_info, L * RT, torch.int32, (L, RT)),
             "layout_range": _copy(o.layout_range, L * R, torch.int64, (L, R))}
        if use_fp8:
            d["x"] = _copy(o.q, L * RT * H, torch.uint8, (L, RT, H))
            d["scales"] = (_copy(o.ue8m0_exp, L * RT * NS, torch.uint8, (L, RT, NS)) if use_ue8m0
                           else _copy(o.scales, L * RT * NS, torch.float32, (L, RT, NS)))
        else:
            d["x"] = _copy(o.x, L * RT * H, torch.bfloat16, (L, RT, H))
        res.append(d)
        _lib.ref_ll_free(C.byref(outs[r]))
    return res


def ll_combine(T, E, xs, idxs, ws, ys):
    """Per rank: bf16 [n][H], DeepEP's fused multiply-add chain."""
    R, H, topk = len(xs), xs[0].size(1), idxs[0].size(1)
    ins = _inputs(xs, None, idxs, ws)
    out = [torch.zeros((idxs[r].size(0), H), dtype=torch.bfloat16) for r in range(R)]
    ys_arr = (_P * R)(*[_p(y) for y in ys])
    outs = (_P * R)(*[_p(o) for o in out])
    assert _lib.ref_ll_combine(R, T, E, H, topk, ins, ys_arr, 1, outs) == 0
    return out
