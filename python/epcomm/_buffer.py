"""epcomm.Buffer: DeepEP's Buffer API (deep_ep.Buffer) over epcomm's C library.

One Buffer holds up to two epcomm buffers of one group: the normal-mode buffer, made with the
Buffer, and the low-latency buffer (_ll.py), whose sizes DeepEP gives only with each call, made
by the first low-latency call (collective, like the call itself). Tensors are checked here
(dtype, shape, device, contiguity: each error names the argument), outputs are allocated with
torch.empty, and the C library gets their addresses.
"""

import array
import os
import struct
import warnings

import torch

from . import _C, _lifecycle
from ._config import Config
from ._errors import (ArgumentTypeError, CudaError, DestroyedError, InvalidArgumentError,
                      LifecycleWarning, PeerInvalidError, UnsupportedError)
from ._events import CpuLaunch, CudaLaunch, EventHandle, EventOverlap
from ._group import Group
from ._handles import DispatchHandle, Info, Ref
from ._ll import LowLatency
from ._mempool import OutPool as _OutPool, collect as _collect_arenas, mem_pool as _mem_pool
from ._mempool import park as _park_pools, refuse as _refuse_pool, room_for as _room_for
from ._mempool import supported as _pool_supported
from ._registration import register as _register
from ._spares import Spares, combine_spec, layout_specs, prefix_spec
from ._tensors import need_rows, need_shape, need_tensor, over, ptr

_BF16, _FP8, _F32, _I32, _I64 = (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32,
                                 torch.int64)
_MAX_QUEUE = 256 << 20
# What a failed out pool raises on every rank alike (the registration is agreed on: the rank
# that failed has its own error, its peers PeerInvalidError): the Buffer goes on without one.
_NO_POOL = (torch.cuda.OutOfMemoryError, MemoryError, UnsupportedError, PeerInvalidError,
            CudaError, InvalidArgumentError)


def _device(device):
    if device is None:
        env = os.environ.get("EP_BACKEND", "")
        if env in ("cpu", "cuda"):
            device = env
        elif torch.cuda.is_available() and _C.backend_available(_C.BACKEND_CUDA)[0]:
            device = "cuda"
        else:
            device = "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"Buffer: device {device!r}: {e}") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"Buffer: device {device}: epcomm has 'cpu' and 'cuda' buffers")
    return device


def _group_of(group, comm, timeout_s):
    """(epcomm.Group, owned): the Buffer destroys a group it made itself."""
    if isinstance(group, Group):
        return group, False
    if group is not None:
        return Group.from_process_group(group, timeout_s), True
    if comm is not None:
        return Group.from_mpi(comm, timeout_s), True
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Group.from_process_group(None, timeout_s), True
    return Group.from_env(timeout_s), True


class _Rows:
    """The row outputs of one dispatch, allocated by the C library's callback once the receive
    count is known (or up front for num_worst_tokens); returns their addresses."""

    __slots__ = ("device", "H", "dtype", "S", "topk", "weights", "x", "scales", "idx", "w", "src",
                 "pool")

    def __init__(self, device, H, dtype, S, topk, weights, pool=None):
        self.device, self.H, self.dtype, self.S = device, H, dtype, S
        self.topk, self.weights, self.pool = topk, weights, pool
        self.x = self.scales = self.idx = self.w = self.src = None

    def __call__(self, rows):
        dev = self.device
        # recv_x from the Buffer's registered pool when it has room (_mempool.OutPool)
        self.x = self.pool.empty((rows, self.H), self.dtype, dev) if self.pool else None
        if self.x is None:
            self.x = torch.empty((rows, self.H), dtype=self.dtype, device=dev)
        if self.S:
            self.scales = torch.empty((rows, self.S), dtype=_F32, device=dev)
        if self.topk:
            self.idx = torch.empty((rows, self.topk), dtype=_I64, device=dev)
        if self.weights:
            self.w = torch.empty((rows, self.topk), dtype=_F32, device=dev)
        self.src = torch.empty((rows,), dtype=_I32, device=dev)
        return ptr(self.x), ptr(self.scales), ptr(self.idx), ptr(self.w), ptr(self.src)


class Buffer(LowLatency, _lifecycle.Scoped):
    """DeepEP's Buffer on epcomm (README.md, "Python": what maps and what does not).

    ``group``: a torch.distributed ProcessGroup (any backend), an epcomm.Group, or None (the
    default process group when torch.distributed is initialized, else epcomm.init()).
    ``num_nvl_bytes``: on CUDA, the size of the receive and combine areas (on CPU any number of
    tokens goes through the default queues). ``num_rdma_bytes``, ``num_qps_per_rank``,
    ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``use_fabric``: accepted, no effect
    (one host, no RDMA). epcomm's own keywords: ``device`` ("cpu", "cuda", "cuda:N"; default:
    EP_BACKEND, else CUDA when available), ``queue_bytes``, ``num_channels``, ``timeout_s``, and
    the low-latency sizes ``ll_max_tokens``, ``ll_hidden``, ``ll_num_experts``,
    ``ll_max_topk`` to create the low-latency side now instead of at its first call, and
    ``out_pool_bytes`` (CUDA): a registered arena of that many bytes where dispatch makes its
    recv_x (a combine of it reads it in place, and the senders write the rows straight there
    through the late hello, on unless EP_CUDA_LATE_HELLO=0; a recv_x that does not fit is a
    plain tensor). None (default): num_nvl_bytes / 2 (device memory held as long as the
    Buffer, beside the num_nvl_bytes of the receive and combine areas); 0: none. Collective, so
    the same on every rank. Measured on an H100 in two runs with DeepEP's (docs/PERFORMANCE.md):
    a layer step 1.7-2.8x faster than without it at 4096 tokens per rank; at 128 tokens
    0.82-1.11x on 2 and 4 ranks and 1.22-1.50x on 8 (four to ten runs each).
    """

    num_sms = 20
    _kind = "Buffer"
    _release_order = 0

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 use_fabric=False, explicitly_destroy=False, enable_shrink=False, comm=None, *,
                 device=None, queue_bytes=0, num_channels=0, timeout_s=0.0, ll_max_tokens=0,
                 ll_hidden=0, ll_num_experts=0, ll_max_topk=0, out_pool_bytes=None):
        self._normal = self._llbuf = self._group = None
        _collect_arenas()  # pools of buffers the garbage collector released go here at the latest
        self._registrations = {}  # registration id -> Registration (Buffer.register)
        self._pools = []  # MemPool (Buffer.mem_pool): their arenas close with the buffer
        self._out_pool = None  # where dispatch puts recv_x by default (_mempool.OutPool)
        if out_pool_bytes is not None and (isinstance(out_pool_bytes, bool) or
                                           not isinstance(out_pool_bytes, int) or
                                           out_pool_bytes < 0):
            raise InvalidArgumentError(f"Buffer: out_pool_bytes is {out_pool_bytes!r}, must be an "
                                       f"int >= 0 (0: none) or None (the default: half of "
                                       f"num_nvl_bytes)")
        if enable_shrink:
            raise UnsupportedError("Buffer: enable_shrink=True (masking failed ranks) is not "
                                   "supported by epcomm: a rank that dies makes its peers' calls "
                                   "fail with PeerFailedError instead")
        self.device = _device(device)
        self._group, self._owns_group = _group_of(group, comm, timeout_s)
        self.rank, self.group_size = self._group.rank, self._group.nranks
        self.group = group if group is not None else comm
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.enable_shrink = False
        self._cuda = self.device.type == "cuda"
        self._comm_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._direct = True  # synchronous calls may run on the current stream (_events)
        # the waits between the compute and the communication stream (_events._follow)
        self._order = (torch.cuda.Event(), torch.cuda.Event()) if self._cuda else None
        self._opts = dict(queue_bytes=queue_bytes, num_channels=num_channels,
                          timeout_s=float(timeout_s))
        self._rtpe = array.array("i")  # scratch of dispatch's per-expert counts (CUDA: pinned)
        # outputs of the next calls, made while a dispatch waits for its count (_spares)
        self._spares = Spares(self.device, self.group_size) if self._cuda else None
        LowLatency.__init__(self)
        _lifecycle.track(self)
        try:
            if num_nvl_bytes > 0 or not low_latency_mode:
                self._normal = self._create(self._normal_queue_bytes(queue_bytes, num_channels))
                self._out_pool = self._make_out_pool(out_pool_bytes)
            if ll_max_tokens or ll_hidden or ll_num_experts:
                self._ll_create((ll_max_tokens, ll_hidden, ll_num_experts, ll_max_topk))
        except BaseException:
            self._release_quietly()  # the peers failed the same collective call
            raise

    # ---------------------------------------------------------------- creation
    def _normal_queue_bytes(self, queue_bytes, num_channels):
        """CUDA: DeepEP's num_nvl_bytes becomes the receive and combine areas of R x channels
        queues each. CPU: the default queues carry any number of tokens."""
        if queue_bytes or not self._cuda or self.num_nvl_bytes <= 0:
            return queue_bytes
        per = self.num_nvl_bytes // (2 * self.group_size * max(num_channels, 1))
        return min(per, _MAX_QUEUE) // 4096 * 4096

    def _make_out_pool(self, nbytes):
        """CUDA: the registered arena of dispatch's default recv_x (collective: the same
        decision on every rank). None (the default): the receive area's size (num_nvl_bytes /
        2), made only where an eighth of the device's memory stays free after it (an optional
        pool must not take what the program's own tensors will need); 0: none. No room or no
        arena here (out of memory, every arena slot taken), memory IPC cannot export (expandable
        segments), a failed registration, or a PyTorch without MemPool: none, on every rank
        (this rank takes part in the registration with nothing, or the registration fails on
        every rank), and recv_x is a plain tensor. A peer that died or a deadline still
        raises."""
        if not self._cuda:
            return None
        headroom = 0.0
        if nbytes is None:
            nbytes, headroom = max(int(self.num_nvl_bytes), 0) // 2, 0.125
        if nbytes == 0:
            return None
        if not _pool_supported():  # every rank alike (one PyTorch), before anything collective
            return None
        try:
            if not _room_for(self.device, nbytes, headroom):
                _refuse_pool(self.register, self.device)  # the peers hear it in the registration
                return None
            p = _mem_pool(self, self.register, nbytes, "Buffer(out_pool_bytes)")
        except _NO_POOL:
            _collect_arenas()  # an arena made and closed here goes back now, not at destroy
            return None
        self._pools.append(p)
        return _OutPool(p)

    def _config(self, queue_bytes, ll=(0, 0, 0, 0)):
        backend = _C.BACKEND_CUDA if self._cuda else _C.BACKEND_CPU
        # Buffer.num_sms is DeepEP's budget of its high-throughput kernels: normal mode only;
        # the low-latency kernels take the library's default (the rank's share of the GPU).
        sms = Buffer.num_sms if self._cuda and not ll[0] else 0
        return (backend, queue_bytes, self._opts["num_channels"], *ll, self._opts["timeout_s"],
                self.device.index if self._cuda else -1, sms)

    def _create(self, queue_bytes, ll=(0, 0, 0, 0)):
        return _C.buffer_create(self._group._gid("Buffer"), *self._config(queue_bytes, ll))

    # ---------------------------------------------------------------- DeepEP's statics
    @staticmethod
    def is_sm90_compiled():
        """True: epcomm moves fp8 tokens (with their scales) on every backend."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms):
        """CUDA thread blocks of the data kernels of Buffers created after this call (capped by
        the library at the GPU's SMs divided by the ranks sharing it)."""
        if not isinstance(new_num_sms, int) or new_num_sms < 1:
            raise InvalidArgumentError(f"Buffer.set_num_sms: {new_num_sms!r}, must be an int >= 1")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        """An EventOverlap at the current point of the current CUDA stream."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks):
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    def get_comm_stream(self):
        if not self._cuda:
            raise UnsupportedError("Buffer.get_comm_stream: a CPU buffer has no stream")
        self._direct = False  # the caller may queue work there: every call goes there (_events)
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        raise UnsupportedError("Buffer.get_local_buffer_tensor: epcomm does not expose its raw "
                               "buffer memory (its layout is private)")

    def internode_dispatch(self, *args, **kwargs):
        raise UnsupportedError("Buffer.internode_dispatch: epcomm runs on one host")

    def internode_combine(self, *args, **kwargs):
        raise UnsupportedError("Buffer.internode_combine: epcomm runs on one host")

    # ---------------------------------------------------------------- shared helpers
    def _buf(self, op):
        if self._normal is None:
            if self._group is None:
                raise DestroyedError(f"{op}: the buffer was destroyed")
            raise InvalidArgumentError(f"{op}: this Buffer has no normal mode (created with "
                                       f"low_latency_mode=True and num_nvl_bytes=0)")
        return self._normal

    def _launch(self, previous_event, async_finish, allocate_on_comm_stream, on_compute=False,
                after_compute=False):
        if self._cuda:
            return CudaLaunch(self._comm_stream, self._order, self.device, previous_event,
                              async_finish, allocate_on_comm_stream, on_compute, after_compute,
                              self._direct)
        return CpuLaunch(previous_event, async_finish)

    def _empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _spare_stream(self, launch):
        """The stream a call may take spares on (_spares): the current one, when the call runs
        there directly; else None (no spares)."""
        if self._spares is None or not launch.direct or launch.compute is not None:
            return None
        return launch.stream

    def _topk(self, op, topk_idx, n, name="topk_idx"):
        need_tensor(topk_idx, op, name, _I64, 2, self.device)
        need_rows(topk_idx, op, name, n, "one row per token")
        return topk_idx.size(1)

    # ---------------------------------------------------------------- layout
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """(num_tokens_per_rank int32 [R], None, num_tokens_per_expert int32 [E],
        is_token_in_rank bool [N][R], EventOverlap). Local. On CUDA it does not wait for its
        kernel; a bad expert id is reported by the dispatch that takes it."""
        op = "Buffer.get_dispatch_layout"
        buf = self._buf(op)
        need_tensor(topk_idx, op, "topk_idx", _I64, 2, self.device)
        n, topk, R = topk_idx.size(0), topk_idx.size(1), self.group_size
        launch = self._launch(previous_event, async_finish, allocate_on_comm_stream)
        try:
            st = self._spare_stream(launch)
            spare = self._spares.take_layout(st, n, num_experts) if st is not None else None
            if spare is None:
                spare = tuple(self._empty(*spec) for spec in layout_specs(R, num_experts, n))
            tpr, tpe, itr = spare
            # As DeepEP's, the call does not wait for its kernel: a bad expert id is reported
            # by the dispatch that takes it (OutOfRangeError naming the slot).
            _C.layout(buf, ptr(topk_idx), n, topk, num_experts, launch.stream,
                      ptr(tpr), ptr(tpe), ptr(itr), 1)
        except BaseException:
            launch.abort()
            raise
        return tpr, None, tpe, itr, launch.finish((topk_idx, tpr, tpe, itr))

    # ---------------------------------------------------------------- dispatch
    def _split_x(self, x, op):
        """(x, scales, dtype code): bf16 [N][H], or a (fp8 [N][H], float32 [N][S]) tuple whose
        scales may have any strides (DeepEP passes them column-major)."""
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise InvalidArgumentError(f"{op}: x: a tuple must be (fp8 tensor, scales)")
            data, scales = x
            need_tensor(data, op, "x[0]", _FP8, 2, self.device)
            need_tensor(scales, op, "x[1] (scales)", _F32, 2, self.device, contiguous=False)
            need_rows(scales, op, "x[1] (scales)", data.size(0), "one row per token")
            return data, scales, _C.DTYPE_FP8_E4M3
        if isinstance(x, torch.Tensor) and x.dtype == _FP8:
            raise ArgumentTypeError(f"{op}: x: an fp8 tensor comes with its scales: pass "
                                    f"(x, x_scales)")
        need_tensor(x, op, "x", _BF16, 2, self.device)
        return x, None, _C.DTYPE_BF16

    def _routing(self, op, n, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                 num_experts):
        """(topk_idx, topk_weights, topk, E, synthetic): DeepEP may route by is_token_in_rank
        alone; epcomm then sends token t to rank r through expert r*L (one slot per rank)."""
        if num_tokens_per_expert is not None:
            need_tensor(num_tokens_per_expert, op, "num_tokens_per_expert", _I32, 1, self.device)
            E = num_tokens_per_expert.numel()
        elif num_experts is not None:
            E = int(num_experts)
        elif topk_idx is not None:
            raise InvalidArgumentError(f"{op}: num_tokens_per_expert (from get_dispatch_layout) "
                                       f"or num_experts= is needed to know the experts")
        if topk_idx is not None:
            topk = self._topk(op, topk_idx, n)
            if topk_weights is not None:
                need_tensor(topk_weights, op, "topk_weights", _F32, 2, self.device)
                need_shape(topk_weights, op, "topk_weights", topk_idx.shape, "as topk_idx")
            return topk_idx, topk_weights, topk, E, False
        if topk_weights is not None:
            raise InvalidArgumentError(f"{op}: topk_weights without topk_idx")
        if is_token_in_rank is None or num_tokens_per_expert is None:
            raise InvalidArgumentError(f"{op}: a dispatch without handle needs topk_idx, or "
                                       f"is_token_in_rank and num_tokens_per_expert")
        need_tensor(is_token_in_rank, op, "is_token_in_rank", torch.bool, 2, self.device)
        need_shape(is_token_in_rank, op, "is_token_in_rank", (n, self.group_size),
                   "[num_tokens][num_ranks]")
        R = self.group_size
        if E % R:
            raise InvalidArgumentError(f"{op}: num_tokens_per_expert: {E} experts are not "
                                       f"divisible by the {R} ranks")
        first = torch.arange(R, dtype=_I64, device=self.device) * (E // R)
        idx = torch.where(is_token_in_rank, first, torch.full_like(first, -1)).contiguous()
        return idx, None, R, E, True

    def _recv_per_expert(self, num_tokens_per_expert, alignment):
        """The received selections per local expert when routing came from is_token_in_rank:
        the sum over the sources of their num_tokens_per_expert (epcomm's own group gathers
        them), aligned."""
        E = num_tokens_per_expert.numel()
        L = E // self.group_size
        mine = struct.pack(f"<{E}i", *num_tokens_per_expert.tolist())
        rows = [struct.unpack(f"<{E}i", b) for b in self._group.allgather(mine)]
        a = max(int(alignment), 1)
        counts = (sum(row[self.rank * L + l] for row in rows) for l in range(L))
        return [(c + a - 1) // a * a for c in counts]

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False, *,
                 num_experts=None):
        """DeepEP's dispatch. Returns (recv_x or (recv_x, recv_x_scales), recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert_list, handle, EventOverlap). Collective.
        Routing comes from topk_idx (num_tokens_per_rank is not needed and not read), or from
        is_token_in_rank with num_tokens_per_expert when topk_idx is None."""
        op = "Buffer.dispatch"
        buf = self._buf(op)
        x, scales, dtype = self._split_x(x, op)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise InvalidArgumentError(f"{op}: a cached dispatch (handle given) takes its "
                                           f"routing from the handle: pass no topk_idx/weights")
            return self._cached_dispatch(op, buf, x, scales, dtype, handle, previous_event,
                                         async_finish, allocate_on_comm_stream)
        n, H = x.shape
        idx, w, topk, E, synthetic = self._routing(op, n, topk_idx, topk_weights,
                                                   is_token_in_rank, num_tokens_per_expert,
                                                   num_experts)
        W = int(num_worst_tokens)
        if W < 0:
            raise InvalidArgumentError(f"{op}: num_worst_tokens is {W}, must be >= 0")
        R, L = self.group_size, max(E // self.group_size, 1)
        rows = _Rows(self.device, H, x.dtype, 0 if scales is None else scales.size(1),
                     0 if synthetic else topk, w is not None, self._out_pool)
        launch = self._launch(previous_event, async_finish, allocate_on_comm_stream,
                              after_compute=synthetic)
        st, on_wait = self._spare_stream(launch), None
        try:
            rank_prefix = self._spares.take_prefix(st) if st is not None else None
            if rank_prefix is None:
                rank_prefix = self._empty(*prefix_spec(R))
            # Read back below only when nothing else gives the list (the C call then waits).
            rtpe, rtpe_ptr = (None, 0) if W or synthetic else self._per_expert_out(L)
            sc = (0, 0, 0) if scales is None else (scales.size(1), scales.stride(0),
                                                   scales.stride(1))
            # While the host waits for the count: the next calls' outputs (_spares).
            on_wait = self._spares.job(st, n, E, H) if st is not None and not W else None
            nrecv, hid = _C.dispatch(
                buf, ptr(x), dtype, n, H, ptr(scales), *sc, ptr(idx), ptr(w), topk, E,
                int(expert_alignment), 0, launch.stream,
                _C.OUTPUT_CALLER if W else _C.OUTPUT_ALLOC, 1 if W else 0, W, rows,
                *(rows(W) if W else (0, 0, 0, 0, 0)), ptr(rank_prefix), rtpe_ptr, on_wait)
        except BaseException:
            if on_wait is not None:
                self._spares.finish()
            launch.abort()
            raise
        # The routing is kept (not copied) for a cached dispatch in another format (below).
        info = Info(Ref(hid, False, self), self, n, H, topk, nrecv, W or nrecv, w is not None,
                    idx, (dtype, 0 if scales is None else scales.size(1), E))
        if on_wait is not None:
            info.spare = self._spares.finish()
        h = DispatchHandle(rank_prefix, rows.src, is_token_in_rank, info)
        if W:
            per_expert = []
        elif synthetic:
            per_expert = self._recv_per_expert(num_tokens_per_expert, expert_alignment)
        else:
            per_expert = rtpe.tolist()
        recv_x = rows.x if scales is None else (rows.x, rows.scales)
        event = launch.finish((x, scales, idx, w, rank_prefix, rows.x, rows.scales, rows.idx,
                               rows.w, rows.src))
        return recv_x, rows.idx, rows.w, per_expert, h, event

    def _per_expert_out(self, L):
        """Where the C call writes the received selections per local expert, read right after
        (a synchronous dispatch has written them when it returns): a reused host array on CPU,
        a reused page-locked tensor on CUDA, which the kernel writes through the same address,
        so reading it does not wait for the stream (DeepEP reads its count from mapped memory
        likewise; a device tensor's .tolist() would hold the host until the rows had moved)."""
        if self._cuda:
            t = self._rtpe
            if not isinstance(t, torch.Tensor) or t.numel() != L:
                # device given: under torch.set_default_device("cuda") (DeepEP's
                # test_intranode.py) a pinned tensor would otherwise be asked for on the GPU
                t = self._rtpe = torch.empty((L,), dtype=_I32, device="cpu", pin_memory=True)
            return t, t.data_ptr()
        a = self._rtpe
        if len(a) != L:
            a = self._rtpe = array.array("i", bytes(4 * L))
        return a, a.buffer_info()[0]

    def _handle_info(self, handle, op, kind=DispatchHandle):
        info = getattr(handle, "_ep", None)
        if not isinstance(handle, kind) or info is None:
            name = "dispatch" if kind is DispatchHandle else "low_latency_dispatch"
            raise ArgumentTypeError(f"{op}: handle: not a handle returned by this Buffer's {name}")
        if info.buffer is not self:
            raise InvalidArgumentError(f"{op}: handle: it belongs to another Buffer")
        return info

    def _cached_dispatch(self, op, buf, x, scales, dtype, handle, previous_event, async_finish,
                         allocate_on_comm_stream):
        info = self._handle_info(handle, op)
        n, H = x.shape
        if n != info.num_tokens or H != info.hidden:
            raise InvalidArgumentError(f"{op}: x: shape {tuple(x.shape)}, but the handle's "
                                       f"dispatch had [{info.num_tokens}][{info.hidden}]")
        R = self.group_size
        # The original's row count, or its capacity when it was a worst-case dispatch whose
        # count is known only on the device.
        nrows = info.num_recv_tokens if info.num_recv_tokens >= 0 else info.capacity
        worst = info.num_recv_tokens < 0
        rows = _Rows(self.device, H, x.dtype, 0 if scales is None else scales.size(1), 0, False,
                     self._out_pool)
        launch = self._launch(previous_event, async_finish, allocate_on_comm_stream)
        # DeepEP resends a handle's layout in any format; epcomm's cached dispatch keeps the
        # format of the dispatch that made the handle, so another one is a new dispatch along
        # the handle's routing (the topk_idx it was given, unchanged since), its handle dropped.
        same = (dtype, 0 if scales is None else scales.size(1)) == info.dims[:2]
        try:
            rank_prefix = self._empty(*prefix_spec(R))
            sc = (0, 0, 0) if scales is None else (scales.size(1), scales.stride(0),
                                                   scales.stride(1))
            routing = ((0, 0, 0, 0, 0, info.ref.id) if same else
                       (ptr(info.topk_idx), 0, info.topk, info.dims[2], 0, 0))
            _, hid = _C.dispatch(buf, ptr(x), dtype, n, H, ptr(scales), *sc, *routing,
                                 launch.stream, _C.OUTPUT_CALLER, int(worst), nrows, None,
                                 *rows(nrows), ptr(rank_prefix), 0)
            if hid:
                _C.handle_destroy(hid)
        except BaseException:
            launch.abort()
            raise
        recv_x = rows.x if scales is None else (rows.x, rows.scales)
        event = launch.finish((x, scales, rank_prefix, rows.x, rows.scales, rows.src))
        return recv_x, None, None, None, None, event

    # ---------------------------------------------------------------- combine
    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's combine: (combined_x bf16 [N][H], combined_topk_weights or None,
        EventOverlap). out[t] = bias0 + bias1 + the rows of t summed over ranks ascending, in
        fp32, one rounding (docs/SEMANTICS.md §4). Collective."""
        op = "Buffer.combine"
        buf = self._buf(op)
        info = self._handle_info(handle, op)
        need_tensor(x, op, "x", _BF16, 2, self.device)
        rows = info.num_recv_tokens if info.num_recv_tokens >= 0 else info.capacity
        if x.size(0) < rows or x.size(1) != info.hidden:
            raise InvalidArgumentError(f"{op}: x: shape {tuple(x.shape)}, expected "
                                       f"[{rows}][{info.hidden}] (the dispatch's received rows)")
        if topk_weights is not None:
            need_tensor(topk_weights, op, "topk_weights", _F32, 2, self.device)
            need_shape(topk_weights, op, "topk_weights", (x.size(0), info.topk),
                       "one row per received row, topk columns")
        bias0, bias1 = self._biases(op, bias, info)
        launch = self._launch(previous_event, async_finish, allocate_on_comm_stream)
        try:
            st, spare, info.spare = self._spare_stream(launch), info.spare, None
            shape, dtype = combine_spec(info.num_tokens, info.hidden)
            out = self._spares.take_combine(spare, st, shape) if st is not None else None
            if out is None:
                out = self._empty(shape, dtype)
            out_w = (None if topk_weights is None else
                     self._empty((info.num_tokens, info.topk), _F32))
            _C.combine(buf, info.ref.id, ptr(x), ptr(topk_weights), ptr(bias0), ptr(bias1),
                       launch.stream, ptr(out), ptr(out_w))
        except BaseException:
            launch.abort()
            raise
        return out, out_w, launch.finish((x, topk_weights, bias0, bias1, out, out_w))

    def get_combine_buffer(self, handle):
        """bf16 [rows][H] (rows: the handle's received rows) where the experts may write their
        outputs for ``combine(x=it, handle)``, which then reads them where they are (CUDA: no
        staging pass, as fast as combining the dispatch's own bf16 view, also after an fp8
        dispatch). Valid until the next combine on this buffer, whatever its handle, or the
        buffer's destroy. A backend that reads any x where it is (cpu) gives a new tensor;
        UnsupportedError never comes out of here. Local."""
        op = "Buffer.get_combine_buffer"
        buf = self._buf(op)
        info = self._handle_info(handle, op)
        rows = info.num_recv_tokens if info.num_recv_tokens >= 0 else info.capacity
        shape = (rows, info.hidden)
        try:
            address = _C.get_combine_buffer(buf, info.ref.id)
        except UnsupportedError:
            return self._empty(shape, _BF16)
        return over(address, rows * info.hidden * 2, _BF16, shape, self.device)

    # ---------------------------------------------------------------- registered memory
    def register(self, tensor):
        """Registers ``tensor`` (contiguous, on the buffer's device) with the normal-mode buffer
        and returns an epcomm Registration (``.deregister()``, or use it in a ``with`` block).
        A combine whose ``x`` lies inside a registered tensor is read by the peers where it is
        (CUDA: no staging pass); results are the same bits. Collective: every rank registers
        its own tensor, in the same order (docs/PYTHON.md). Memory CUDA IPC cannot export
        (PyTorch's expandable segments, cudaMallocAsync pools) raises UnsupportedError on every
        rank: combine from it still works, through the staging path."""
        return _register(self, self._buf("Buffer.register"), tensor)

    def mem_pool(self, nbytes):
        """epcomm's own: an arena of ``nbytes`` on the buffer's device, registered with the
        normal-mode buffer (collective, like ``register``), behind a ``torch.cuda.MemPool``
        (returned as ``.pool`` of an epcomm MemPool). Tensors made under
        ``torch.cuda.use_mem_pool(p.pool)`` (the experts' outputs) are combined in place: the
        peers read them where they lie, no staging pass, same bits. CUDA buffers only
        (UnsupportedError elsewhere, and where PyTorch has no MemPool or IPC cannot export
        the memory); allocations past ``nbytes`` fail as PyTorch's out of memory."""
        p = _mem_pool(self, self.register, nbytes)
        self._pools.append(p)
        return p

    @property
    def out_pool_bytes(self):
        """epcomm's own: the bytes of the out pool this Buffer holds for dispatch's default
        recv_x (``out_pool_bytes`` at creation; the default asks for half of num_nvl_bytes),
        0 when it has none (CPU, turned off, no room or no registration when it was made, or
        off after an out of memory). Read-only."""
        pool = self._out_pool
        mem = pool.mem if pool is not None else None
        return mem.nbytes if mem is not None else 0

    def in_place_counts(self):
        """epcomm's own: (combines, dispatches) of the normal-mode buffer, since its creation,
        whose rows moved without a staging pass on a backend that otherwise stages (CUDA):
        combines from the dispatch view, the combine buffer or registered memory (a mem_pool's
        tensors), dispatches into registered recv_x. (0, 0) on the cpu backend, which always
        works in place. So a program or a test tells the fast path from a silent fallback."""
        return _C.buffer_in_place(self._buf("Buffer.in_place_counts"))

    def _forget_registrations(self):
        self._out_pool = None
        self._spares = None  # a spare may lie in a pool's arena: it goes with the rest
        regs, self._registrations = self._registrations, {}
        for r in regs.values():
            r._forget()
        pools, self._pools = getattr(self, "_pools", []), []
        for p in pools:
            p._close()

    def _biases(self, op, bias, info):
        if bias is None:
            return None, None
        pair = bias if isinstance(bias, (tuple, list)) else (bias,)
        if len(pair) > 2:
            raise InvalidArgumentError(f"{op}: bias: at most two tensors")
        for i, b in enumerate(pair):
            name = "bias" if len(pair) == 1 else f"bias[{i}]"
            need_tensor(b, op, name, _BF16, 2, self.device)
            need_shape(b, op, name, (info.num_tokens, info.hidden), "[num_tokens][hidden]")
        return tuple(pair) if len(pair) == 2 else (pair[0], None)

    # ---------------------------------------------------------------- teardown
    def destroy(self):
        """Collective, bounded by the deadline: the low-latency and normal buffers, then the
        group when the Buffer made it. Call it on every rank. A second call does nothing."""
        if self._group is None:
            return
        _lifecycle.untrack(self)
        first = None
        for name in ("_llbuf", "_normal"):
            bid = getattr(self, name)
            setattr(self, name, None)
            if bid:
                try:
                    _C.buffer_destroy(bid)
                except Exception as e:  # it is freed anyway; go on, report the first failure
                    first = first or e
        self._forget_registrations()  # they went with the buffer: the tensors may go now
        _collect_arenas()  # a plain call of the user's: retired pool arenas may be freed here
        group, self._group = self._group, None
        if self._owns_group:
            try:
                group.destroy()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def release(self):
        """Local: frees this rank's side without talking to the peers (after a peer failed)."""
        _lifecycle.untrack(self)
        self._release_quietly()
        _collect_arenas()

    def _alive(self):
        return self._group is not None

    def _release_quietly(self):
        for name in ("_llbuf", "_normal"):
            bid = getattr(self, name, None)
            setattr(self, name, None)
            if bid:
                try:
                    _C.buffer_release(bid)
                except Exception:
                    pass
        if getattr(self, "_registrations", None) or getattr(self, "_pools", None):
            self._forget_registrations()  # after the release: the tensors may go now
        group, self._group = getattr(self, "_group", None), None
        if group is not None and self._owns_group:
            group._release_quietly()
            _lifecycle.untrack(group)

    def __del__(self):
        if (getattr(self, "_group", None) is None or _lifecycle.exiting() or
                not _lifecycle.mine(self)):
            return
        # A collection may run inside a use_mem_pool block, where dropping a torch MemPool
        # aborts the process: the pools wait for the next plain call (_mempool.park).
        _park_pools(getattr(self, "_pools", []))
        self._release_quietly()
        if self.explicitly_destroy:
            warnings.warn(f"epcomm.Buffer (rank {self.rank}) garbage-collected without "
                          f"destroy(); released locally. Call buffer.destroy() on every rank.",
                          LifecycleWarning, stacklevel=2)

    def __repr__(self):
        state = "destroyed" if self._group is None else f"rank {self.rank} of {self.group_size}"
        return f"<epcomm.Buffer {self.device} {state}>"
