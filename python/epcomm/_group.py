"""epcomm.Group: the ranks of one job. Made from the launcher's environment (epcomm.init()),
from a torch.distributed process group of any backend, from an mpi4py communicator, or from any
pair of allgather/barrier callables. The callables are used only while the group is created
(to agree on a rendezvous name); epcomm then talks over its own local sockets, so it never
creates an NCCL communicator and never calls the framework again."""

import warnings

from . import _C, _lifecycle
from ._errors import (ArgumentTypeError, BusyError, DestroyedError, InvalidArgumentError,
                      LifecycleWarning)


class Group(_lifecycle.Scoped):
    """The ranks of one job on this host. Create it on every rank, destroy it on every rank
    (``destroy()``, or a ``with`` block) after the buffers made from it."""

    _kind = "Group"
    _release_order = 1

    def __init__(self, _gid, *, explicitly_destroy=True):
        self._id = _gid
        self.rank, self.nranks = _C.group_info(_gid)
        self._explicit = explicitly_destroy
        _lifecycle.track(self)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_env(cls, timeout_s=0.0, job_id=None):
        """Collective. Ranks from `epcomm launch`, torchrun or mpirun (docs/LIFECYCLE.md)."""
        return cls(_C.group_create_from_env(float(timeout_s), job_id))

    @classmethod
    def from_callbacks(cls, rank, nranks, allgather, barrier=None, timeout_s=0.0):
        """Collective. ``allgather(data: bytes) -> bytes``: every rank's data, concatenated in
        rank order; ``barrier()``: optional. An exception in a callback fails the creation
        (BootstrapError, with the exception as its cause)."""
        return cls(_C.group_create(int(rank), int(nranks), allgather, barrier, float(timeout_s)))

    @classmethod
    def from_process_group(cls, pg=None, timeout_s=0.0):
        """Collective over a torch.distributed process group (gloo, nccl, ...); None: WORLD."""
        import torch
        import torch.distributed as dist

        if pg is None:
            pg = dist.group.WORLD
        rank, nranks = dist.get_rank(pg), dist.get_world_size(pg)
        # A byte tensor where the group's backend takes it: the current GPU for nccl alone.
        device = torch.device("cuda", torch.cuda.current_device()) if str(
            dist.get_backend(pg)) == "nccl" else torch.device("cpu")

        def allgather(data):
            # Tensors, not all_gather_object, which needs numpy. Once or twice per group.
            mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
            out = torch.empty(nranks * len(data), dtype=torch.uint8, device=device)
            dist.all_gather_into_tensor(out, mine, group=pg)
            return bytes(out.cpu().tolist())

        def barrier():
            # A barrier as an allgather: dist.barrier() on nccl guesses a device and warns.
            allgather(b"\0")

        return cls.from_callbacks(rank, nranks, allgather, barrier, timeout_s)

    @classmethod
    def from_mpi(cls, comm, timeout_s=0.0):
        """Collective over an mpi4py communicator."""
        return cls.from_callbacks(comm.Get_rank(), comm.Get_size(),
                                  lambda data: b"".join(comm.allgather(data)), comm.Barrier,
                                  timeout_s)

    # ---------------------------------------------------------------- use
    def _gid(self, op):
        if self._id is None:
            raise DestroyedError(f"{op}: the group was destroyed")
        return self._id

    def size(self):
        return self.nranks

    def barrier(self):
        """Collective, bounded by the group's deadline."""
        _C.group_barrier(self._gid("Group.barrier"))

    def allgather(self, data):
        """Collective: every rank's ``data`` (bytes of the same length on every rank), as a list
        in rank order."""
        if not isinstance(data, (bytes, bytearray)):
            raise ArgumentTypeError(f"Group.allgather: data: bytes, not {type(data).__name__}")
        raw = _C.group_allgather(self._gid("Group.allgather"), bytes(data))
        n = len(raw) // self.nranks
        return [raw[i * n:(i + 1) * n] for i in range(self.nranks)]

    # ---------------------------------------------------------------- teardown
    def destroy(self):
        """Collective, bounded by the deadline: after every buffer of the group is destroyed.
        A second call does nothing."""
        gid, self._id = self._id, None
        if gid is None:
            return
        _lifecycle.untrack(self)
        try:
            _C.group_destroy(gid)
        except BusyError:  # buffers still alive: nothing was destroyed, the group stays usable
            self._id = gid
            _lifecycle.track(self)
            raise

    def release(self):
        """Local: frees this rank's side without talking to the peers (after a peer failed)."""
        gid, self._id = self._id, None
        if gid is not None:
            _lifecycle.untrack(self)
            _C.group_release(gid)

    def _alive(self):
        return self._id is not None

    def _release_quietly(self):
        gid, self._id = self._id, None
        if gid is not None:
            try:
                _C.group_release(gid)
            except Exception:
                pass

    def __del__(self):
        if (getattr(self, "_id", None) is None or _lifecycle.exiting() or
                not _lifecycle.mine(self)):
            return
        self._release_quietly()
        if self._explicit:
            warnings.warn(f"epcomm.Group (rank {self.rank}) garbage-collected without destroy(); "
                          f"released locally. Call group.destroy() on every rank.",
                          LifecycleWarning, stacklevel=2)

    def __repr__(self):
        state = "destroyed" if self._id is None else f"rank {self.rank} of {self.nranks}"
        return f"<epcomm.Group {state}>"


def init(timeout_s=0.0, job_id=None):
    """The group of this job, from the environment that `epcomm launch`, torchrun (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or mpirun set. Collective."""
    if timeout_s < 0:
        raise InvalidArgumentError(f"epcomm.init: timeout_s is {timeout_s}, must be >= 0")
    return Group.from_env(timeout_s, job_id)
