"""Data-parallel gradient averaging in buckets, overlapped with the backward pass.

Gradients become ready in reverse forward order, so the last layers' gradients are complete while
the backward still runs through the first layers. Grouping parameters into buckets of about
``bucket_bytes`` and all-reducing each bucket asynchronously the moment its last gradient lands
hides most of the communication behind the rest of the backward (PyTorch DDP, Li et al. 2020,
sections 3.2.3 and 4.2: 25 MiB buckets, launched in a fixed order). Only the last micro-batch of
an accumulated step communicates; earlier ones run under ``no_sync()``.

Buckets are launched strictly in bucket order, even if a later bucket happens to fill first: all
ranks must issue their all-reduces on the dp group in the same order, and bucket order is the one
order every rank knows in advance.

The buckets are the plan's (``Plan.buckets``, given as ``PlannedBucket``s by the runtime), each
with the algorithm the plan chose for it: "flat" (the backend's own all-reduce) or "hierarchical"
(reduce-scatter inside the node, all-reduce across nodes on 1/k of the bytes, all-gather inside;
the 2D scheme of Jia et al. 2018 and Horovod, on ``TwoLevelGroups``). A hierarchical bucket's
reduce-scatter starts the moment the bucket is ready; its cross-node all-reduce starts when the
next bucket launches (or at ``wait()``), so the three phases of successive buckets pipeline. Every
sub-group still sees its collectives in bucket order on every rank.

ZeRO-1 (``shard_gradients``, codegen/runtime/data_parallel/dist_optimizer.py): a bucket handed over is reduce-scattered
instead, flat over the dp group (its buffer padded with zeros to a multiple of dp), and ``wait()``
gives this rank's 1/dp slice of the averaged buffer to the optimizer shards, leaving the parameters'
``.grad`` empty: the full averaged gradient exists nowhere, which is the point.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from xirang.ir.errors import InvalidValue, XirangError
from xirang.ir.plan_parts import ENACTED_ALGORITHM

from xirang.codegen.ops.collectives import all_gather_flat, group_size, reduce_scatter_flat
from xirang.codegen.ops.comm_counter import CommCounter, record_call
from xirang.codegen.runtime.memory.storage_identity import element_key, storage_key

DEFAULT_BUCKET_BYTES = 25 * 2**20


def assign_buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list:
    """Indices of ``params`` (forward order) per bucket, in the order the buckets become ready.

    Walks the parameters in reverse (gradient-ready) order, one open bucket per dtype and device
    (a flat buffer has one of each); a bucket closes when the next parameter would take it past
    ``bucket_bytes``. A parameter larger than ``bucket_bytes`` gets a bucket of its own.
    """
    closed, open_by_key = [], {}
    for index in reversed(range(len(params))):
        param = params[index]
        size = param.numel() * param.element_size()
        key = (param.dtype, param.device)
        bucket = open_by_key.setdefault(key, [[], 0])
        if bucket[0] and bucket[1] + size > bucket_bytes:
            closed.append(bucket[0])
            bucket = open_by_key[key] = [[], 0]
        bucket[0].append(index)
        bucket[1] += size
    closed.extend(members for members, _ in open_by_key.values() if members)
    # A bucket is ready when its earliest-in-forward parameter (its last in backward) is.
    closed.sort(key=lambda members: -min(members))
    return closed


def group_divisor(world: int, dtype: torch.dtype) -> torch.Tensor:
    """``world`` as a 0-dim CPU tensor that divides gradients of ``dtype`` bitwise as the int does, without
    wrapping and casting the int (``aten::_to_copy``) on every call: in ``dtype`` where ``world`` is exact in
    it, else in float32, in which the half types' kernels divide (bfloat16 cannot hold 257). On the CPU also
    for CUDA gradients: a CPU 0-dim operand takes the int's scalar path there, a device tensor would not."""
    exact = torch.tensor(world, dtype=dtype)
    return exact if exact.item() == world else torch.tensor(world, dtype=torch.float32)


ALGORITHMS = ("flat", "hierarchical")  # what a bucket's all-reduce runs (ir/plan_parts.py ENACTED_ALGORITHM)


@dataclass(frozen=True)
class PlannedBucket:
    """One bucket as the plan lists it: its parameters (gradient-ready order), the algorithm of its
    all-reduce and the label its CommRecord carries (the plan's collective node, "bucket:<k>")."""

    params: tuple
    algorithm: str = "flat"
    label: str = ""


@dataclass(eq=False)
class _Bucket:
    index: int
    params: list
    algorithm: str = "flat"
    label: str = ""
    ready: set = field(default_factory=set)  # id() of params whose gradient arrived this step
    buffer: Optional[torch.Tensor] = None    # flat, averaged-in-flight gradients (a view of ``storage``)
    storage: Optional[torch.Tensor] = None   # the bucket's flat buffer, kept from step to step
    slots: dict = field(default_factory=dict)  # id(param) -> (its view of ``storage``, that view's element_key)
    divisor: Optional[torch.Tensor] = None   # the dp group size, for ``storage``'s dtype (group_divisor)
    shard: Optional[torch.Tensor] = None     # hierarchical: this rank's 1/k of the buffer
    phase: int = 0                           # hierarchical: 1 reduce-scatter, 2 cross-node, 3 gather
    handle: Optional[object] = None          # torch.distributed Work of the phase in flight
    scatter: bool = False                    # ZeRO-1: reduce-scatter over dp, the slice to shard_sink


class GradientBuckets:
    """Average the gradients of ``params_in_order`` over the dp ``group`` as backward produces them.

    ``params_in_order``: parameters in forward (layer) order; those without ``requires_grad`` are
    skipped, repeats (tied weights) counted once. ``group``: the dp process group, or ``None`` for
    a single dp rank (the bucket machinery still runs, without the collective). ``reduce_dtype``:
    reduce in e.g. ``torch.bfloat16`` and cast back to the gradient dtype (half the bytes, at the
    cost of rounding; each rank's gradient is divided by the group size before the reduction, so
    the half-precision sum stays in range). ``divisor``: divide by this instead of the group size.
    ``event_log``: a list that receives
    ``("launch" | "wait" | "backward_done", bucket index or None, time.perf_counter())``.
    ``buckets``: the plan's ``PlannedBucket``s, in launch order, covering every parameter exactly once
    (else buckets of ``bucket_bytes`` are made here, all "flat"); ``hierarchy``: the
    ``TwoLevelGroups`` a "hierarchical" bucket runs on.

    Per step: backward (hooks launch buckets), then ``wait()``, then the optimizer step.
    """

    def __init__(self, params_in_order, group, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 buckets: Optional[Sequence[PlannedBucket]] = None, hierarchy=None,
                 reduce_dtype: Optional[torch.dtype] = None, event_log: Optional[list] = None,
                 counter: Optional[CommCounter] = None, divisor: Optional[int] = None):
        if bucket_bytes <= 0:
            raise InvalidValue(f"GradientBuckets: bucket_bytes must be positive, got {bucket_bytes}")
        params, self._position = [], {}  # position in params_in_order, for error messages
        for position, param in enumerate(params_in_order):
            if param.requires_grad and id(param) not in self._position:
                self._position[id(param)] = position
                params.append(param)
        self.group, self.reduce_dtype, self.hierarchy = group, reduce_dtype, hierarchy
        self._world = group_size(group)  # asked once: the hook runs once per parameter per step
        # what the sum is divided by: the group size (an average), or given: expert weights are summed over
        # their expert-data-parallel group but averaged over every data-parallel rank (expert_grads.py)
        self._divide_by = divisor or self._world
        self.event_log, self.counter = event_log, counter
        if buckets is None:
            self.buckets = [_Bucket(i, [params[j] for j in members], label=f"grad bucket {i}")
                            for i, members in enumerate(assign_buckets(params, bucket_bytes))]
        else:
            self.buckets = self._planned(params, buckets)
        self.sync = True
        # dp rank i with n_i of the N samples (uneven dp shares) weighs its gradient by n_i * dp / N
        # before the average, so the sum over ranks is the global batch's mean gradient; 1 when even
        self.share_weight = 1.0
        self._next = 0  # the next bucket to launch; buckets go out in index order only
        self.shard_sink = None  # ZeRO-1: (bucket index, this rank's averaged slice) -> None
        self._callback_queued = False
        self._hooks = [param.register_post_accumulate_grad_hook(partial(self._grad_ready, bucket))
                       for bucket in self.buckets for param in bucket.params]

    def _planned(self, params: list, buckets: Sequence[PlannedBucket]) -> list:
        """The plan's buckets, checked to cover every trainable parameter exactly once."""
        where = "GradientBuckets(buckets=...) (the plan's gradient buckets)"
        seen = {}
        for i, bucket in enumerate(buckets):
            if bucket.algorithm not in ALGORITHMS:
                raise InvalidValue(f"bucket {i} ({bucket.label}) asks for algorithm {bucket.algorithm!r}; "
                                   f"the runtime runs {', '.join(ALGORITHMS)}")
            if bucket.algorithm == "hierarchical" and self.group is not None and self.hierarchy is None:
                raise XirangError(f"bucket {i} ({bucket.label}) is hierarchical but this rank's dp group has "
                                  f"no two-level sub-groups", where=where,
                                  hint="give hierarchy= (process_groups.build_two_level_groups); a "
                                       "hierarchical all-reduce needs k > 1 members on each of several nodes")
            for param in bucket.params:
                if id(param) not in self._position:
                    raise XirangError(f"bucket {i} ({bucket.label}) holds a parameter of shape "
                                      f"{tuple(param.shape)} that is not trainable here", where=where,
                                      hint="list only trainable parameters of this stage")
                if id(param) in seen:
                    raise XirangError(f"a parameter of shape {tuple(param.shape)} is in buckets {seen[id(param)]} "
                                      f"and {i}", where=where, hint="list each parameter in one bucket")
                seen[id(param)] = i
        missing = [f"#{self._position[id(p)]} shape {tuple(p.shape)}" for p in params if id(p) not in seen]
        if missing:
            raise XirangError(f"{len(missing)} trainable parameter(s) are in no bucket: {', '.join(missing[:8])}",
                              where=where, hint="the plan's buckets must cover every parameter of the stage; "
                                                "re-plan with this version of Xirang")
        return [_Bucket(i, list(b.params), b.algorithm, b.label) for i, b in enumerate(buckets)]

    def _log(self, event: str, bucket: Optional[int]) -> None:
        if self.event_log is not None:
            self.event_log.append((event, bucket, time.perf_counter()))

    def _grad_ready(self, bucket: _Bucket, param: torch.Tensor) -> None:
        if not self.sync:
            return
        if bucket.index < self._next:
            raise XirangError(
                f"a gradient of shape {tuple(param.shape)} arrived after its bucket "
                f"{bucket.index} was already all-reduced",
                where="GradientBuckets (data-parallel gradient sync)",
                hint="call wait() after each synchronised backward, and run the backward of "
                     "earlier micro-batches inside no_sync()")
        if not bucket.ready:  # the bucket's first gradient this step: its storage is checked once a step
            self._storage(bucket)
        bucket.ready.add(id(param))
        self._stage_gradient(bucket, param)
        self._queue_backward_done()
        while self._next < len(self.buckets):
            nxt = self.buckets[self._next]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
            self._next += 1

    def _queue_backward_done(self) -> None:
        # The autograd engine runs queued callbacks once the whole backward graph is done (DDP
        # uses the same hook point); logging there shows which launches overlapped the backward.
        if self.event_log is None or self._callback_queued:
            return
        self._callback_queued = True

        def done():
            self._callback_queued = False
            self._log("backward_done", None)
        torch.autograd.Variable._execution_engine.queue_callback(done)

    def shard_gradients(self, indices, sink) -> None:
        """ZeRO-1: reduce-scatter the buckets ``indices`` over dp (flat, whatever their planned algorithm)
        and give ``sink(bucket index, slice)`` this rank's averaged 1/dp slice at ``wait()``."""
        for index in indices:
            self.buckets[index].scatter = True
        self.shard_sink = sink

    def _shard_count(self, bucket: _Bucket) -> int:
        """How many equal shards the bucket's buffer is padded to: the in-node group of a hierarchical
        all-reduce, the dp group of a ZeRO reduce-scatter, else 1."""
        if bucket.scatter:
            return self._world
        if bucket.algorithm == "hierarchical" and self._world > 1:
            return self.hierarchy.ranks_per_node
        return 1

    def _storage(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's flat buffer, padded with zeros to its shard count, kept from step to step as DDP
        keeps its buckets where it holds the gradients themselves (a fresh one each step is faulted in again:
        on CPU as dear as the copy); a reduce-dtype copy is made each step and let go at ``wait``. The
        parameters' slots (views in their shapes) and the divisor are made with it, not per gradient."""
        first, numels = bucket.params[0], [param.numel() for param in bucket.params]
        k = self._shard_count(bucket)
        size, dtype = -(-sum(numels) // k) * k, self.reduce_dtype or first.dtype
        held = bucket.storage
        if held is None or held.numel() != size or held.dtype != dtype or held.device != first.device:
            held = bucket.storage = torch.zeros(size, dtype=dtype, device=first.device)  # padding stays 0
            views = held[:sum(numels)].split(numels)  # back to back, in the bucket's (gradient-ready) order
            bucket.slots = {id(p): (v.view(p.shape), element_key(v)) for p, v in zip(bucket.params, views)}
            bucket.divisor = group_divisor(self._divide_by, dtype)
        return held

    def _stage_gradient(self, bucket: _Bucket, param: torch.Tensor) -> None:
        """Write ``param``'s gradient, divided by the group size (an average, and a half-precision sum that
        cannot overflow), into its slot of the bucket buffer as autograd finishes it (still in cache).
        Where the slot has the gradient's dtype, ``param.grad`` becomes the slot (DDP's
        gradient_as_bucket_view): nothing is copied back. A gradient already its slot is scaled in place.
        Runs once per parameter per step, so everything it needs is made beforehand (``_storage``)."""
        slot, slot_address = bucket.slots[id(param)]
        grad = param.grad
        in_place = element_key(grad) == slot_address and grad.stride() == slot.stride()
        if not in_place and grad.dtype == slot.dtype and self.share_weight == 1.0:
            torch.div(grad, bucket.divisor, out=slot)  # one fused pass, the common case
        else:
            if not in_place:
                slot.copy_(grad)  # in the reduce dtype, if another: scaled in it, as the sum will run
            if self.share_weight != 1.0:  # uneven dp shares: this rank's gradient counts n_i dp / N times
                slot.mul_(self.share_weight)
            slot.div_(bucket.divisor)
        if grad.dtype == slot.dtype:
            param.grad = slot

    def _launch(self, bucket: _Bucket) -> None:
        world = self._world
        k = self._shard_count(bucket)
        hierarchical = bucket.algorithm == "hierarchical" and world > 1 and not bucket.scatter
        flat = bucket.buffer = bucket.storage  # checked at the bucket's first gradient; every one staged in it
        if bucket.scatter:  # ZeRO-1: the flat buffer padded to dp equal slices, each rank keeps its own
            record_call(self.counter, "reduce_scatter", flat.nbytes, world, bucket.label)
            bucket.shard = flat.new_empty(flat.numel() // world)
            bucket.handle = reduce_scatter_flat(bucket.shard, flat, self.group, async_op=True)
        elif world > 1:
            record_call(self.counter, "all_reduce", flat.nbytes, world, bucket.label,
                        algorithm=bucket.algorithm)
            if hierarchical:
                bucket.shard = flat.new_empty(flat.numel() // k)
                bucket.handle = reduce_scatter_flat(bucket.shard, flat, self.hierarchy.intra, async_op=True)
                bucket.phase = 1
            else:
                bucket.handle = dist.all_reduce(flat, group=self.group, async_op=True)
        if bucket.index > 0:  # the previous bucket's reduce-scatter had a bucket's time to finish
            self._cross_nodes(self.buckets[bucket.index - 1])
        self._log("launch", bucket.index)

    def _cross_nodes(self, bucket: _Bucket) -> None:
        """Hierarchical phase 2: once the in-node reduce-scatter is done, all-reduce the shard across
        nodes (every rank reaches this for bucket i before bucket i+1, so the order agrees)."""
        if bucket.phase == 1:
            bucket.handle.wait()
            bucket.handle = dist.all_reduce(bucket.shard, group=self.hierarchy.inter, async_op=True)
            bucket.phase = 2

    def _gather_in_node(self, bucket: _Bucket) -> None:
        """Hierarchical phase 3: all-gather the reduced shards back into the full buffer."""
        if bucket.phase == 2:
            bucket.handle.wait()
            bucket.handle = all_gather_flat(bucket.buffer, bucket.shard, self.hierarchy.intra, async_op=True)
            bucket.phase = 3

    def wait(self) -> None:
        """Wait for every bucket's all-reduce; ``param.grad`` then holds the average (it is its slot of
        the bucket buffer, or gets the average copied in where the reduce dtype differs)."""
        if not self.sync:
            return  # a no_sync micro-batch: gradients just accumulate locally
        if self._next < len(self.buckets):
            missing = [f"#{self._position[id(p)]} shape {tuple(p.shape)} (bucket {b.index})"
                       for b in self.buckets[self._next:] for p in b.params if id(p) not in b.ready]
            raise XirangError(
                f"wait() found {len(missing)} parameter(s) without a gradient this step, so their "
                f"buckets were never all-reduced (#: position in params_in_order): "
                f"{', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else ""),
                where="GradientBuckets.wait (data-parallel gradient sync)",
                hint="run the synchronised backward before wait(); leave parameters the loss does "
                     "not use out of params_in_order (the other dp ranks are now waiting on this "
                     "one)")
        for bucket in self.buckets:  # phases 2 and 3 of hierarchical buckets, in bucket order
            self._cross_nodes(bucket)
        for bucket in self.buckets:
            self._gather_in_node(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            self._log("wait", bucket.index)
            if bucket.scatter:
                self.shard_sink(bucket.index, bucket.shard.to(bucket.params[0].grad.dtype))
                for param in bucket.params:
                    param.grad = None  # the full gradient is not kept: the shard's slice is the result
            for param in () if bucket.scatter else bucket.params:
                averaged, address = bucket.slots[id(param)]
                if element_key(param.grad) != address:  # a reduce-dtype copy, not the slot
                    param.grad.copy_(averaged)
            bucket.ready.clear()
            bucket.buffer = bucket.handle = bucket.shard = None
            # ZeRO: no full-size gradient buffer is kept between steps (its point). A reduce-dtype copy (bf16
            # over fp32 gradients) is not kept either: held through the next forwards it would add its bytes
            # (2 a parameter) to the peak, which the plan prices from its making to this wait, as the dry run
            # measures one step; the gradients themselves stay in their storage (they are its views)
            if bucket.scatter or (bucket.storage is not None and bucket.storage.dtype != bucket.params[0].dtype):
                bucket.storage, bucket.slots = None, {}  # the slots are views: they would keep it alive
            bucket.phase = 0
        self._next = 0

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (earlier micro-batches); the next synced backward reduces
        the accumulated sum."""
        previous, self.sync = self.sync, False
        try:
            yield self
        finally:
            self.sync = previous

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in a bucket buffer (a gradient kept as its slot: the next backward overwrites it)."""
        where = storage_key(tensor)
        return any(bucket.storage is not None and storage_key(bucket.storage) == where for bucket in self.buckets)

    @property
    def bucket_params(self) -> tuple:
        """The parameters of each bucket, in launch order."""
        return tuple(tuple(bucket.params) for bucket in self.buckets)

    def remove(self) -> None:
        """Detach the gradient hooks (the parameters go back to plain local gradients)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def plan_bucket_algorithms(plan) -> dict:
    """``{k: "flat" | "hierarchical"}``: what the runtime runs for the dp all-reduce of ``plan.buckets[k]``
    (the plan's choice, collective "bucket:<k>", mapped by ``ENACTED_ALGORITHM``; under ZeRO-1 the
    bucket's reduce-scatter, its all-gather of the updated parameters being the same algorithm's)."""
    return {int(choice.node.removeprefix("bucket:")): ENACTED_ALGORITHM[choice.algorithm]
            for choice in plan.collectives if choice.node.startswith("bucket:") and choice.kind != "all_gather"}


def planned_buckets(plan, stage_names: Sequence[str], names: Sequence[str], tensor_of, algorithms: dict) -> list:
    """The ``PlannedBucket``s of one stage: every bucket of ``plan.buckets`` whose names are all
    parameters of the stage (``stage_names``; a plan's bucket is one stage's), keeping those in
    ``names`` (the stage's trainable FQNs this GradientBuckets reduces), as ``tensor_of[fqn]`` in the
    plan's order. ``GradientBuckets`` then checks they cover ``names``."""
    stage, mine = set(stage_names), set(names)
    found = []
    for k, bucket in enumerate(plan.buckets):
        here = [name for name in bucket if name in mine]
        if here and stage.issuperset(bucket):
            found.append(PlannedBucket(tuple(tensor_of[name] for name in here), algorithms.get(k, "flat"),
                                       f"bucket:{k}"))
    return found
