"""Buffer.mem_pool(nbytes): a torch.cuda.MemPool whose memory is registered with the buffer.

Tensors allocated under ``torch.cuda.use_mem_pool(pool)`` come from one arena that every peer has
mapped (ep_register_memory), so a combine whose ``x`` is such a tensor (the experts' output) is
read by the peers where it lies, without the staging pass, whatever tensor the experts return:
the same idea as NCCL's registered memory pools, for PyTorch code that cannot write into a
tensor of its choosing (``Buffer.register`` needs the tensor first, ``get_combine_buffer`` needs
the experts to write into it).

PyTorch's caching allocator asks the pool's allocator for whole segments, rarely; the arena is
cut into them first-fit here. The arena stays allocated until the buffer is gone *and* PyTorch
has given back every segment (a tensor of the pool may outlive the buffer: its memory must stay
valid; it is then simply not registered any more).

The arena is itself a PyTorch tensor (no CUDA runtime of our own to load), so two rules keep
PyTorch's allocator consistent: its first bytes are never handed out (PyTorch files allocated
blocks by address: a segment starting where the arena starts would share the arena's key, and
freeing one would lose the other: "invalid device pointer" at exit), and the arena is never freed
inside one of the allocator's calls (a segment's return may come from inside PyTorch's
allocator): it is retired to _GRAVE and freed at the next safe point (collect(): a Buffer's
destroy or release, the next mem_pool, or the interpreter's exit).
"""

import contextlib
import ctypes
import threading

import torch

from ._errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError

_ALIGN = 512  # PyTorch's blocks are 512-byte aligned inside a segment
_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

# PyTorch keeps the allocator's two C function pointers for the life of the process (a pool's
# segments can be given back after the pool object is gone), so the ctypes thunks behind them
# must live as long: they are kept here, a few hundred bytes per pool.
_THUNKS = []
# Arenas done with (buffer gone, every segment back), waiting for a safe point to be freed.
_GRAVE = []


def collect():
    """Frees retired arenas. Only from plain Python code, never from the allocator's calls."""
    _GRAVE.clear()


class _Arena:
    """First-fit over [base, base + size): the segments PyTorch takes from the pool."""

    def __init__(self, tensor):
        self.tensor = tensor  # the memory; dropped once closed and every segment is back
        self.base, self.size = tensor.data_ptr(), tensor.numel()
        self.free = [(_ALIGN, self.size - _ALIGN)]  # (offset, bytes), sorted, coalesced; the
        # first _ALIGN bytes stay unused: no segment starts at the arena's own address
        self.used = {}  # offset -> bytes
        self.closed = False
        self.lock = threading.Lock()  # PyTorch may give segments back from any thread

    def alloc(self, size, device, stream):
        want = max(_ALIGN, (int(size) + _ALIGN - 1) // _ALIGN * _ALIGN)
        with self.lock:
            if self.closed:
                return None
            for i, (off, n) in enumerate(self.free):
                if n >= want:
                    self.free[i:i + 1] = [(off + want, n - want)] if n > want else []
                    self.used[off] = want
                    return self.base + off
        return None  # PyTorch reports it as out of memory

    def release(self, ptr, size, device, stream):
        with self.lock:
            off = (ptr or 0) - self.base
            n = self.used.pop(off, None)
            if n is None:
                return  # not ours: nothing to do (PyTorch never does this)
            self.free.append((off, n))
            self.free.sort()
            merged = []
            for o, m in self.free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + m)
                else:
                    merged.append((o, m))
            self.free = merged
            self._maybe_drop()

    def largest_free(self):
        with self.lock:
            return max((n for _, n in self.free), default=0)

    def close(self):
        with self.lock:
            self.closed = True
            self._maybe_drop()

    def _maybe_drop(self):
        if self.closed and not self.used and self.tensor is not None:
            _GRAVE.append(self.tensor)  # freed by collect(), outside the allocator
            self.tensor = None


class MemPool:
    """What ``Buffer.mem_pool`` returns: ``pool`` (a torch.cuda.MemPool, for
    ``torch.cuda.use_mem_pool``), ``registration`` (the arena's), ``nbytes`` and
    ``contains(tensor)``. No ``close``: the pool's tensors belong to the caller; the arena goes
    when the buffer is gone and PyTorch has given back every segment."""

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
    # Older MemPools route every thread's allocations to the pool while one thread uses it.
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch._C, "_cuda_customAllocator") or \
            not hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool"):
        raise UnsupportedError(f"{op}: this PyTorch ({torch.__version__}) has no "
                               f"torch.cuda.MemPool with custom allocators for one thread")
    collect()
    size = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN  # + the unused head
    arena = _Arena(torch.empty(size, dtype=torch.uint8, device=buffer.device))
    reg = register(arena.tensor)  # collective; raises (on every rank) if it cannot be exported
    thunks = (_ALLOC(arena.alloc), _FREE(arena.release))
    _THUNKS.append(thunks)
    addr = [ctypes.cast(t, ctypes.c_void_p).value for t in thunks]
    allocator = torch._C._cuda_customAllocator(addr[0], addr[1])
    with torch.cuda.device(buffer.device):  # a MemPool belongs to the current device
        return MemPool(torch.cuda.MemPool(allocator), reg, arena)


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


class OutPool:
    """Where a CUDA Buffer's dispatch puts its recv_x by default (Buffer's ``out_pool_bytes``):
    a registered arena like ``Buffer.mem_pool``'s, so that the senders write the rows straight
    there (the data kernel's late hello says where) and a combine of recv_x reads them in place.

    A tensor is made under the pool only when the pool can certainly hold it, otherwise with a
    plain torch.empty: when a pool's allocator says no, PyTorch frees every cached block of the
    process and retries before raising out of memory, a cost no fallback should have. Certain
    means a large block of PyTorch's cache in this pool, free and on this stream, that is large
    enough, or room in the arena for the segment PyTorch would ask for (its default rules: a
    PYTORCH_CUDA_ALLOC_CONF that changes them can defeat the check; the first out of memory
    then turns the pool off for good)."""

    MIN_BYTES = 1 * _MIB + 1  # below: a plain tensor (the copy saved is worth less than the
    # check, and PyTorch's small blocks, 1 MiB and less, follow other rules)

    __slots__ = ("mem",)

    def __init__(self, mem):
        self.mem = mem  # None once turned off (Buffer.in_place_counts says what was in place)

    def empty(self, shape, dtype, device):
        """A tensor in the pool, or None (the caller makes a plain one)."""
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        mem = self.mem
        if mem is None or nbytes < self.MIN_BYTES or not self._room(nbytes, device):
            return None
        try:
            with _use_pool(mem.pool, device):
                t = torch.empty(shape, dtype=dtype, device=device)
        except torch.cuda.OutOfMemoryError:
            self.mem = None  # the check was wrong here: never pay PyTorch's OOM path twice
            return None
        return t

    def _room(self, nbytes, device):
        if self.mem._arena.largest_free() >= _segment_bytes(nbytes):
            return True
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
