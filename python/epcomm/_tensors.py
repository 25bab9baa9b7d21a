"""Checks of the tensors a call takes (each names the call and the argument), and tensors made
over memory that epcomm owns (the low-latency results live in the buffer)."""

import torch

from . import _C
from ._errors import ArgumentTypeError, InvalidArgumentError


def need_tensor(t, op, name, dtype, dims, device, contiguous=True):
    """``t`` must be a tensor of ``dtype`` with ``dims`` dimensions on ``device`` (a
    torch.device), contiguous unless said otherwise. Returns it."""
    # One test for the good case (this runs several times per call); the reasons after it.
    if (isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == dims and
            t.device == device and (not contiguous or t.is_contiguous())):
        return t
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ArgumentTypeError(f"{op}: {name}: dtype {t.dtype}, expected {dtype}")
    if t.dim() != dims:
        raise InvalidArgumentError(f"{op}: {name}: {t.dim()} dimensions {tuple(t.shape)}, "
                                   f"expected {dims}")
    if t.device != device:
        raise InvalidArgumentError(f"{op}: {name}: on {t.device}, but the buffer is on {device}")
    if contiguous and not t.is_contiguous():
        raise InvalidArgumentError(f"{op}: {name}: not contiguous (strides {t.stride()} for "
                                   f"shape {tuple(t.shape)}); pass {name}.contiguous()")
    return t


def need_rows(t, op, name, rows, what):
    if t.size(0) != rows:
        raise InvalidArgumentError(f"{op}: {name}: {t.size(0)} rows, expected {rows} ({what})")


def need_shape(t, op, name, shape, what=""):
    if tuple(t.shape) != tuple(shape):
        more = f" ({what})" if what else ""
        raise InvalidArgumentError(f"{op}: {name}: shape {tuple(t.shape)}, expected "
                                   f"{tuple(shape)}{more}")


_placeholders = {}


def ptr(t):
    """The address to give the C library: 0 for None (not given). An empty tensor's data_ptr()
    is 0 too, which the library would take for "not given" (a rank without tokens still gives
    its weights), so it gets a valid address of its device instead; nothing is read there."""
    if t is None:
        return 0
    p = t.data_ptr()
    if p == 0:
        place = _placeholders.get(t.device)
        if place is None:
            place = _placeholders[t.device] = torch.empty(256, dtype=torch.uint8, device=t.device)
        p = place.data_ptr()
    return p


def over(address, nbytes, dtype, shape, device):
    """A tensor of ``dtype`` and ``shape`` over memory epcomm owns (no copy, through DLPack).
    It stays valid as long as that memory does: the buffer's documented lifetime, not the
    tensor's."""
    cuda = device.type == "cuda"
    raw = torch.from_dlpack(_C.memory_tensor(address, nbytes, 2 if cuda else 1,
                                             device.index if cuda else 0))
    return raw.view(dtype).view(shape)
