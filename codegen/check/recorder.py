"""The dry run's eyes: a TorchDispatchMode over FakeTensorMode that logs what one rank's step does.

Every op of the step reaches ``Recorder.__torch_dispatch__`` before the fake kernels, so the real
runtime runs unchanged and the recorder sees, with their arguments as issued:
- each ``c10d`` op (what ``torch.distributed``'s collectives, ``isend`` and ``irecv`` dispatch to): its
  group's global ranks, kind, dtype, element count, reduce op, root, peer and tag, as a ``Call``, with
  the schedule action, the stage-module node and model source line, and the runtime line issuing it;
- each read of a device value on the host (``.item()``, ``torch.equal``, a tensor's truth), which a fake
  tensor cannot answer: it is answered as a healthy run would (0, equal) and logged as a ``HostRead``,
  since on a GPU each one is a synchronisation of the step;
- each new storage an op makes and when Python frees it (``weakref.finalize``), at the size the device's
  allocator would hand out (the CUDA caching allocator rounds every block up to 512 bytes), so the peak
  and what was live at it are known.
Object collectives (``all_gather_object``) pickle host values: they run on real host tensors under the
fake process group (whose all-gather echoes this rank's value) and are logged as one call each.
"""
from __future__ import annotations

import contextlib
import operator
import sys
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from xirang.codegen.check.records import Call, HostRead
from xirang.ir.meta_keys import INSERTED, MODULE_TYPE, SOURCE

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


def allocator_bytes(nbytes: int, device: torch.device) -> int:
    """What the device's allocator hands out for ``nbytes``: CUDA rounds up to 512-byte blocks."""
    if device.type != "cuda" or nbytes == 0:
        return nbytes
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class Recorder(TorchDispatchMode):
    """Logs one rank's calls, host reads and storages (module docstring); ``device``: the rank's device."""

    def __init__(self, device: torch.device, executor_code=(), allocator=None):
        super().__init__()
        self.device = torch.device(device)
        self.allocator = torch.device(allocator or self.device.type)  # whose rounding allocations take
        self.calls: list = []
        self.host_reads: list = []
        self.device_problems: list = []
        self.counter = None  # the rank's CommCounter: its newest record labels a call
        self._labelled = 0
        self._executor_codes = tuple(executor_code or ())  # the executor's methods whose local ``action`` is running
        self._backward_codes = tuple(code for code in self._executor_codes if "backward" in code.co_name)
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

    # --- storages ----------------------------------------------------------------------------

    def storage_key(self, tensor: torch.Tensor):
        """The key of ``tensor``'s storage if the recorder saw it made, else None."""
        return self._ids.get(id(tensor.untyped_storage()))

    def _track(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, FakeTensor):
            return
        storage = tensor.untyped_storage()
        if id(storage) in self._ids:
            return
        self._keys += 1
        key = self._keys
        on_device = tensor.device.type == self.device.type  # a GPU rank's host buffers (offload) are not device memory
        size = allocator_bytes(storage.nbytes(), self.allocator) if on_device else 0
        if not on_device:  # host memory of a GPU rank: counted apart
            self.host_live += storage.nbytes()
            self.host_peak = max(self.host_peak, self.host_live)
            self._host_sizes[id(storage)] = storage.nbytes()
        self._ids[id(storage)] = key
        self.sizes[key] = size
        self.part_of[key], self.site_of[key] = self._part() if size else ("activations", "")
        self.events.append((key, size))
        self.live += size
        if self.live > self.peak:
            self.peak, self.peak_at = self.live, len(self.events)
            self.peak_action = self._action()
        weakref.finalize(storage, self._free, id(storage), key)

    def _free(self, storage_id: int, key: int) -> None:
        self.host_live -= self._host_sizes.pop(storage_id, 0) if self._ids.get(storage_id) == key else 0
        if self._ids.get(storage_id) == key:
            del self._ids[storage_id]
        size = self.sizes.pop(key, 0)
        self.live -= size
        self.events.append((key, -size))

    def _part(self) -> str:
        """Which part of a rank's memory a storage made now is, by where it is made (ALLOCATION_SITES; inside a
        backward action the rest is the backward's working set; in a stage module a cast of a parameter is a
        weight copy; else an activation), and the site: the innermost stage node making it (its op), else the
        runtime's line."""
        backward = False
        cast = False
        node = runtime = None
        for frame in self._frames():
            code = frame.f_code
            if code in self._backward_codes:
                backward = True
                break
            name = code.co_filename
            for site, part in ALLOCATION_SITES:
                if site in name:
                    return part, f"{site.rsplit('/', 1)[-1]}:{frame.f_lineno}"
            if node is None and name.startswith("<eval_with_key>"):
                node = _node_at(frame)
                cast = node is not None and _casts_a_parameter(node)
            elif runtime is None and "/codegen/" in name and "/codegen/check/" not in name:
                runtime = f"{name.rsplit('/codegen/', 1)[-1]}:{frame.f_lineno}"
        where = _site_of_node(node) if node is not None else runtime or ""
        if backward:
            return "working_set", where or "backward"
        return ("weight_casts" if cast else "activations"), where

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

    # --- where a call comes from -------------------------------------------------------------

    def _frames(self):
        frame = sys._getframe(2)
        while frame is not None:
            yield frame
            frame = frame.f_back

    def _action(self) -> str:
        for frame in self._frames():
            if frame.f_code in self._executor_codes:
                return str(frame.f_locals.get("action", ""))
        return ""

    def _context(self) -> dict:
        action = node = source = where = ""
        for frame in self._frames():
            code = frame.f_code
            if not action and code in self._executor_codes:
                action = str(frame.f_locals.get("action", ""))
            elif not node and code.co_filename.startswith("<eval_with_key>"):
                found = _node_at(frame)
                if found is not None:
                    node = found.name
                    location = SOURCE.get(found, None)
                    source = str(location) if location is not None else ""
            elif not where and "/codegen/" in code.co_filename and "/codegen/check/" not in code.co_filename:
                where = f"{code.co_filename.rsplit('/codegen/', 1)[-1]}:{frame.f_lineno}"
        return {"action": action, "node": node, "source": source, "where": f"codegen/{where}" if where else ""}

    # --- the mode ----------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            try:
                return func(*args, **kwargs)
            except DataDependentOutputException:  # a fake tensor has no value: answer as a healthy step would
                context = self._context()
                self.host_reads.append(HostRead(str(func).removesuffix(".default"), context["source"] or
                                                context["where"], context["action"]))
                return _HOST_READS[func]
        if func.namespace == "c10d" and not self.in_object_collective:
            self._record_call(func, args, kwargs)
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            self._track(tensor)
        return out

    def _record_call(self, func, args, kwargs) -> None:
        name = func.__name__.split(".")[0]
        kind = _KINDS.get(name)
        if kind is None:
            return
        bound = {argument.name: value for argument, value in zip(func._schema.arguments, args)}
        bound.update(kwargs)
        group = ProcessGroup.unbox(bound["process_group"])
        ranks = tuple(dist.get_process_group_ranks(group))
        buffer = _tensors(bound.get(_BUFFER[kind]))
        for tensor in buffer:
            if tensor.device.type != self.device.type:
                context = self._context()
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
                               channel=getattr(group, "group_desc", ""),
                               **self._context()))


# (a path fragment of the file making a storage, the part of memory it is), innermost frame first
ALLOCATION_SITES = (("codegen/runtime/data_parallel/param_shards.py", "parameters"),
                    ("codegen/runtime/data_parallel/dist_optimizer.py", "parameters"),
                    ("codegen/runtime/data_parallel/grad_sync.py", "gradients"),
                    ("codegen/runtime/executor/p2p.py", "communication"),
                    ("/torch/optim/", "optimizer"))


def _casts_a_parameter(node) -> bool:
    """Whether ``node`` makes a half-precision copy of a parameter (the precision pass's cast of a weight)."""
    inputs = node.all_input_nodes
    return str(INSERTED.get(node, "")).startswith("precision") and len(inputs) == 1 \
        and inputs[0].op == "placeholder" and inputs[0].name.startswith("p_")  # torch.export names parameters p_


def _site_of_node(node) -> str:
    """A stage node as a site that adds up over layers and micro-batches: its op (a tuple's item, its maker's)
    and the class of the module it is in, e.g. "mm in LlamaMLP"."""
    op = node
    while op.target is operator.getitem and op.args and isinstance(op.args[0], torch.fx.Node):
        op = op.args[0]
    name = getattr(op.target, "__name__", str(op.target)).removesuffix(".default")
    module = MODULE_TYPE.get(op, "") or MODULE_TYPE.get(node, "")
    return f"{name} in {module}" if module else name


def _node_at(frame):
    """The fx node whose generated line ``frame`` (a GraphModule's forward) is executing, or None."""
    module = frame.f_locals.get("self")
    lines = getattr(module, "_lineno_map", None)
    start = getattr(module, "_prologue_start", None)
    if not lines or start is None:
        return None
    index = lines.get(frame.f_lineno - start)  # as torch._utils reads it
    if index is None:
        return None
    nodes = list(module.graph.nodes)
    return nodes[index] if 0 <= index < len(nodes) else None


@contextlib.contextmanager
def object_collectives_on_host(recorder: Recorder):
    """Run ``all_gather_object`` and ``broadcast_object_list`` on real host tensors (module docstring),
    each logged as one call of kind all_gather / broadcast with dtype "object"."""
    originals = {name: getattr(c10d, name) for name in ("all_gather_object", "broadcast_object_list")}

    def wrap(name, original):
        def run(*args, group=None, **kwargs):
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                tuple(range(dist.get_world_size()))
            context = recorder._context()
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
