"""Exceptions. Every error from the C library is an ``EpcommError`` carrying the library's
message (which names the argument, or the operation, phase and peer rank) and its status:
``.status`` is the status name ("EP_ERR_TIMEOUT"), ``.code`` its number. Subclasses group the
statuses by what a caller does about them; they also derive from the matching built-in
exception (ValueError, TimeoutError, ...), so generic handlers keep working.

Bad arguments found by the Python layer (a wrong dtype, shape, device, a non-contiguous
tensor, an argument epcomm does not implement) raise the same classes, naming the argument.
"""

from . import _C

__all__ = [
    "EpcommError", "InvalidArgumentError", "ArgumentTypeError", "TooLargeError", "MismatchError",
    "OutOfMemoryError", "SystemCallError", "BootstrapError", "EpcommTimeoutError",
    "PeerFailedError", "PeerInvalidError", "DestroyedError", "BusyError", "BrokenError",
    "UnsupportedError", "ForkedError", "CudaError", "InternalError", "LifecycleWarning",
]


def _status_names():
    return [_C.status_name(code)[0] for code in range(_C.STATUS_COUNT)]


_NAMES = _status_names()


class EpcommError(RuntimeError):
    """An epcomm call failed. ``str(e)`` is the library's message; ``e.status`` the status
    name (e.g. "EP_ERR_PEER_FAILED") and ``e.code`` its number."""

    status = "EP_ERR_INTERNAL"

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is None:
            code = _NAMES.index(type(self).status)
        self.code = code
        self.status = _NAMES[code]


class InvalidArgumentError(EpcommError, ValueError):
    """An argument is wrong: NULL, out of range, a shape or device epcomm cannot take. Raised on
    the rank that passed it; its peers in the same collective call get PeerInvalidError."""

    status = "EP_ERR_INVALID_ARG"


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type or dtype (found by the Python layer)."""


class TooLargeError(InvalidArgumentError):
    """More than a buffer or an output holds (the message gives the count needed)."""

    status = "EP_ERR_TOO_LARGE"


class MismatchError(EpcommError):
    """Ranks disagree on what every rank must pass alike (the field and a rank are named)."""

    status = "EP_ERR_MISMATCH"


class OutOfMemoryError(EpcommError, MemoryError):
    status = "EP_ERR_NO_MEMORY"


class SystemCallError(EpcommError):
    status = "EP_ERR_SYSTEM"


class BootstrapError(EpcommError):
    """The ranks could not meet: no rank in the environment, or a bootstrap callback failed."""

    status = "EP_ERR_BOOTSTRAP"


class EpcommTimeoutError(EpcommError, TimeoutError):
    """A peer did not arrive before the deadline (named in the message). The buffer is broken:
    destroy it."""

    status = "EP_ERR_TIMEOUT"


class PeerFailedError(EpcommError):
    """A peer rank died (named, with its signal when the launcher knows it). The buffer is
    broken: destroy it."""

    status = "EP_ERR_PEER_FAILED"


class PeerInvalidError(EpcommError):
    """A peer rejected its arguments of this collective call; its own error names them."""

    status = "EP_ERR_PEER_INVALID"


class DestroyedError(EpcommError):
    """The object was already destroyed."""

    status = "EP_ERR_DESTROYED"


class BusyError(EpcommError):
    """The object is in use: a call in flight, or two low-latency results alive."""

    status = "EP_ERR_BUSY"


class BrokenError(EpcommError):
    """An earlier collective failure broke the object; only destroy remains."""

    status = "EP_ERR_BROKEN"


class UnsupportedError(EpcommError, NotImplementedError):
    """Not supported by this build, backend, or by epcomm at all (the argument is named)."""

    status = "EP_ERR_UNSUPPORTED"


class ForkedError(EpcommError):
    """The object belongs to the process that created it; this one was forked from it."""

    status = "EP_ERR_FORKED"


class CudaError(EpcommError):
    status = "EP_ERR_CUDA"


class InternalError(EpcommError):
    status = "EP_ERR_INTERNAL"


class LifecycleWarning(UserWarning):
    """An epcomm object was garbage-collected without destroy(): it was released locally."""


_BY_STATUS = {
    "EP_ERR_INVALID_ARG": InvalidArgumentError, "EP_ERR_NULL_ARG": InvalidArgumentError,
    "EP_ERR_OUT_OF_RANGE": InvalidArgumentError, "EP_ERR_SHAPE": InvalidArgumentError,
    "EP_ERR_CONFIG": InvalidArgumentError, "EP_ERR_TOO_LARGE": TooLargeError,
    "EP_ERR_MISMATCH": MismatchError, "EP_ERR_NO_MEMORY": OutOfMemoryError,
    "EP_ERR_SYSTEM": SystemCallError, "EP_ERR_BOOTSTRAP": BootstrapError,
    "EP_ERR_TIMEOUT": EpcommTimeoutError, "EP_ERR_PEER_FAILED": PeerFailedError,
    "EP_ERR_PEER_INVALID": PeerInvalidError, "EP_ERR_DESTROYED": DestroyedError,
    "EP_ERR_BUSY": BusyError, "EP_ERR_BROKEN": BrokenError,
    "EP_ERR_UNSUPPORTED": UnsupportedError, "EP_ERR_CUDA": CudaError, "EP_ERR_FORKED": ForkedError,
    "EP_ERR_INTERNAL": InternalError,
}

# The C layer raises these directly, by status code.
_C.set_error_classes(tuple(_BY_STATUS.get(name, EpcommError) for name in _NAMES))
