"""A rank that forgets its teardown (or not, with "clean"): run under `epcomm launch -n R`.
With "leak" it exits with its group and buffer alive, and low-latency results held."""

import os
import sys
import time

import torch

import epcomm

mode = sys.argv[1]
group = epcomm.init()
buf = epcomm.Buffer(group, device="cpu")
R, me = group.nranks, group.rank
E, T, H = 2 * R, 4, 128
idx = torch.arange(2, dtype=torch.int64).repeat(T, 1) + 2 * me
idx %= E
x = torch.ones((T, H), dtype=torch.bfloat16)
recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
out, _, _ = buf.combine(recv_x, handle)
ll = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
print(f"rank {me}: 1 passed, 0 failed")
if mode == "fork":  # a forked child's exit says nothing about its parent's objects
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a normal exit: the exit handlers run in the child
    assert os.waitpid(pid, 0)[1] == 0
if mode in ("clean", "fork"):
    del ll, handle
    buf.destroy()
    group.destroy()
elif mode == "peer-gone":  # rank 1 vanishes (no exit handlers); rank 0 leaves after it
    sys.stdout.flush()
    if me == 1:
        os._exit(0)
    time.sleep(0.5)
