"""One rank of a test world (tests/python/_pool.py): joins a gloo process group, then runs the
scenario functions the pytest process sends, replying with their result or traceback. Its
stdout and stderr go to files the pool checks: a correct scenario prints nothing."""

import importlib
import os
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection


class Ctx:
    """What a scenario gets: rank, nranks, device ("cpu" or "cuda") and the process group."""

    def __init__(self, rank, nranks, device, pg):
        self.rank, self.nranks, self.device, self.pg = rank, nranks, device, pg


def main():
    rank, nranks, fd, store, device = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                       sys.argv[4], sys.argv[5])
    conn = Connection(fd)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)  # several ranks share one GPU (under MPS on the GPU machine)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=nranks,
                            timeout=timedelta(seconds=90))
    ctx = Ctx(rank, nranks, device, dist.group.WORLD)
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            break
        name, kwargs = msg
        module, func = name.rsplit(".", 1)
        try:
            result = getattr(importlib.import_module(module), func)(ctx, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # reported to the pytest process, which fails the test
            conn.send(("fail", traceback.format_exc()))
    dist.destroy_process_group()
    conn.send(("bye", None))


if __name__ == "__main__":
    main()
