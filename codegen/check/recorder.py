"""The dry run's eyes: a TorchDispatchMode that logs what one rank's step does.

The step runs on tensors without memory: fake tensors under FakeTensorMode (a CPU program), or plain
``meta`` tensors (a GPU program: rank_step.py says why). Every op of the step reaches
``Recorder.__torch_dispatch__`` before the fake or meta kernels, so the real runtime runs unchanged and
the recorder sees, with their arguments as issued:
- each ``c10d`` op (what ``torch.distributed``'s collectives, ``isend`` and ``irecv`` dispatch to): its
  group's global ranks, kind, dtype, element count, reduce op, root, peer and tag, as a ``Call``, with
  the schedule action, the stage-module node and model source line, and the runtime line issuing it;
- each read of a device value on the host (``.item()``, ``torch.equal``, a tensor's truth), which a fake
  or meta tensor cannot answer: it is answered as a healthy run would (0, equal) and logged as a ``HostRead``,
  since on a GPU each one is a synchronisation of the step;
- each new storage an op makes and when Python frees it (a weak reference's callback), at the size the device's
  allocator would hand out (the CUDA caching allocator rounds every block up to 512 bytes), so the peak
  and what was live at it are known.
Object collectives (``all_gather_object``) pickle host values: they run on real host tensors under the
fake process group (whose all-gather echoes this rank's value) and are logged as one call each.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from xirang.codegen.check.meta_cache import MetaCache
from xirang.codegen.check.records import Call, HostRead
from xirang.codegen.check.sites import Sites

CUDA_BLOCK_BYTES = 512  # the caching allocator's smallest block and rounding (c10/cuda/CUDACachingAllocator.cpp)

# c10d op name -> the collective kind it is
_KINDS = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "_allgather_base_": "all_gather",
          "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
          "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
          "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast",
          "alltoall_base_": "all_to_all", "barrier": "barrier", "send": "send", "recv_": "recv"}
# the argument holding this rank's buffer, whose elements are the call's count
_BUFFER = {"all_reduce": "tensors", "all_gather": "input_tensor", "reduce_scatter": "input_tensor",
           "broadcast": "tensors", "all_to_all": "input", "barrier": "tensor", "send": "tensors", "recv": "tensors"}
_HOST_READS = {torch.ops.aten._local_scalar_dense.default: 0, torch.ops.aten.equal.default: True,
               torch.ops.aten.is_nonzero.default: False}
# a fake tensor's ``.device`` reaches the mode as this op: most of a step's dispatches, none of them recorded
_DEVICE = torch.ops.prim.device.default
_PASS, _HOST, _C10D, _OTHER = "pass", "host read", "c10d", "other"  # how the mode handles an op


def allocator_bytes(nbytes: int, device: torch.device) -> int:
    """What the device's allocator hands out for ``nbytes``: CUDA rounds up to 512-byte blocks."""
    if device.type != "cuda" or nbytes == 0:
        return nbytes
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    found = []
    if isinstance(value, (list, tuple)):
        for item in value:  # called twice per op: a loop, not a recursion per item
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple)):
                found += _tensors(item)
    return found


class Recorder(TorchDispatchMode):
    """Logs one rank's calls, host reads and storages (module docstring); ``device``: the rank's device."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless this says False (the pattern
        # torch/utils/_python_dispatch.py documents); the runtime compiles nothing, and the wrapper's two extra
        # Python frames per op were 0.35 s of a 6.4 s class under cProfile (GPT-3 175B width, 16 micro-batches)
        return False

    def __init__(self, device: torch.device, executor_code=(), allocator=None):
        super().__init__()
        self.device = torch.device(device)
        self.allocator = torch.device(allocator or self.device.type)  # whose rounding allocations take
        self.calls: list = []
        self.host_reads: list = []
        self.device_problems: list = []
        self.counter = None  # the rank's CommCounter: its newest record labels a call
        self._labelled = 0
        self.sites = Sites(executor_code or ())  # where an op comes from (sites.py)
        self.live = 0
        self.peak = 0
        self.peak_at = 0  # events recorded when the peak was reached
        self.peak_action = ""
        self.events: list = []  # (storage key, +bytes or -bytes) in order
        self.sizes: dict = {}  # storage key -> bytes, while live
        self._keys = 0
        self._ids: dict = {}  # id(storage object) -> key, while live
        self.in_object_collective = 0
        self.part_of: dict = {}  # storage key -> the part of memory its allocation site says it is
        self.site_of: dict = {}  # storage key -> where it was made: the stage node (op) or the runtime line
        self.host_live = self.host_peak = 0  # a GPU rank's host memory the step's tensors hold (offload copies)
        self._host_sizes: dict = {}
        self._on_host = 0  # inside ``on_host``: storages made are host memory, whatever their device
        self.meta_cache = MetaCache()  # a plain meta step's kernels' answers (meta_cache.py)
        self._on_meta = self.device.type == "meta"
        self._watch: dict = {}  # storage key -> the weak reference that reports its storage freed, while live
        self._route: dict = {}  # id(op) -> (op, how the mode handles it: _PASS, _HOST, _C10D or _OTHER)
        self._c10d: dict = {}  # id(c10d op) -> (op, the call kind it is or None, its arguments' names)
        self._groups: dict = {}  # id(process group) -> (group, its global ranks, its description)

    @contextlib.contextmanager
    def on_host(self):
        """Storages made inside are the rank's host memory (a GPU's offload copies, made as meta tensors when
        the step runs on plain meta tensors: a real CPU tensor would take real memory)."""
        self._on_host += 1
        try:
            yield
        finally:
            self._on_host -= 1

    # --- storages ----------------------------------------------------------------------------

    def storage_key(self, tensor: torch.Tensor):
        """The key of ``tensor``'s storage if the recorder saw it made, else None."""
        return self._ids.get(id(tensor.untyped_storage()))

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        sid = id(storage)
        if sid in self._ids:
            return
        if not tensor.is_meta and not isinstance(tensor, FakeTensor):  # a real host tensor of the step
            return
        self._keys += 1
        key = self._keys
        # a GPU rank's host buffers (offload) are not device memory
        on_device = (tensor.is_meta if self._on_meta else tensor.device.type == self.device.type) \
            and not self._on_host
        nbytes = storage.nbytes()
        size = allocator_bytes(nbytes, self.allocator) if on_device else 0
        if not on_device:  # host memory of a GPU rank: counted apart
            self.host_live += nbytes
            self.host_peak = max(self.host_peak, self.host_live)
            self._host_sizes[sid] = nbytes
        self._ids[sid] = key
        self.sizes[key] = size
        self.part_of[key], self.site_of[key] = self.sites.part() if size else ("activations", "")
        self.events.append((key, size))
        self.live += size
        if self.live > self.peak:
            self.peak, self.peak_at = self.live, len(self.events)
            self.peak_action = self.sites.action()
        # told when Python frees it: a plain weak reference with a callback, held until then (what
        # ``weakref.finalize`` does, without its registry and atexit bookkeeping per storage)
        self._watch[key] = weakref.ref(storage, self._freed(sid, key))

    def _freed(self, storage_id: int, key: int):
        return lambda _: self._free(storage_id, key)

    def _free(self, storage_id: int, key: int) -> None:
        self._watch.pop(key, None)
        self.host_live -= self._host_sizes.pop(storage_id, 0) if self._ids.get(storage_id) == key else 0
        if self._ids.get(storage_id) == key:
            del self._ids[storage_id]
        size = self.sizes.pop(key, 0)
        self.live -= size
        self.events.append((key, -size))

    def mark_gradient(self, param: torch.Tensor) -> None:
        """A parameter's accumulated gradient is the gradients part, wherever the backward made it
        (a post-accumulate-grad hook: ZeRO frees it before the step ends, so holding it after says nothing)."""
        key = self.storage_key(param.grad) if param.grad is not None else None
        if key is not None:
            self.part_of[key], self.site_of[key] = "gradients", "parameter .grad"

    def live_at_peak(self) -> dict:
        """Storage key -> bytes of what was live when the peak was reached."""
        live: dict = {}
        for key, size in self.events[:self.peak_at]:
            if size >= 0:
                live[key] = size
            else:
                live.pop(key, None)
        return live

    # --- the mode ----------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # how this op is handled, found once per op: an ``OpOverload`` hashes in Python (a microsecond a lookup,
        # on hundreds of thousands of ops a step), its id in C; the op is held in the entry, so the id stays its
        route = self._route.get(id(func))
        if route is None:
            route = self._route[id(func)] = (func, _PASS if func is _DEVICE else _HOST if func in _HOST_READS else
                                             _C10D if func.namespace == "c10d" else _OTHER)
        route = route[1]
        if route is _PASS:
            return func(*args, **kwargs)
        if route is _HOST:
            try:
                return func(*args, **kwargs)
            except (DataDependentOutputException, RuntimeError, NotImplementedError) as error:
                if not isinstance(error, DataDependentOutputException) and \
                        not any(t.device.type == "meta" for t in _tensors(list(args))):
                    raise  # a real failure, not a tensor without a value
                # a fake or meta tensor has no value: answer as a healthy step would
                context = self.sites.context()
                self.host_reads.append(HostRead(str(func).removesuffix(".default"), context["source"] or
                                                context["where"], context["action"]))
                return _HOST_READS[func]
        if route is _C10D and not self.in_object_collective:
            self._record_call(func, args, kwargs)
        if self._on_meta:
            # ``torch.tensor(data, device="meta")`` makes its storage without dispatching an op (a fake tensor's
            # maker dispatches ``lift_fresh``): such a storage is counted from the first op that reads it
            ids = self._ids
            for tensor in _tensors(args):
                if tensor.is_meta and id(tensor.untyped_storage()) not in ids:
                    self._track(tensor)
            out = self.meta_cache.run(func, args, kwargs)  # the same outputs, remembered (meta_cache.py)
        else:
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self._track(out)
        else:
            for tensor in _tensors(out):
                self._track(tensor)
        return out

    def _record_call(self, func, args, kwargs) -> None:
        op_facts = self._c10d.get(id(func))  # (op, its kind, its arguments' names), found once per op
        if op_facts is None:
            op_facts = self._c10d[id(func)] = (func, _KINDS.get(func.__name__.split(".")[0]),
                                               tuple(argument.name for argument in func._schema.arguments))
        _, kind, names = op_facts
        if kind is None:
            return
        bound = dict(zip(names, args))
        bound.update(kwargs)
        group = ProcessGroup.unbox(bound["process_group"])
        # a group's global ranks, read once per group (a world group's are a thousand ranks, listed per call)
        group_facts = self._groups.get(id(group))
        if group_facts is None:
            group_facts = self._groups[id(group)] = (group, tuple(dist.get_process_group_ranks(group)),
                                                     getattr(group, "group_desc", ""))
        _, ranks, channel = group_facts
        buffer = _tensors(bound.get(_BUFFER[kind]))
        for tensor in buffer:
            if tensor.device.type != self.device.type:
                context = self.sites.context()
                self.device_problems.append(f"{kind} on a {tensor.device.type} tensor {list(tensor.shape)} on a "
                                            f"{self.device.type} rank at {context['where'] or context['source']}")
        dtype = str(buffer[0].dtype).removeprefix("torch.") if buffer else ""
        count = sum(t.numel() for t in buffer)
        reduce_op = bound.get("reduce_op")
        op = dist.ReduceOp.RedOpType(reduce_op.op()).name if reduce_op is not None else ""
        peer = tag = root = None
        shape = ()
        if kind in ("send", "recv"):
            peer = ranks[bound["dst" if kind == "send" else "src"]]
            tag, shape = bound["tag"], tuple(buffer[0].shape) if buffer else ()
            ranks = (dist.get_rank(), peer)  # the pair, not the whole group it travels on (the world's, often)
        if kind == "broadcast":
            root = ranks[bound["root_rank"]]
        label = ""
        if self.counter is not None and len(self.counter.records) > self._labelled:
            label = self.counter.records[-1].label
            self._labelled = len(self.counter.records)
        self.calls.append(Call(index=len(self.calls), kind=kind, group=ranks, dtype=dtype, count=count, op=op,
                               root=root, peer=peer, tag=tag, shape=shape, label=label,
                               blocking=kind not in ("send", "recv") and not bound.get("async_op", True),
                               channel=channel,
                               **self.sites.context()))


@contextlib.contextmanager
def object_collectives_on_host(recorder: Recorder):
    """Run ``all_gather_object`` and ``broadcast_object_list`` on real host tensors (module docstring),
    each logged as one call of kind all_gather / broadcast with dtype "object"."""
    originals = {name: getattr(c10d, name) for name in ("all_gather_object", "broadcast_object_list")}

    def wrap(name, original):
        def run(*args, group=None, **kwargs):
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                tuple(range(dist.get_world_size()))
            context = recorder.sites.context()
            root = kwargs.get("src", args[1] if name == "broadcast_object_list" and len(args) > 1 else None)
            recorder.calls.append(Call(index=len(recorder.calls), kind="all_gather" if "gather" in name else
                                       "broadcast", group=ranks, dtype="object", count=0, root=root, blocking=True,
                                       **context))
            recorder.in_object_collective += 1
            try:
                with unset_fake_temporarily():
                    return original(*args, group=group, **kwargs)
            finally:
                recorder.in_object_collective -= 1
        return run

    for name, original in originals.items():
        setattr(c10d, name, wrap(name, original))
        setattr(dist, name, getattr(c10d, name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
