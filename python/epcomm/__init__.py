"""epcomm: expert-parallel (MoE dispatch/combine) communication.

    import epcomm
    group = epcomm.init()                       # ranks from epcomm launch, torchrun or mpirun
    with epcomm.Buffer(group, device="cpu") as buf:
        ...                                     # DeepEP's Buffer API (epcomm.deep_ep)
    group.destroy()

``epcomm.Buffer`` is call-compatible with ``deep_ep.Buffer`` for what epcomm implements;
``import epcomm.deep_ep as deep_ep`` runs DeepEP programs (README.md: "Python"). Importing
``epcomm`` does not import torch; ``epcomm.Buffer`` and the modules that need it do.
"""

import subprocess as _subprocess

from . import _C
from ._errors import *  # noqa: F401,F403 (the exception classes are part of the API)
from ._errors import __all__ as _error_names
from ._group import Group, init
from ._paths import cli as cli_path, library as library_path, include_dir

__version__ = _C.version()[0]

__all__ = ["init", "Group", "Buffer", "EventOverlap", "EventHandle", "Config", "doctor",
           "cli_path", "library_path", "include_dir", "backend_available", "__version__"]
__all__ += list(_error_names)

# Names whose modules import torch: loaded on first use.
_LAZY = {"Buffer": "._buffer", "EventOverlap": "._events", "EventHandle": "._events",
         "Config": "._config", "deep_ep": ".deep_ep"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod = importlib.import_module(_LAZY[name], __name__)
        value = mod if name == "deep_ep" else getattr(mod, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epcomm' has no attribute {name!r}")


def backend_available(device):
    """(available, why not) for "cpu" or "cuda" in this build and on this machine."""
    backends = {"cpu": _C.BACKEND_CPU, "cuda": _C.BACKEND_CUDA}
    if device not in backends:
        raise InvalidArgumentError(f"backend_available: device {device!r}: 'cpu' or 'cuda'")
    return _C.backend_available(backends[device])


def doctor(*args, **run_kwargs):
    """Runs ``epcomm doctor ARGS`` (run, env, verify, rules: docs/DOCTOR.md) and returns its
    subprocess.CompletedProcess; e.g. ``epcomm.doctor("verify", "--", "python", "-m",
    "pytest", "tests")``. Keyword arguments go to subprocess.run."""
    return _subprocess.run([cli_path(), "doctor", *args], **run_kwargs)
