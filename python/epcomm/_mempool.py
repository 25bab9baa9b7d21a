"""Buffer.mem_pool(nbytes): a torch.cuda.MemPool whose memory is registered with the buffer.

Tensors allocated under ``torch.cuda.use_mem_pool(pool)`` come from one arena that every peer has
mapped (ep_register_memory), so a combine whose ``x`` is such a tensor (the experts' output) is
read by the peers where it lies, without the staging pass, whatever tensor the experts return:
the same idea as NCCL's registered memory pools, for PyTorch code that cannot write into a
tensor of its choosing (``Buffer.register`` needs the tensor first, ``get_combine_buffer`` needs
the experts to write into it).

PyTorch's caching allocator asks the pool's allocator for whole segments, rarely; the arena is
cut into them first-fit by the extension (python/csrc/arena.c), in C: PyTorch calls a pool's
allocator under its own lock, where a Python callback would need the GIL, which a thread freeing
a tensor may hold while it waits for that lock. The arena stays allocated until the buffer is
gone *and* PyTorch has given back every segment (a tensor of the pool may outlive the buffer: its
memory must stay valid; it is then simply not registered any more).

The arena is itself a PyTorch tensor (no CUDA runtime of our own to load); its first bytes are
never handed out (PyTorch files allocated blocks by address: a segment starting where the arena
starts would share the arena's key, and freeing one would lose the other). A closed arena is
freed at the next safe point once every segment is back (collect(): a Buffer's destroy or
release, the next mem_pool), never from inside the allocator.
"""

import contextlib
import gc
import weakref

import torch

from . import _C
from ._errors import ArgumentTypeError, InvalidArgumentError, PeerInvalidError, UnsupportedError
from ._errors import OutOfMemoryError

_ALIGN = 512  # PyTorch's blocks are 512-byte aligned inside a segment (arena.c: the same)

# Arenas closed (their buffer gone) whose memory waits for every segment to come back.
_CLOSED = []
# PyTorch's allocator object of each slot: the slot's two functions never change, and before
# pytorch#171962 (January 2026) a MemPool kept only a raw pointer to its allocator, which must
# therefore outlive every pool made with it. Made on first use, never dropped.
_ALLOCATORS = {}


# Pools of Buffers the garbage collector released, kept for the next collect(), which drops
# their torch MemPools from plain code: dropping one empties its cache, which PyTorch asserts
# against while any thread allocates to a pool (in ~MemPool: the process aborts), and a
# collection can run inside such a block (any object made there may start one).
_PARKED = []


def park(pools):
    """Keeps pools (MemPool objects of a Buffer being garbage-collected) for collect()."""
    _PARKED.extend(pools)


def collect():
    """Drops the parked pools' torch MemPools, then frees the memory of closed arenas whose
    segments are all back. Only from plain Python code, never from the allocator's calls or a
    garbage collection."""
    parked = _PARKED[:]
    del _PARKED[:len(parked)]  # (what a collection parks meanwhile stays for the next time)
    for p in parked:
        # Its Buffer went without destroy(): the pool is usable only while its Buffer lives
        # (MemPool), so its torch MemPool goes now, also from a caller still holding p.
        p.pool = None
    del parked
    _CLOSED[:] = [a for a in _CLOSED if not a.drop_if_drained()]


class _Arena:
    """The arena's memory (a uint8 tensor, kept here) and its slot in the extension's allocator
    (``alloc_fn`` / ``free_fn``: the addresses of the two C functions PyTorch calls)."""

    def __init__(self, tensor):
        self.tensor = tensor  # the memory; dropped once closed and every segment is back
        self.base, self.size = tensor.data_ptr(), tensor.numel()
        self.slot, self.gen, self.alloc_fn, self.free_fn = _C.arena_open(self.base, self.size)

    def state(self):
        """(free spans, segments out, closed), spans as (offset, bytes); None once drained and
        its slot serves another arena."""
        return _C.arena_state(self.slot, self.gen)

    def largest_free(self):
        return _C.arena_largest(self.slot, self.gen)

    def allocator(self):
        """PyTorch's allocator object of this arena's slot."""
        a = _ALLOCATORS.get(self.slot)
        if a is None:
            a = _ALLOCATORS[self.slot] = torch._C._cuda_customAllocator(self.alloc_fn,
                                                                         self.free_fn)
        return a

    def close(self, pool_gone=False):
        """No new segment; pool_gone: the MemPool is gone too (the slot may then serve another
        arena once every segment is back)."""
        _C.arena_close(self.slot, self.gen, pool_gone)
        if self.tensor is not None and self not in _CLOSED:
            _CLOSED.append(self)

    def drop_if_drained(self):
        st = self.state()
        if st is None or (st[2] and not st[1]):
            self.tensor = None
        return self.tensor is None


class MemPool:
    """What ``Buffer.mem_pool`` returns: ``pool`` (a torch.cuda.MemPool, for
    ``torch.cuda.use_mem_pool``), ``registration`` (the arena's), ``nbytes`` and
    ``contains(tensor)``. No ``close``: the pool's tensors belong to the caller; the arena goes
    when the buffer is gone and PyTorch has given back every segment. It does not keep its
    Buffer alive (a Buffer goes with its last reference): once that was dropped without
    destroy(), ``pool`` becomes None at the next plain call into the package."""

    __slots__ = ("pool", "registration", "nbytes", "_arena")

    def __init__(self, pool, registration, arena):
        self.pool, self.registration, self._arena = pool, registration, arena
        self.nbytes = arena.size - _ALIGN

    def contains(self, tensor):
        """Whether the tensor's memory lies in this pool's arena."""
        a = self._arena
        p = tensor.data_ptr()
        return a.base <= p and p + tensor.numel() * tensor.element_size() <= a.base + a.size

    def _close(self):
        self._arena.close()

    def __repr__(self):
        state = "registered" if self.registration.active else "not registered"
        return f"<epcomm.MemPool {self.nbytes} bytes at {self._arena.base:#x}, {state}>"


def _open(tensor):
    """The arena over tensor. When every slot is taken, the slots of dropped pools may only wait
    for their segments, which PyTorch keeps cached: one more try after a collection (the pools'
    finalizers) and emptying PyTorch's cache (safe here: plain Python code)."""
    try:
        return _Arena(tensor)
    except OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        collect()
        return _Arena(tensor)


def room_for(device, nbytes, headroom=0.0):
    """Whether nbytes more fit on the device now with a fraction ``headroom`` of its memory
    still free after them: the driver's free memory plus what PyTorch's cache holds unused. A
    check before an allocation that may fail: PyTorch's out-of-memory path (its statistics and
    observers see one, its cache is emptied) is not how an optional pool should say no."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached - nbytes >= headroom * total


def supported():
    """Whether this PyTorch has MemPools with custom allocators for one thread (older MemPools
    route every thread's allocations to the pool while one thread uses it)."""
    return (hasattr(torch.cuda, "MemPool") and hasattr(torch._C, "_cuda_customAllocator") and
            hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool"))


def refuse(register, device):
    """This rank has no arena: it still takes part in the (collective) registration, refused,
    so that the peers give up on theirs at once (PeerInvalidError) instead of waiting."""
    try:
        register(torch.empty(0, dtype=torch.uint8, device=device))
    except (InvalidArgumentError, PeerInvalidError):  # refused here (a null range), or by a
        pass  # peer that refused too; a dead peer, a deadline or a mismatch is raised


def mem_pool(buffer, register, nbytes, op="Buffer.mem_pool"):
    """The arena (nbytes on the buffer's device), registered (collective), behind a MemPool."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise ArgumentTypeError(f"{op}: nbytes: expected an int, got {type(nbytes).__name__}")
    if nbytes <= 0:
        raise InvalidArgumentError(f"{op}: nbytes is {nbytes}, must be > 0")
    if buffer.device.type != "cuda":
        raise UnsupportedError(f"{op}: a memory pool is for CUDA buffers (this one is on "
                               f"{buffer.device}); on the cpu backend a combine reads any tensor "
                               f"in place already")
    if not supported():
        raise UnsupportedError(f"{op}: this PyTorch ({torch.__version__}) has no "
                               f"torch.cuda.MemPool with custom allocators for one thread")
    collect()
    size = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN  # + the unused head
    try:
        arena = _open(torch.empty(size, dtype=torch.uint8, device=buffer.device))
    except Exception:  # out of memory, a full table (epcomm's MemoryError), a CUDA error
        refuse(register, buffer.device)
        raise
    try:
        reg = register(arena.tensor)  # collective; raises (on every rank) if it cannot be exported
        with torch.cuda.device(buffer.device):  # a MemPool belongs to the current device
            pool = torch.cuda.MemPool(arena.allocator())
    except BaseException:
        arena.close(pool_gone=True)  # no pool allocates from it: its slot is free again
        raise
    # Once PyTorch's pool object is gone nothing can allocate from the arena any more.
    weakref.finalize(pool, _C.arena_close, arena.slot, arena.gen, True)
    return MemPool(pool, reg, arena)


_MIB = 1 << 20


@contextlib.contextmanager
def _use_pool(pool, device):
    """torch.cuda.use_mem_pool on the buffer's device (the keyword is newer than MemPool)."""
    try:
        cm = torch.cuda.use_mem_pool(pool, device=device)
    except TypeError:
        with torch.cuda.device(device), torch.cuda.use_mem_pool(pool):
            yield
        return
    with cm:
        yield


def _segment_bytes(nbytes):
    """What PyTorch's caching allocator asks a pool's allocator for, to hold one block of
    nbytes over 1 MiB (its large blocks, default settings: a 20 MiB segment below 10 MiB, else
    whole 2 MiB units; 1 MiB and less come from 2 MiB small segments, never asked for here)."""
    need = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return 20 * _MIB if need < 10 * _MIB else (need + 2 * _MIB - 1) // (2 * _MIB) * (2 * _MIB)


# What torch.cuda.use_mem_pool calls, taken one by one: OutPool.empty runs inside every dispatch's
# allocator callback, on the host's critical path, where the context manager's two generators,
# device lookup and Python-level capture query are host time of every dispatch (a use_mem_pool
# block cost up to ~5 us on an H100 under MPS; bench/py_host_cost.py's "recv_x:" rows time the
# forms side by side). None on a PyTorch without them (CPU
# builds, older releases), or when this PyTorch's use_mem_pool calls anything else (a pool
# context object, as releases before 2.8 did): use_mem_pool then.
_BEGIN = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
_END = getattr(torch._C, "_cuda_endAllocateToPool", None)
_RELEASE = getattr(torch._C, "_cuda_releasePool", None)
_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def _same_calls():
    """Whether torch.cuda.use_mem_pool makes exactly the calls OutPool._direct makes (outside a
    capture): its code names them and no other pool call."""
    fn = getattr(getattr(torch.cuda, "use_mem_pool", None), "__wrapped__", None)
    names = set(getattr(getattr(fn, "__code__", None), "co_names", ()))
    pool_calls = {n for n in names if "Pool" in n}  # (a capture's _retain_pool: lower case)
    return pool_calls == {"_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool",
                          "_cuda_releasePool"}


_DIRECT = None not in (_BEGIN, _END, _RELEASE, _CAPTURING) and _same_calls()


class OutPool:
    """Where a CUDA Buffer's dispatch puts its recv_x by default (Buffer's ``out_pool_bytes``):
    a registered arena like ``Buffer.mem_pool``'s, so that the senders write the rows straight
    there (the data kernel's late hello says where) and a combine of recv_x reads them in place.

    A tensor is made under the pool only when the pool can certainly hold it, otherwise with a
    plain torch.empty: when a pool's allocator says no, PyTorch counts an out of memory (its
    statistics, the profiler and every OOM observer see one) and raises, what a user would take
    for a real one. Through 2.11 (c10's CUDACachingAllocator, malloc) an allocation to a pool
    skips the step that frees every unsplit cached block first; later releases that separate
    pool scopes from graph capture may take it (waiting for every pending event). No fallback
    may cost either. Certain
    means a large block of PyTorch's cache in this pool, free and on this stream, that is large
    enough, or room in the arena for the segment PyTorch would ask for (its default rules: a
    PYTORCH_CUDA_ALLOC_CONF that changes them can defeat the check; the first out of memory
    then turns the pool off for good)."""

    MIN_BYTES = 1 * _MIB + 1  # below: a plain tensor (the copy saved is worth less than the
    # check, and PyTorch's small blocks, 1 MiB and less, follow other rules)

    # A snapshot that found no room is not taken again for this many room checks, doubling up to
    # BACKOFF_MAX while the answer stays no: a training step holding many layers' recv_x keeps the
    # arena cut up, and a snapshot per dispatch would cost more than the pool saves.
    BACKOFF_MAX = 32

    __slots__ = ("mem", "_key", "_skip", "_backoff")

    def __init__(self, mem):
        self.mem = mem  # None once turned off (Buffer.in_place_counts says what was in place)
        self._key = None  # (device index, PyTorch's pool id), on the first direct allocation
        self._skip = self._backoff = 0  # room checks left without a snapshot; the next pause

    def empty(self, shape, dtype, device):
        """A tensor in the pool, or None (the caller makes a plain one)."""
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        mem = self.mem
        if mem is None or nbytes < self.MIN_BYTES or not self._room(nbytes, device):
            return None
        try:
            if _DIRECT and not _CAPTURING():
                return self._direct(mem, shape, dtype, device)
            # A capture must also keep the pool for its graph: use_mem_pool does that.
            with _use_pool(mem.pool, device):
                return torch.empty(shape, dtype=dtype, device=device)
        except torch.cuda.OutOfMemoryError:
            self.mem = None  # the check was wrong here: never pay PyTorch's OOM path twice
            return None

    def _direct(self, mem, shape, dtype, device):
        """torch.empty under the pool as use_mem_pool makes it (outside a capture): the pool
        counted in use for the allocation, this thread's allocations routed to it, then both
        undone, whatever torch.empty raises."""
        key = self._key
        if key is None:
            d = torch.device(device)
            key = self._key = (torch.cuda.current_device() if d.index is None else d.index,
                               mem.pool.id)
        _BEGIN(*key)
        try:
            return torch.empty(shape, dtype=dtype, device=device)
        finally:
            _END(*key)
            _RELEASE(*key)

    def _room(self, nbytes, device):
        if self.mem._arena.largest_free() >= _segment_bytes(nbytes):
            self._skip = self._backoff = 0  # segments went back: the pauses' reason is gone
            return True
        if self._skip > 0:
            self._skip -= 1
            return False
        if self._cached_block(nbytes, device):
            self._backoff = 0
            return True
        self._backoff = self._skip = min(max(2 * self._backoff, 1), self.BACKOFF_MAX)
        return False

    def _cached_block(self, nbytes, device):
        """Whether PyTorch's cache in this pool holds a free large block of nbytes or more on
        the current stream (its snapshot: what the allocator would reuse before asking the
        arena)."""
        snapshot = getattr(self.mem.pool, "snapshot", None)
        if snapshot is None:
            return False
        try:
            segments = snapshot(include_traces=False)  # the trace ring can be large
        except TypeError:
            segments = snapshot()
        need = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        stream = torch.cuda.current_stream(device).cuda_stream
        for seg in segments:
            if seg.get("stream") != stream or seg.get("segment_type") != "large":
                continue
            for b in seg.get("blocks", ()):
                if b.get("state") == "inactive" and b.get("size", 0) >= need:
                    return True
        return False
