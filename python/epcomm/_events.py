"""Events and streams, as DeepEP means them.

On CUDA tensors each Buffer has a communication stream. A call waits on the caller's current
stream (or only on ``previous_event``), runs on the communication stream, and then either
makes the current stream wait for it, or, with ``async_finish``, returns an event recorded
after it (the tensors it used are recorded on the communication stream, so the caching
allocator does not reuse them early). A call that would wait on the current stream and make it
wait in turn (the default: no ``previous_event``, no ``async_finish``) runs on the current
stream itself, which orders the caller's work the same way for less (CudaLaunch).
``allocate_on_comm_stream`` allocates the outputs while the communication stream is current.
On CPU tensors every call is complete when it returns: the events it hands out are already
complete, and waiting on them does nothing.
"""

import contextlib

import torch


def _cuda_in_use():
    return torch.cuda.is_available()


class EventHandle:
    """A point on a CUDA stream (DeepEP's EventHandle): recorded on the current stream when
    made without an event. On a machine without CUDA, a point already passed."""

    __slots__ = ("event",)

    def __init__(self, event=None):
        if event is None and _cuda_in_use():
            event = torch.cuda.Event()
            event.record()
        self.event = event  # torch.cuda.Event, or None: nothing to wait for

    def current_stream_wait(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self):
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """DeepEP's EventOverlap: an EventHandle (``.event``) and the tensors it keeps alive
    (``.extra_tensors``). ``with overlap: ...`` runs the block, then the current stream waits
    for the event."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        assert self.event is not None, "this EventOverlap holds no event (async_finish was not set)"
        self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.event is not None:
            self.event.current_stream_wait()


_DONE = EventHandle.__new__(EventHandle)
_DONE.event = None  # the event of a CPU call: complete when the call returned


class CpuLaunch:
    """How a call on CPU tensors is ordered: it is complete when it returns."""

    stream = 0

    def __init__(self, previous_event, async_finish):
        if previous_event is not None and previous_event.event is not None:
            previous_event.event.synchronize()
        self.async_finish = async_finish

    def finish(self, tensors=(), extra=False):
        if not self.async_finish:
            return EventOverlap(None)
        return EventOverlap(_DONE, tuple(tensors) if extra else None)

    def abort(self):
        pass


def _follow(waiter, stream, event):
    """``waiter.wait_stream(stream)`` through ``event``, one the Buffer keeps: wait_stream makes
    a new CUDA event every time and destroys it later (7-15 us of host time per wait on the
    H200 under MPS in two runs; two waits per call). At 128 tokens a call is host-bound, and
    this cut the event-timed write + combine at R = 2 from 180 to 97 us (docs/PERFORMANCE.md).
    A wait takes the event as it is when queued, so recording it again is safe."""
    event.record(stream)
    waiter.wait_event(event)


def _current_raw_stream(device):
    """The cudaStream_t of ``device``'s current stream, as an int. PyTorch's private accessor
    (what Triton launches on) costs a fraction of ``torch.cuda.current_stream(device)``, which
    builds a Stream object; the public call is the fallback."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device.index)
    return torch.cuda.current_stream(device).cuda_stream


class CudaLaunch:
    """How a call on CUDA tensors is ordered (see the module's comment). ``stream`` is the
    cudaStream_t the C call runs on. ``order``: the Buffer's two events for the waits between
    the compute stream and the communication stream; ``device``: the Buffer's (its current
    stream is the compute stream).

    A call that is synchronous and follows the compute stream (no ``previous_event``, no
    ``async_finish``, no ``allocate_on_comm_stream``) runs on the compute stream itself
    (``direct``): DeepEP would make the communication stream wait for the compute stream, run
    there, and make the compute stream wait for it, which orders every piece of work on the
    compute stream exactly as running on it does, for two event records, two waits and two hops
    between streams more. At 128 tokens a call is host-bound and those are a third of its host
    time. The library itself orders its calls on different streams (src/cuda/cuda_sync.c), so
    mixing direct and asynchronous calls stays in call order. Not direct (DeepEP's way): while the
    stream is being captured into a graph (the library's ordering between streams does not apply
    there: calls on two streams would become independent branches), and on a Buffer whose
    communication stream was handed out (``direct=False``: get_comm_stream's users may queue
    work there that must follow the call). ``DIRECT = False`` restores the communication stream
    for every call (bench/py_host_cost.py times both)."""

    DIRECT = True

    def __init__(self, comm, order, device, previous_event, async_finish,
                 allocate_on_comm_stream, on_compute=False, after_compute=False, direct=True):
        self.async_finish = async_finish
        self.switched = False
        self.direct = True
        waits = previous_event is not None and previous_event.event is not None
        if on_compute:
            # A receive hook's call: the stream current now is the launch stream, and what the
            # hook queues later (the statistics) goes on it too, wherever the hook is called.
            self.launch = self.compute = torch.cuda.current_stream(device)
            self.stream = self.launch.cuda_stream
            return
        if (direct and self.DIRECT and not (waits or async_finish or allocate_on_comm_stream)
                and not torch.cuda.is_current_stream_capturing()):
            # The current stream is the launch stream: nothing to order, nothing to record.
            self.launch = self.compute = None
            self.stream = _current_raw_stream(device)
            return
        self.direct = False
        self.compute = torch.cuda.current_stream(device)
        self.launch = comm
        self.order = order
        if waits:
            self.launch.wait_event(previous_event.event.event)
        # Without previous_event the call follows the compute stream. With it, it still must
        # when this layer itself just queued inputs there (the routing it derives from
        # is_token_in_rank): the caller's event was recorded before them.
        if not waits or after_compute:
            _follow(self.launch, self.compute, order[0])
        self.switched = allocate_on_comm_stream
        if self.switched:
            torch.cuda.set_stream(self.launch)
        self.stream = self.launch.cuda_stream

    def ordered(self):
        """A context in which work queued on the current stream runs after the call."""
        if self.launch is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.launch)

    def finish(self, tensors=(), extra=False):
        self.abort()
        if self.direct:  # ran on the stream that is current (or was, for a hook's call)
            if not self.async_finish:
                return EventOverlap(None)
            event = torch.cuda.Event()
            event.record(self.launch)  # None: the current stream
            return EventOverlap(EventHandle(event), tuple(tensors) if extra else None)
        if self.async_finish:
            event = torch.cuda.Event()
            event.record(self.launch)
            for t in tensors:
                if t is not None and t.is_cuda:
                    t.record_stream(self.launch)
            return EventOverlap(EventHandle(event), tuple(tensors) if extra else None)
        _follow(self.compute, self.launch, self.order[1])
        return EventOverlap(None)

    def abort(self):
        if self.switched:
            torch.cuda.set_stream(self.compute)
            self.switched = False
