"""Helpers of the scenarios (run inside the worker ranks): deterministic inputs of every rank
(each rank builds all of them, so that it can compute the whole reference alone), bit-exact
comparisons, and a checker that collects mismatches so that every rank still makes the same
sequence of collective calls before the scenario fails."""

import os

import torch

BF16, FP8, F32 = torch.bfloat16, torch.float8_e4m3fn, torch.float32
I32, I64 = torch.int32, torch.int64


def gen(seed, r):
    return torch.Generator().manual_seed(seed * 7919 + r * 104729 + 1)


def routing(g, n, E, topk, mask=0.15, dup=0.1):
    """topk_idx int64 [n][topk]: distinct experts per token, some slots -1 (masked) and, with
    dup > 0, some tokens naming an expert twice (normal mode allows it)."""
    if n == 0:
        return torch.zeros((0, topk), dtype=I64)
    idx = torch.rand((n, E), generator=g).topk(topk, dim=1).indices.to(I64)
    if mask:
        idx[torch.rand((n, topk), generator=g) < mask] = -1
    if dup and topk > 1:
        rows = torch.rand(n, generator=g) < dup
        idx[rows, 1] = idx[rows, 0]
    return idx.contiguous()


def bf16(g, *shape, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(BF16)


def raw(t):
    """The bytes of a tensor (on the CPU), to compare bit for bit."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


class Check:
    """Collects mismatches; .done() raises them all at the end of a scenario."""

    def __init__(self, rank, what):
        self.rank, self.what, self.bad = rank, what, []

    def bits(self, got, want, name):
        if got is None or want is None:
            if (got is None) != (want is None):
                self.bad.append(f"{name}: got {type(got).__name__}, want {type(want).__name__}")
            return
        g, w = raw(got), raw(want)
        if g.numel() != w.numel() or not torch.equal(g, w):
            diff = "sizes differ" if g.numel() != w.numel() else \
                f"first differing byte at {int((g != w).nonzero()[0])}"
            self.bad.append(f"{name}: not bit-identical to the reference ({diff}; got shape "
                            f"{tuple(got.shape)}, want {tuple(want.shape)})")

    def eq(self, got, want, name):
        if got != want:
            self.bad.append(f"{name}: got {got!r}, want {want!r}")

    def true(self, cond, msg):
        if not cond:
            self.bad.append(msg)

    def done(self):
        if self.bad:
            raise AssertionError(f"rank {self.rank}, {self.what}:\n  " + "\n  ".join(self.bad))


def ipc_exportable():
    """Whether PyTorch's CUDA memory can be exported through CUDA IPC (registered, pooled): not
    with expandable segments, which every rank then has alike (the pools and registrations of
    the package say no on every rank)."""
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    conf = ",".join(os.environ.get(k, "") for k in names)
    return "expandable_segments:true" not in conf.replace(" ", "").lower()
