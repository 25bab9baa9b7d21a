"""Outputs of a Buffer's next calls, allocated while a dispatch's host waits for its receive
count (the C library's ep_dispatch_out_t.on_wait).

At small batches a MoE layer step on CUDA is bound by the host: a synchronous dispatch spins
until the count exchange is in, and each of the step's other calls then spends 5-8 us of host
time per ``torch.empty`` (nine of them per step). Allocated during that spin instead, the
combine's output and the next step's layout outputs and rank prefix cost nothing on the
critical path. A spare is only used by a call that would have allocated the same shape on the
same stream (the caching allocator's blocks belong to the stream they were made on) and runs on
it directly; anything else drops it, and the call allocates as before. Results do not change:
a spare is a fresh ``torch.empty`` that nothing else has seen. A spare comes from whatever pool
is current when the dispatch runs (``torch.cuda.use_mem_pool``), not when its call does.
"""

import torch

_I32, _BF16 = torch.int32, torch.bfloat16


# The outputs' (shape, dtype), for the Buffer's calls and their spares alike.
def layout_specs(R, E, n):
    """get_dispatch_layout's: tokens per rank, selections per expert, is_token_in_rank."""
    return ((R,), _I32), ((E,), _I32), ((n, R), torch.bool)


def prefix_spec(R):
    """dispatch's rank_prefix_matrix."""
    return (R, R), _I32


def combine_spec(n, H):
    """combine's combined_x."""
    return (n, H), _BF16


class Spares:
    """One Buffer's spares (CUDA only). ``enabled = False`` turns this Buffer's off
    (bench/py_host_cost.py times both)."""

    # A combine output is made ahead only up to this size: beyond it the host is not what bounds
    # a step, and the output would be held through the experts' work for nothing.
    COMBINE_LIMIT = 8 << 20

    __slots__ = ("device", "R", "enabled", "layout", "prefix", "_job", "used", "combines")

    def __init__(self, device, R):
        self.device, self.R = device, R
        self.enabled = True
        self.layout = None  # (stream, n, E, (tokens_per_rank, tokens_per_expert, in_rank))
        self.prefix = None  # (stream, rank_prefix [R][R])
        self._job = None
        self.used = 0  # spares taken by calls (tests, benches)
        # combine outputs made, and taken, since the last one that was not: a program whose
        # combines never take them (another stream, async) gets one every other dispatch
        self.combines = [0, 0]

    def job(self, stream, n, E, H):
        """The on_wait callable of one dispatch on ``stream`` (n tokens, E experts, hidden H),
        or None when off: step by step the combine output for its handle (finish() hands it
        over after the call), the next dispatch's rank prefix, the next layout's three
        outputs."""
        if not self.enabled:
            return None
        self._job = _Job(self, stream, n, E, H)
        return self._job.step

    def finish(self):
        """(stream, combine output) of the dispatch that just returned, or None."""
        job, self._job = self._job, None
        if job is None or job.combine is None:
            return None
        return job.stream, job.combine

    def take_layout(self, stream, n, E):
        got, self.layout = self.layout, None
        if got is None or got[:3] != (stream, n, E):
            return None
        self.used += 1
        return got[3]

    def take_prefix(self, stream):
        got, self.prefix = self.prefix, None
        if got is None or got[0] != stream:
            return None
        self.used += 1
        return got[1]

    def take_combine(self, spare, stream, shape):
        if spare is None or spare[0] != stream or tuple(spare[1].shape) != shape:
            return None
        self.used += 1
        self.combines[1] += 1
        return spare[1]

    def want_combine(self):
        """Whether to make a combine output: not when the last one made was not taken (then
        the count starts again, so a program that changes its ways is found again)."""
        made, taken = self.combines
        if made > taken:
            self.combines = [0, 0]
            return False
        self.combines[0] += 1
        return True


class _Job:
    __slots__ = ("spares", "stream", "n", "E", "H", "combine", "parts")

    def __init__(self, spares, stream, n, E, H):
        self.spares, self.stream, self.n, self.E, self.H = spares, stream, n, E, H
        self.combine = None
        self.parts = []

    def step(self, k):
        """One allocation per step (the C call checks the count between steps); False when
        there is nothing more to make, or an allocation failed (the calls then make their own,
        and report what they must)."""
        try:
            return self._make(k)
        except (RuntimeError, MemoryError):  # torch.cuda.OutOfMemoryError is a RuntimeError
            return False

    def _make(self, k):
        s, n = self.spares, self.n
        if k == 0:
            if n * self.H * 2 <= Spares.COMBINE_LIMIT and s.want_combine():
                self.combine = self._empty(combine_spec(n, self.H))
        elif k == 1:
            s.prefix = (self.stream, self._empty(prefix_spec(s.R)))
        else:  # the layout's outputs, one a step
            specs = layout_specs(s.R, self.E, n)
            self.parts.append(self._empty(specs[k - 2]))
            if len(self.parts) < len(specs):
                return True
            s.layout = (self.stream, n, self.E, tuple(self.parts))
            return False
        return True

    def _empty(self, spec):
        shape, dtype = spec
        return torch.empty(shape, dtype=dtype, device=self.spares.device)
