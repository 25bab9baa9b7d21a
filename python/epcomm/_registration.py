"""Buffer.register(tensor): caller memory registered with the buffer (ep_register_memory).

A combine whose ``x`` lies inside a registered tensor is read by the peers where it is (CUDA: no
staging pass, the speed of a combine from the dispatch's view): register the tensor the experts
write their outputs into once, and combine from it (or from a slice of it) call after call. The
results are the same bits with or without the registration.

Registration and deregistration are collective: every rank calls them on its Buffer in the same
order, each with its own tensor. A registration lasts until ``deregister()`` or the Buffer's
destroy/release (it then goes with the buffer); the Buffer keeps the tensor alive meanwhile.
"""

import weakref

import torch

from . import _C
from ._errors import ArgumentTypeError, DestroyedError, InvalidArgumentError


class Registration:
    """One registered tensor. ``deregister()`` (collective) ends it; ``with buf.register(t) as
    reg:`` deregisters when the block ends normally (after an error a peer may be gone or stuck,
    so nothing collective runs: the registration then goes with the buffer). ``active`` says
    whether it is still registered."""

    __slots__ = ("_buffer", "_bid", "_id", "tensor", "address", "nbytes")

    def __init__(self, buffer, bid, rid, tensor, address, nbytes):
        # Weak: the Buffer holds its registrations (and its pools theirs, the default out pool's
        # among them), so a strong reference back would make every such Buffer a cycle that only
        # the garbage collector frees, not the caller's last reference (DeepEP's contract for
        # explicitly_destroy=False); its memory would stay held until a collection ran.
        self._buffer = weakref.ref(buffer)
        self._bid, self._id = bid, rid
        self.tensor, self.address, self.nbytes = tensor, address, nbytes

    @property
    def active(self):
        return self._id is not None

    def deregister(self):
        """Collective, bounded by the deadline: waits for this rank's calls that may read the
        tensor, then unmaps the peers' tensors. Raises DestroyedError when it was deregistered
        already or its Buffer is gone."""
        if self._id is None:
            raise DestroyedError("Registration.deregister: the tensor is not registered any more "
                                 "(deregistered, or its Buffer was destroyed)")
        # The tensor stays referenced until the call returns (peers may read it until then); a
        # call that fails before the exchange (ranks in different calls) leaves it registered.
        try:
            _C.deregister_memory(self._bid, self._id)
        except DestroyedError:
            self._drop()
            raise
        self._drop()

    def _drop(self):
        buffer = self._buffer()
        if buffer is not None:
            buffer._registrations.pop(self._id, None)
        self._id, self.tensor = None, None

    def _forget(self):
        """The buffer went: so did the registration (the C library dropped it)."""
        self._id, self.tensor = None, None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self._id is not None:
            self.deregister()

    def __repr__(self):
        state = f"{self.nbytes} bytes at {self.address:#x}" if self._id else "deregistered"
        return f"<epcomm.Registration {state}>"


def register(buffer, bid, tensor, op="Buffer.register"):
    """Registers a contiguous tensor of the buffer's device (collective); see Buffer.register."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{op}: tensor: expected a torch.Tensor, got "
                                f"{type(tensor).__name__}")
    if tensor.device != buffer.device:
        raise InvalidArgumentError(f"{op}: tensor: on {tensor.device}, but the buffer is on "
                                   f"{buffer.device}")
    if not tensor.is_contiguous():
        raise InvalidArgumentError(f"{op}: tensor: not contiguous (strides {tensor.stride()} "
                                   f"for shape {tuple(tensor.shape)})")
    address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    rid = _C.register_memory(bid, address, nbytes)
    reg = Registration(buffer, bid, rid, tensor, address, nbytes)
    buffer._registrations[rid] = reg
    return reg
