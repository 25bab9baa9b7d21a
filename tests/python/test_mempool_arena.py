"""Buffer.mem_pool's arena (epcomm._mempool._Arena over python/csrc/arena.c) alone, on any
machine: the segments PyTorch asks the pool for are cut first-fit from the registered arena,
aligned, given back and merged, through the two C functions PyTorch is given (called here
through ctypes, as PyTorch calls them: no Python in between); the memory is held until the
buffer is gone and every segment is back; a slot serves a new arena only once the old one is
drained and its pool gone. (The pool end to end, on the GPU:
test_normal.py::test_mem_pool_combine.)"""

import contextlib
import os
import sys
import ctypes
import gc
import threading

import pytest

from epcomm import _C, _mempool
from epcomm._errors import (CudaError, InvalidArgumentError, OutOfMemoryError, PeerFailedError,
                            PeerInvalidError, UnsupportedError)
from epcomm._mempool import _ALIGN, _Arena

BASE = 1 << 40
SLOTS = 64  # arena.c's EPB_ARENA_SLOTS
_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


class _Mem:
    """Stands for the arena's uint8 tensor (the C arena only does address arithmetic)."""

    def __init__(self, n, base=BASE):
        self.n, self.base = n, base

    def data_ptr(self):
        return self.base

    def numel(self):
        return self.n


class _Torch:
    """What PyTorch holds of a pool's allocator: the two C functions."""

    def __init__(self, arena):
        self.alloc_fn, self.free_fn = _ALLOC(arena.alloc_fn), _FREE(arena.free_fn)

    def alloc(self, n):
        return self.alloc_fn(n, 0, None)

    def free(self, p):
        self.free_fn(p, 0, 0, None)


@pytest.fixture
def arenas():
    """Opens arenas; every one is closed with its pool gone at the end (slots are per process)."""
    made = []

    def make(n, base=BASE):
        a = _Arena(_Mem(n, base))
        made.append(a)
        return a

    yield make
    for a in made:  # as PyTorch at the end: every segment back, the pool gone
        st = a.state()
        for off, _ in st[1] if st else ():
            _Torch(a).free(a.base + off)
        a.close(pool_gone=True)
    _mempool.collect()


def _free_spans(a):
    return [tuple(x) for x in a.state()[0]]


def test_first_fit_aligned_and_merged(arenas):
    a = arenas(64 * _ALIGN)
    t = _Torch(a)
    assert a.largest_free() == 63 * _ALIGN  # all but the head
    p1 = t.alloc(1)
    p2 = t.alloc(3 * _ALIGN - 7)
    p3 = t.alloc(4 * _ALIGN)
    # the head is never handed out: no segment shares the arena's own address
    assert (p1, p2, p3) == (BASE + _ALIGN, BASE + 2 * _ALIGN, BASE + 5 * _ALIGN)
    assert all(p % _ALIGN == 0 for p in (p1, p2, p3))
    t.free(p2)
    assert t.alloc(2 * _ALIGN) == p2  # first fit: the hole p2 left
    t.free(p2)
    t.free(p1)
    t.free(p3)
    assert _free_spans(a) == [(_ALIGN, 63 * _ALIGN)]  # every hole merged back into one
    assert a.state()[1] == []
    assert t.alloc(0) == BASE + _ALIGN and t.alloc(1) == BASE + 2 * _ALIGN  # 0 bytes: a block


def test_full_arena_says_out_of_memory(arenas):
    a = arenas(9 * _ALIGN)
    t = _Torch(a)
    assert t.alloc(8 * _ALIGN) == BASE + _ALIGN
    assert t.alloc(1) is None  # PyTorch turns it into an out-of-memory error
    t.free(BASE + 5 * _ALIGN)  # not a segment start: ignored
    assert [tuple(x) for x in a.state()[1]] == [(_ALIGN, 8 * _ALIGN)]
    assert a.largest_free() == 0
    assert t.alloc(2**64 - 1) is None  # rounding up must not wrap to a 0-byte segment
    t.free(BASE + _ALIGN)
    t.free(BASE + _ALIGN)  # twice: the second is ignored
    assert _free_spans(a) == [(_ALIGN, 8 * _ALIGN)] and a.largest_free() == 8 * _ALIGN


def test_memory_held_until_closed_and_every_segment_back(arenas):
    a = arenas(16 * _ALIGN)
    mem, t = a.tensor, _Torch(a)
    p = t.alloc(_ALIGN)
    a.close()
    _mempool.collect()
    assert a.tensor is mem  # a tensor of the pool is alive: its memory stays
    assert t.alloc(_ALIGN) is None  # nothing new once the buffer is gone
    t.free(p)  # may run inside PyTorch's allocator: nothing is freed there
    assert a.tensor is mem and a in _mempool._CLOSED
    _mempool.collect()  # a safe point: now it goes
    assert a.tensor is None and a not in _mempool._CLOSED


def test_segments_given_back_from_other_threads(arenas):
    a = arenas(1025 * _ALIGN)
    t = _Torch(a)
    ptrs = [t.alloc(_ALIGN) for _ in range(1024)]
    assert len(set(ptrs)) == 1024 and None not in ptrs
    # ctypes lets go of the GIL around a foreign call: the four threads free at the same time
    ts = [threading.Thread(target=lambda s=s: [t.free(p) for p in ptrs[s::4]]) for s in range(4)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    assert _free_spans(a) == [(_ALIGN, 1024 * _ALIGN)] and a.state()[1] == []


def test_a_slot_serves_a_new_arena_only_when_the_old_is_drained_and_its_pool_gone(arenas):
    old = arenas(8 * _ALIGN)
    t = _Torch(old)
    p = t.alloc(_ALIGN)
    old.close()  # the buffer is gone; the pool and one segment are not
    alive = arenas(8 * _ALIGN, BASE + (1 << 31))
    alive.close()  # drained, but its pool may still allocate (to no avail) through the slot
    others = []
    with pytest.raises(OutOfMemoryError, match="all 64 pool slots are in use"):
        for i in range(SLOTS + 1):  # every free slot (other tests' pools may hold some)
            others.append(arenas(8 * _ALIGN, BASE + (i + 1) * (1 << 20)))
    assert others and not {old.slot, alive.slot} & {a.slot for a in others}
    old.close(pool_gone=True)  # the pool went: the slot waits for its segment
    old.close()  # (a later close without the pool's word does not bring the pool back)
    with pytest.raises(OutOfMemoryError):
        _Arena(_Mem(8 * _ALIGN))
    t.free(p)
    new = arenas(8 * _ALIGN, BASE + (1 << 30))
    assert new.slot == old.slot and new.gen != old.gen
    assert old.state() is None and old.largest_free() == 0  # nothing of the new arena
    old.close()  # and cannot close it
    assert new.state()[2] is False
    assert _Torch(new).alloc(1) == BASE + (1 << 30) + _ALIGN


def test_bad_arena_arguments():
    with pytest.raises(ValueError, match=r"arena_open: base 0x10000000008, size 4096: needs a "
                                         r"512-byte aligned base"):
        _C.arena_open(BASE + 8, 4096)
    for base, size in ((0, 4096), (BASE, _ALIGN)):
        with pytest.raises(ValueError, match="arena_open"):
            _C.arena_open(base, size)
    with pytest.raises(ValueError, match="out of range"):
        _C.arena_state(SLOTS, 1)


# ---- OutPool (Buffer's out_pool_bytes): when a recv_x may be made under the pool

MIB = 1 << 20


class _Pool:
    """Stands for the torch.cuda.MemPool: its snapshot (the segments of PyTorch's cache)."""

    def __init__(self, segments):
        self.segments = segments

    def snapshot(self, include_traces=True):
        return self.segments


class _MemPool:
    def __init__(self, arena, segments=()):
        self._arena = arena
        self.pool = _Pool(list(segments))


def _seg(stream, blocks, kind="large"):
    return {"stream": stream, "segment_type": kind,
            "blocks": [{"state": st, "size": n} for st, n in blocks]}


def test_segment_bytes_follow_the_caching_allocator():
    assert _mempool._segment_bytes(MIB + 1) == 20 * MIB  # below 10 MiB: a 20 MiB segment
    assert _mempool._segment_bytes(10 * MIB - 512) == 20 * MIB
    assert _mempool._segment_bytes(10 * MIB) == 10 * MIB  # from 10 MiB: whole 2 MiB units
    assert _mempool._segment_bytes(11 * MIB + 1) == 12 * MIB


def test_out_pool_room(monkeypatch, arenas):
    monkeypatch.setattr(_mempool.torch.cuda, "current_stream",
                        lambda device=None: type("S", (), {"cuda_stream": 7})())
    # the arena has room for the segment PyTorch would ask for
    assert _mempool.OutPool(_MemPool(arenas(21 * MIB)))._room(2 * MIB, "cuda:0")
    assert not _mempool.OutPool(_MemPool(arenas(20 * MIB)))._room(2 * MIB, "cuda:0")  # + the head
    # no room: only a free large block of PyTorch's cache in the pool, on this stream, will do
    full = [_seg(7, [("active_allocated", 8 * MIB), ("inactive", 3 * MIB)])]
    assert _mempool.OutPool(_MemPool(arenas(4 * MIB), full))._room(3 * MIB, "cuda:0")
    assert not _mempool.OutPool(_MemPool(arenas(4 * MIB), full))._room(3 * MIB + 1, "cuda:0")
    other = [_seg(9, [("inactive", 8 * MIB)]), _seg(7, [("inactive", 8 * MIB)], "small"),
             _seg(7, [("active_pending_free", 8 * MIB)])]
    assert not _mempool.OutPool(_MemPool(arenas(4 * MIB), other))._room(2 * MIB, "cuda:0")


def test_out_pool_snapshots_less_often_while_the_answer_stays_no(monkeypatch, arenas):
    monkeypatch.setattr(_mempool.torch.cuda, "current_stream",
                        lambda device=None: type("S", (), {"cuda_stream": 7})())
    mem = _MemPool(arenas(24 * MIB), [_seg(7, [("active_allocated", 8 * MIB)])])
    first = _Torch(mem._arena).alloc(20 * MIB)  # no room in the arena for PyTorch's next segment
    taken = []
    real = mem.pool.snapshot
    mem.pool.snapshot = lambda include_traces=True: (taken.append(check), real())[1]
    p = _mempool.OutPool(mem)
    for check in range(1, 111):
        assert not p._room(3 * MIB, "cuda:0")
    # pauses of 1, 2, 4, 8, 16, then 32 checks (BACKOFF_MAX) without a snapshot
    assert taken == [1, 3, 6, 11, 20, 37, 70, 103]
    # a block freed in PyTorch's cache is found at the next snapshot, and a yes ends the pauses
    mem.pool.segments = [_seg(7, [("inactive", 8 * MIB)])]
    answers = []
    for check in range(111, 143):
        answers.append(p._room(3 * MIB, "cuda:0"))
    assert answers.index(True) == 136 - 111 and all(answers[25:])  # 104-135 paused
    assert taken[-7:] == list(range(136, 143))  # each yes by a snapshot of its own, no pause
    # no room again: the pauses start over from one check
    mem.pool.segments = [_seg(7, [("active_allocated", 8 * MIB)])]
    del taken[:]
    for check in range(143, 156):
        assert not p._room(3 * MIB, "cuda:0")
    assert taken == [143, 145, 148, 153]
    check = "arena"
    # in a pause (of 8, from check 154): the segment given back to the arena (an empty_cache)
    # means room there, without a snapshot, and the pause ends with it
    a = mem._arena
    _Torch(a).free(first)
    assert p._room(3 * MIB, "cuda:0")
    first = _Torch(a).alloc(20 * MIB)  # and taken again: no room in the arena
    assert not p._room(3 * MIB, "cuda:0") and taken == [143, 145, 148, 153, "arena"]


def test_out_pool_declines_small_rows_and_after_it_is_off(arenas):
    p = _mempool.OutPool(_MemPool(arenas(64 * MIB)))
    assert p.empty((16, 1024), _mempool.torch.bfloat16, "cuda:0") is None  # 32 KiB: plain
    p.mem = None  # turned off (an out of memory in the pool)
    assert p.empty((4096, 7168), _mempool.torch.bfloat16, "cuda:0") is None


# ---- mem_pool() itself with a stand-in torch (its CUDA calls), on any machine: the paths that
# keep the ranks together when one of them cannot make its arena, and the slot's way back.

class _Device:
    type = "cuda"


class _FakeMemPool:
    """Stands for torch.cuda.MemPool (weakref-able, as the real one)."""

    def __init__(self, allocator):
        self.allocator = allocator


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch's CUDA calls that mem_pool makes, on stand-ins; returns what they saw."""
    seen = {"empty_cache": 0, "opened": []}
    bases = iter(range(BASE + (1 << 34), BASE + (1 << 35), 1 << 24))

    def empty(size, dtype=None, device=None):
        if seen.get("oom") and size:  # (0 bytes never fail)
            raise _mempool.torch.cuda.OutOfMemoryError("stand-in: out of memory")
        return _Mem(size, next(bases))

    class Recording(_Arena):
        def __init__(self, tensor):
            super().__init__(tensor)
            seen["opened"].append(self)

    monkeypatch.setattr(_mempool.torch, "empty", empty)
    monkeypatch.setattr(_mempool.torch.cuda, "MemPool", _FakeMemPool, raising=False)
    monkeypatch.setattr(_mempool.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_mempool.torch.cuda, "empty_cache",
                        lambda: seen.__setitem__("empty_cache", seen["empty_cache"] + 1))
    monkeypatch.setattr(_mempool.torch._C, "_cuda_customAllocator", lambda a, f: ("alloc", a, f),
                        raising=False)
    monkeypatch.setattr(_mempool.torch._C, "_cuda_beginAllocateCurrentThreadToPool", None,
                        raising=False)
    monkeypatch.setattr(_mempool, "_Arena", Recording)
    monkeypatch.setattr(_mempool, "_ALLOCATORS", {})  # stand-ins must not outlive the test
    yield seen
    for a in seen["opened"]:
        a.close(pool_gone=True)
    _mempool.collect()


class _Buffer:
    device = _Device()


def _register(calls, fail=None):
    def register(t):
        calls.append(t.numel())
        if fail:
            raise fail
        return "registration"
    return register


def test_mem_pool_keeps_one_allocator_per_slot_and_frees_the_slot_with_its_pool(fake_cuda):
    calls = []
    p = _mempool.mem_pool(_Buffer(), _register(calls), 4096)
    arena = fake_cuda["opened"][-1]
    assert calls == [4096 + _ALIGN] and p.registration == "registration" and p.nbytes == 4096
    assert p.pool.allocator is _mempool._ALLOCATORS[arena.slot]
    assert p.pool.allocator == ("alloc", arena.alloc_fn, arena.free_fn)
    assert arena.state()[2] is False
    pool = p.pool
    del p, pool  # the MemPool is gone: nothing can allocate through the slot any more
    gc.collect()
    assert arena.state()[2] is True


def test_mem_pool_frees_the_slot_when_the_registration_fails(fake_cuda):
    with pytest.raises(UnsupportedError):
        _mempool.mem_pool(_Buffer(), _register([], UnsupportedError("stand-in")), 4096)
    assert fake_cuda["opened"][-1].state()[2] is True  # closed, its pool never made


def test_a_rank_without_an_arena_refuses_the_registration(fake_cuda, arenas):
    fake_cuda["oom"] = True
    calls = []
    with pytest.raises(_mempool.torch.cuda.OutOfMemoryError):
        _mempool.mem_pool(_Buffer(), _register(calls, InvalidArgumentError("empty")), 4096)
    assert calls == [0]  # it took part, with nothing: the peers fail at once
    fake_cuda["oom"] = False
    with pytest.raises(OutOfMemoryError, match="pool slots are in use"):
        for i in range(SLOTS + 1):  # every slot taken
            arenas(8 * _ALIGN, BASE + (i + 1) * (1 << 20))
    calls.clear()
    with pytest.raises(OutOfMemoryError, match="pool slots are in use"):
        _mempool.mem_pool(_Buffer(), _register(calls, InvalidArgumentError("empty")), 4096)
    assert calls == [0] and fake_cuda["empty_cache"] == 1  # retried once after emptying caches


def _pool_buffer(register, num_nvl_bytes=1 << 20):
    """The state Buffer._make_out_pool reads, without a GPU."""
    from epcomm._buffer import Buffer

    b = object.__new__(Buffer)
    b._cuda, b.device, b.num_nvl_bytes, b._pools = True, _Device(), num_nvl_bytes, []
    b.register = register
    return b


@pytest.fixture
def memory(monkeypatch):
    """The device's memory as the pool's room check reads it: {"free", "total", "cached"}."""
    m = {"free": 64 << 20, "total": 64 << 20, "cached": 0}
    cuda = _mempool.torch.cuda
    monkeypatch.setattr(cuda, "mem_get_info", lambda d=None: (m["free"], m["total"]))
    monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: m["cached"])
    monkeypatch.setattr(cuda, "memory_allocated", lambda d=None: 0)
    return m


def test_the_default_out_pool_leaves_an_eighth_of_the_memory_free(fake_cuda, memory):
    calls = []
    b = _pool_buffer(_register(calls, InvalidArgumentError("empty")), 16 << 20)
    memory["free"] = (8 << 20) + (8 << 20) - 1  # 8 MiB pool + 8 MiB headroom, one byte short
    assert b._make_out_pool(None) is None and b._pools == []
    assert calls == [0]  # it took part in the registration with nothing: the peers give up too
    assert not fake_cuda["opened"], "no arena allocated"
    memory["cached"] = 1  # PyTorch's unused cache counts as room
    calls.clear()
    b.register = _register(calls)
    pool = b._make_out_pool(None)
    assert pool is not None and calls == [(8 << 20) + _ALIGN] and b._pools == [pool.mem]
    memory["free"], memory["cached"] = 1 << 20, 0  # an explicit size needs room, no headroom
    calls.clear()
    b.register = _register(calls, InvalidArgumentError("empty"))
    assert b._make_out_pool(2 << 20) is None and calls == [0]


@pytest.mark.parametrize("err", [CudaError("stand-in: cudaIpcGetMemHandle failed"),
                                 PeerInvalidError("stand-in: a peer refused")])
def test_a_failed_out_pool_registration_leaves_no_pool_and_no_arena(fake_cuda, memory, err):
    b = _pool_buffer(_register([], err))
    assert b._make_out_pool(None) is None and b._pools == []
    arena = fake_cuda["opened"][-1]
    assert arena.tensor is None, "the arena's memory went back at once, not at destroy"


@pytest.mark.parametrize("room", [True, False])
def test_a_dead_peer_during_the_out_pool_registration_still_raises(fake_cuda, memory, room):
    """Whether this rank registers its arena or refuses (no room) with nothing."""
    calls = []
    b = _pool_buffer(_register(calls, PeerFailedError("stand-in: rank 1 died")))
    memory["free"] = memory["total"] if room else 0
    with pytest.raises(PeerFailedError):
        b._make_out_pool(None)
    assert calls == ([(512 << 10) + _ALIGN] if room else [0])


def test_no_out_pool_without_memory_pools_and_nothing_collective(fake_cuda, memory, monkeypatch):
    """A PyTorch without MemPools for one thread: no rank enters the registration (the same
    PyTorch everywhere), even one that would have had no room."""
    from epcomm import _buffer

    monkeypatch.setattr(_buffer, "_pool_supported", lambda: False)
    calls = []
    b = _pool_buffer(_register(calls))
    memory["free"] = 0
    assert b._make_out_pool(None) is None and calls == []


def test_a_collected_buffer_keeps_its_pools_until_the_next_plain_call(fake_cuda):
    """A Buffer with pools may die in a garbage collection (in a cycle of the program's),
    which may run inside a use_mem_pool block, where dropping a torch MemPool aborts the
    process (~MemPool empties its cache; PyTorch asserts no pool is in use): its pools wait in
    _mempool for collect(), called from plain code (the next Buffer, destroy, mem_pool). The
    torch MemPool's deallocation is what counts (its C++ destructor; the collector still runs
    weakref callbacks and finalizers of the objects it then resurrects): seen here as the
    reference it holds."""
    from epcomm._buffer import Buffer

    p = _mempool.mem_pool(_Buffer(), _register([]), 4096)
    arena = fake_cuda["opened"][-1]
    token = p.pool.token = object()
    held = sys.getrefcount(token)
    b = object.__new__(Buffer)  # the state a CUDA Buffer with one pool has, without a GPU
    b._group, b._owns_group, b._pid, b.explicitly_destroy = object(), False, os.getpid(), False
    b._normal = b._llbuf = b._out_pool = None
    b._registrations, b._pools = {}, [p]
    b.self_ref = b  # a cycle: only the collector frees it
    del b, p
    gc.collect()  # Buffer.__del__ runs here: nothing of PyTorch's may be freed now
    assert sys.getrefcount(token) == held and arena.state()[2] is True  # closed, pool kept
    _mempool.collect()  # plain code: the pool goes now
    assert sys.getrefcount(token) == held - 1 and not _mempool._PARKED


def test_parked_pools_go_at_exit_before_the_interpreter_teardown():
    """_lifecycle's exit handler drops them while CUDA is whole (in the teardown, their
    destructors' CUDA calls may find the driver gone)."""
    from epcomm import _lifecycle

    class Parked:
        pool = object()

    p = Parked()
    _mempool.park([p])
    _lifecycle._drop_parked_pools()
    assert p.pool is None and not _mempool._PARKED


def test_out_pool_allocates_directly_only_where_use_mem_pool_makes_the_same_calls(monkeypatch):
    import contextlib

    @contextlib.contextmanager
    def older(pool, device=None):  # a release with a pool context object (before 2.8)
        ctx = _mempool.torch._C._MemPoolContext(pool)
        _mempool.torch._C._cuda_beginAllocateCurrentStreamToPool(device, pool.id)
        yield ctx

    if hasattr(_mempool.torch.cuda, "use_mem_pool"):
        names = _mempool.torch.cuda.use_mem_pool.__wrapped__.__code__.co_names
        want = {n for n in names if "Pool" in n} == {
            "_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool",
            "_cuda_releasePool"}
        assert _mempool._same_calls() == want
    monkeypatch.setattr(_mempool.torch.cuda, "use_mem_pool", older, raising=False)
    assert not _mempool._same_calls()

    @contextlib.contextmanager
    def more(pool, device=None):  # the three calls and one more pool call
        _mempool.torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool.id)
        _mempool.torch._C._cuda_noteMemPoolUse(pool.id)
        try:
            yield
        finally:
            _mempool.torch._C._cuda_endAllocateToPool(device, pool.id)
            _mempool.torch._C._cuda_releasePool(device, pool.id)

    monkeypatch.setattr(_mempool.torch.cuda, "use_mem_pool", more)
    assert not _mempool._same_calls()
    monkeypatch.setattr(_mempool.torch.cuda, "use_mem_pool", _same_as_direct)
    assert _mempool._same_calls()
    monkeypatch.delattr(_mempool.torch.cuda, "use_mem_pool")
    assert not _mempool._same_calls()


def _same_as_direct(pool, device=None):
    """Stands for use_mem_pool as 2.11 writes it (the calls OutPool._direct makes)."""
    _mempool.torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool.id)
    try:
        yield
    finally:
        _mempool.torch._C._cuda_endAllocateToPool(device, pool.id)
        _mempool.torch._C._cuda_releasePool(device, pool.id)


_same_as_direct = __import__("contextlib").contextmanager(_same_as_direct)


class _IdPool:
    id = (0, 7)

    def snapshot(self, include_traces=True):
        return []


@pytest.mark.parametrize("fails", [False, True])
def test_out_pool_direct_allocation_makes_use_mem_pool_calls_in_order(monkeypatch, arenas, fails):
    """Outside a capture: begin, torch.empty, end, release, also when torch.empty raises (an out
    of memory then turns the pool off); inside one: use_mem_pool (which keeps the pool for the
    graph), none of the direct calls."""
    calls = []
    monkeypatch.setattr(_mempool, "_DIRECT", True)
    monkeypatch.setattr(_mempool, "_BEGIN", lambda d, i: calls.append(("begin", d, i)))
    monkeypatch.setattr(_mempool, "_END", lambda d, i: calls.append(("end", d, i)))
    monkeypatch.setattr(_mempool, "_RELEASE", lambda d, i: calls.append(("release", d, i)))
    capturing = [False]
    monkeypatch.setattr(_mempool, "_CAPTURING", lambda: capturing[0])

    def empty(shape, dtype=None, device=None):
        calls.append(("empty", tuple(shape)))
        if fails:
            raise _mempool.torch.cuda.OutOfMemoryError("stand-in: out of memory")
        return "tensor"

    @__import__("contextlib").contextmanager
    def use_pool(pool, device):
        calls.append(("use_mem_pool", pool.id))
        yield

    monkeypatch.setattr(_mempool.torch, "empty", empty)
    monkeypatch.setattr(_mempool, "_use_pool", use_pool)
    mem = _MemPool(arenas(64 * MIB))
    mem.pool = _IdPool()
    p = _mempool.OutPool(mem)
    got = p.empty((2048, 1024), _mempool.torch.bfloat16, "cuda:3")  # 4 MiB
    assert calls == [("begin", 3, (0, 7)), ("empty", (2048, 1024)), ("end", 3, (0, 7)),
                     ("release", 3, (0, 7))]
    assert (got, p.mem) == ((None, None) if fails else ("tensor", mem))
    if fails:
        return
    del calls[:]
    capturing[0] = True
    assert p.empty((2048, 1024), _mempool.torch.bfloat16, "cuda:3") == "tensor"
    assert calls == [("use_mem_pool", (0, 7)), ("empty", (2048, 1024))]
