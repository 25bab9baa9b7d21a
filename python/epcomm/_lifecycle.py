"""What happens to epcomm objects that are never destroyed.

Nothing collective may run at exit: a peer may be gone already, and waiting for it is how exits
hang. So an object still alive when the interpreter exits is *released* (freed locally, without
talking to the peers), and the process prints ONE line on stderr, in the format of epcomm's
own log lines so that ``epcomm doctor`` classifies it, naming the objects and the fix. The C
library's exit hook would report the same objects again, naming C functions; releasing them
first leaves it nothing to report.

An object garbage-collected during the run is released the same way (the DeepEP contract of
``explicitly_destroy=False``); one created to be destroyed explicitly also warns
(LifecycleWarning).
"""

import atexit
import os
import socket
import sys
import threading
import weakref

_live = weakref.WeakSet()  # objects with a C side not destroyed yet
_lock = threading.Lock()
_exiting = False


def track(obj):
    obj._pid = os.getpid()
    with _lock:
        _live.add(obj)


def mine(obj):
    """Whether this process made obj: a forked child holds copies of its parent's objects, which
    are the parent's to destroy (the library refuses them in the child: EP_ERR_FORKED)."""
    return getattr(obj, "_pid", None) == os.getpid()


def untrack(obj):
    with _lock:
        _live.discard(obj)


def exiting():
    return _exiting


def _describe(objs):
    counts = {}
    for o in objs:
        counts[o._kind] = counts.get(o._kind, 0) + 1
    return " and ".join(f"{n} epcomm.{k}" + ("s" if n > 1 else "")
                        for k, n in sorted(counts.items()))


def _rank_of(objs):
    for o in objs:
        r = getattr(o, "rank", None)
        if isinstance(r, int):
            return r
    return "?"


@atexit.register
def _at_exit():
    global _exiting
    _exiting = True
    with _lock:
        objs = [o for o in _live if o._alive() and mine(o)]
        _live.clear()
    _drop_parked_pools()
    if not objs:
        return
    line = (f"epcomm: warn: {socket.gethostname()}:{os.getpid()} [rank {_rank_of(objs)}] exit: "
            f"{_describe(objs)} still alive at exit, released without talking to the peers; "
            f"call buffer.destroy() (then group.destroy() for a group of epcomm.init()) on every "
            f"rank before exit, or create them in a `with` block\n")
    # Buffers before groups: a group refuses to go while its buffers live.
    for o in sorted(objs, key=lambda o: o._release_order):
        o._release_quietly()
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except Exception:  # stderr closed: nothing left to tell
        pass


def _drop_parked_pools():
    """The pools of Buffers the garbage collector released (_mempool.park) go now, while CUDA is
    whole, rather than in the interpreter's teardown, where their destructors' CUDA calls may
    find the driver gone."""
    mempool = sys.modules.get("epcomm._mempool")
    if mempool is not None:
        try:
            mempool.collect()
        except Exception:  # exiting: nothing to report it to
            pass


class Scoped:
    """`with` for the collective objects (Group, Buffer): destroy() when the block ends normally;
    after an error a peer may be gone or stuck, so release() frees locally instead of waiting."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.destroy()
        else:
            self.release()
