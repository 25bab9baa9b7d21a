"""DeepEP's Python API on epcomm: a DeepEP program runs with its import changed to

    import epcomm.deep_ep as deep_ep      # or: from epcomm import deep_ep

Buffer, Config, EventOverlap, EventHandle and topk_idx_t are here as DeepEP has them. What
epcomm does not implement raises UnsupportedError naming the argument (README.md, "Python":
the migration note lists what maps and what does not)."""

import torch

from ._buffer import Buffer
from ._config import Config
from ._events import EventHandle, EventOverlap

topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]
