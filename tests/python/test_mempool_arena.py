"""Buffer.mem_pool's arena (epcomm._mempool._Arena) alone, on any machine: the segments PyTorch
asks the pool for are cut first-fit from the registered arena, aligned, given back and merged;
the memory is held until the buffer is gone and every segment is back. (The pool end to end,
on the GPU: test_normal.py::test_mem_pool_combine.)"""

import threading

from epcomm import _mempool
from epcomm._mempool import _ALIGN, _Arena

BASE = 1 << 40


class _Mem:
    """Stands for the arena's uint8 tensor."""

    def __init__(self, n):
        self.n = n

    def data_ptr(self):
        return BASE

    def numel(self):
        return self.n


def test_first_fit_aligned_and_merged():
    a = _Arena(_Mem(64 * _ALIGN))
    p1 = a.alloc(1, 0, None)
    p2 = a.alloc(3 * _ALIGN - 7, 0, None)
    p3 = a.alloc(4 * _ALIGN, 0, None)
    # the head is never handed out: no segment shares the arena's own address
    assert (p1, p2, p3) == (BASE + _ALIGN, BASE + 2 * _ALIGN, BASE + 5 * _ALIGN)
    assert all(p % _ALIGN == 0 for p in (p1, p2, p3))
    a.release(p2, 0, 0, None)
    assert a.alloc(2 * _ALIGN, 0, None) == p2  # first fit: the hole p2 left
    a.release(p2, 0, 0, None)
    a.release(p1, 0, 0, None)
    a.release(p3, 0, 0, None)
    assert a.free == [(_ALIGN, 63 * _ALIGN)]  # every hole merged back into one
    assert a.used == {}


def test_full_arena_says_out_of_memory():
    a = _Arena(_Mem(9 * _ALIGN))
    assert a.alloc(8 * _ALIGN, 0, None) == BASE + _ALIGN
    assert a.alloc(1, 0, None) is None  # PyTorch turns it into an out-of-memory error
    a.release(BASE + 5 * _ALIGN, 0, 0, None)  # not a segment start: ignored
    assert a.used == {_ALIGN: 8 * _ALIGN}


def test_memory_held_until_closed_and_every_segment_back():
    mem = _Mem(16 * _ALIGN)
    a = _Arena(mem)
    p = a.alloc(_ALIGN, 0, None)
    a.close()
    assert a.tensor is mem  # a tensor of the pool is alive: its memory stays
    assert a.alloc(_ALIGN, 0, None) is None  # nothing new once the buffer is gone
    a.release(p, 0, 0, None)  # may run inside PyTorch's allocator: nothing is freed here
    assert a.tensor is None and _mempool._GRAVE[-1] is mem
    _mempool.collect()  # a safe point: now it goes
    assert mem not in _mempool._GRAVE


def test_segments_given_back_from_other_threads():
    a = _Arena(_Mem(1025 * _ALIGN))
    ptrs = [a.alloc(_ALIGN, 0, None) for _ in range(1024)]
    assert len(set(ptrs)) == 1024 and None not in ptrs
    ts = [threading.Thread(target=lambda s=s: [a.release(p, 0, 0, None) for p in ptrs[s::4]])
          for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert a.free == [(_ALIGN, 1024 * _ALIGN)] and a.used == {}


# ---- OutPool (Buffer's out_pool_bytes): when a recv_x may be made under the pool

MIB = 1 << 20


class _Pool:
    """Stands for the torch.cuda.MemPool: its snapshot (the segments of PyTorch's cache)."""

    def __init__(self, segments):
        self.segments = segments

    def snapshot(self, include_traces=True):
        return self.segments


class _MemPool:
    def __init__(self, arena_bytes, segments=()):
        self._arena = _Arena(_Mem(arena_bytes))
        self.pool = _Pool(list(segments))


def _seg(stream, blocks, kind="large"):
    return {"stream": stream, "segment_type": kind,
            "blocks": [{"state": st, "size": n} for st, n in blocks]}


def test_segment_bytes_follow_the_caching_allocator():
    assert _mempool._segment_bytes(MIB + 1) == 20 * MIB  # below 10 MiB: a 20 MiB segment
    assert _mempool._segment_bytes(10 * MIB - 512) == 20 * MIB
    assert _mempool._segment_bytes(10 * MIB) == 10 * MIB  # from 10 MiB: whole 2 MiB units
    assert _mempool._segment_bytes(11 * MIB + 1) == 12 * MIB


def test_out_pool_room(monkeypatch):
    monkeypatch.setattr(_mempool.torch.cuda, "current_stream",
                        lambda device=None: type("S", (), {"cuda_stream": 7})())
    # the arena has room for the segment PyTorch would ask for
    assert _mempool.OutPool(_MemPool(21 * MIB))._room(2 * MIB, "cuda:0")
    assert not _mempool.OutPool(_MemPool(20 * MIB))._room(2 * MIB, "cuda:0")  # + the head
    # no room: only a free large block of PyTorch's cache in the pool, on this stream, will do
    full = [_seg(7, [("active_allocated", 8 * MIB), ("inactive", 3 * MIB)])]
    assert _mempool.OutPool(_MemPool(4 * MIB, full))._room(3 * MIB, "cuda:0")
    assert not _mempool.OutPool(_MemPool(4 * MIB, full))._room(3 * MIB + 1, "cuda:0")
    other = [_seg(9, [("inactive", 8 * MIB)]), _seg(7, [("inactive", 8 * MIB)], "small"),
             _seg(7, [("active_pending_free", 8 * MIB)])]
    assert not _mempool.OutPool(_MemPool(4 * MIB, other))._room(2 * MIB, "cuda:0")


def test_out_pool_declines_small_rows_and_after_it_is_off():
    p = _mempool.OutPool(_MemPool(64 * MIB))
    assert p.empty((16, 1024), _mempool.torch.bfloat16, "cuda:0") is None  # 32 KiB: plain
    p.mem = None  # turned off (an out of memory in the pool)
    assert p.empty((4096, 7168), _mempool.torch.bfloat16, "cuda:0") is None
