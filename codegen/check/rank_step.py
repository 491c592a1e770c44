"""One rank's training step, executed by the real runtime on fake tensors under a fake process group.

``run_rank`` joins torch's fake process group as global rank ``rank`` of the plan's world (collectives
return at once and move nothing; every group is created as on a real launch), builds the rank's
``CompiledModel`` from its lowered ``Program`` with every model tensor a fake of its full shape (no
memory: the runtime cuts its shards from them as from real ones), and runs what a training loop runs:
AdamW's state made by a first optimizer step, then the measured step -- ``train_step`` on this dp rank's
share of the batch, ``optimizer.step()``, ``zero_grad()`` -- inside a ``Recorder``. Nothing of the
runtime is replaced: the executor, schedule, buckets, ZeRO gathers, recompute and offload regions,
random streams and tied sums are the ones a launched rank runs.

What the tensors are. A CPU program runs on fake tensors (FakeTensorMode): a plain CPU tensor would
allocate. A GPU program runs on plain ``meta`` tensors (xirang_compile/check_api.py ``fake_device``):
they allocate nothing either, and torch's meta kernels give the same shapes, dtypes, views and device
checks as the fake tensors did, since a FakeTensor on meta runs those same kernels on a meta tensor it
wraps. The wrapping added nothing the check reads and was most of a step's time: every op went through
FakeTensorMode's Python dispatch (a cache key of its arguments, a new FakeTensor per output, and every
``tensor.device`` read dispatched as an op of its own), 70-80% of one class's step on Llama-2-70B's
plan. What a fake tensor answered that a meta one does not -- host reads of a value, tensors made on the
host -- the recorder answers (recorder.py: host reads answered as a healthy step's; offload's host copies
counted as host memory by ``Recorder.on_host``); a host tensor the runtime makes is a real, small one.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers torch's "fake" backend)
from torch._subclasses.fake_tensor import FakeTensorMode

from xirang.codegen.check.gpu_semantics import HostCopies, fuse_attention
from xirang.codegen.check.recorder import Recorder, object_collectives_on_host
from xirang.codegen.check.send_completion import completed_by_causality
from xirang.codegen.check.records import MemoryReport, RankLog
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.compiled_model import CompiledModel
from xirang.codegen.runtime.executor.pipeline_executor import PipelineExecutor
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.codegen.runtime.state.pipeline_state import STANDS_FOR_VALUES
from xirang.ir.errors import XirangError


# the executor's methods whose local ``action`` is the schedule action a call is issued in
EXECUTOR_CODES = tuple(getattr(PipelineExecutor, name).__code__ for name in (
    "_compute", "_post_send", "_post_recv", "_backward", "_backward_input", "_backward_weight"))


def join_fake_world(rank: int, world_size: int) -> None:
    """Make this process global rank ``rank`` of a fake world of ``world_size`` ranks (leaving any earlier one)."""
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise XirangError("the dry run needs a process of its own, but torch.distributed is already "
                              f"initialised here with {dist.get_backend()!r}", where="xirang.check",
                              hint="run xirang check outside a launched job (it makes its own fake world)")
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())


def leave_fake_world() -> None:
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


def share_batch(plan, program, inputs: dict, dp_rank: int, device) -> dict:
    """Fake tensors of this dp rank's share of the batch: ``inputs`` maps each input name to (shape, dtype)
    at any size; its batch dims are set to the share (micro-batches x micro-batch size) and its other
    symbolic dims (the sequence) to the traced example's values, which are the plan's when the example was
    made at the sizes the plan is for (as planning on meta wants)."""
    share = plan.micro_batches_per_dp_rank[dp_rank] * plan.micro_batch
    batch = {}
    for name, (shape, dtype) in inputs.items():
        shape = list(shape)
        for dim, symbol in program.batch_dims.get(name, {}).items():
            if symbol == "batch":
                shape[dim] = share
            elif isinstance(program.symbols.get(symbol), int):
                shape[dim] = program.symbols[symbol]
        batch[name] = torch.zeros(shape, dtype=dtype, device=device)
    return batch


def run_rank(program, plan, rank: int, *, tensors: dict, inputs: dict, device="cpu", allocator: Optional[str] = None,
             mutate: Optional[Callable] = None) -> RankLog:
    """Dry-run global rank ``rank``'s step (module docstring). ``tensors``: FQN -> (shape, dtype) of every
    model parameter and buffer, full size; ``inputs``: input name -> (shape, dtype); ``mutate(compiled)``,
    for tests, changes the built program before the step (a fault the proofs must name). ``allocator``: the
    device type whose allocator's rounding the memory figures take ("cuda" while the fakes live on meta)."""
    device = torch.device(device)
    started = time.perf_counter()
    join_fake_world(rank, plan.mesh.size)
    recorder = Recorder(device, executor_code=EXECUTOR_CODES, allocator=allocator)
    log = RankLog(rank=rank, coords=plan.mesh.coords(rank))
    gpu = torch.device(allocator or device.type).type == "cuda"  # a GPU program on meta fakes
    try:
        if gpu:
            fuse_attention(program)  # the kernel a GPU runs (codegen/check/gpu_semantics.py)
        fakes = contextlib.nullcontext() if device.type == "meta" else FakeTensorMode(allow_non_fake_inputs=True)
        with fakes, recorder, object_collectives_on_host(recorder):
            groups = build_mesh_groups(plan.mesh)
            state = {fqn: torch.empty(shape, dtype=dtype, device=device) for fqn, (shape, dtype) in tensors.items()}
            for fqn in state:  # a meta tensor here stands for the model's values, as a fake one
                setattr(state[fqn], STANDS_FOR_VALUES, True)  # (no loop variable: it would keep the last
                # full-size tensor, lm_head's, alive after ``del state``, counted at every peak: 2.3 GiB at GPT-3)
            counter = CommCounter()  # the runtime labels its calls on it ("bucket:3"); the recorder reads them
            compiled = CompiledModel(state, plan, program, groups=groups, device=device, counter=counter, seed=0)
            del state  # the rank keeps its shards only, as a launched rank does
            if compiled.activation_offload is not None and gpu:
                compiled.activation_offload.use_copier(HostCopies(recorder))  # to host memory, as a GPU copies
            if mutate is not None:
                mutate(compiled)
            # torch's AdamW on a GPU takes its foreach path (one temporary the size of a moment, for the step);
            # on meta fakes it would take the per-tensor one, a CPU's
            optimizer = torch.optim.AdamW(compiled.parameters(), foreach=gpu or None)
            for param in compiled.parameters():  # the optimizer's state exists from the first step on
                param.grad = torch.zeros_like(param)
            optimizer.step()
            optimizer.zero_grad()
            batch = share_batch(plan, program, inputs, groups.axis_index("dp"), device)
            recorder.calls.clear()
            recorder.host_reads.clear()
            recorder.counter = counter
            recorder.peak, recorder.peak_at = recorder.live, len(recorder.events)
            first_event = len(recorder.events)
            counter.reset()
            hooks = [param.register_post_accumulate_grad_hook(recorder.mark_gradient)  # ZeRO drops them
                     for _, param in compiled.named_model_parameters() if param.requires_grad]  # before the step ends
            with completed_by_causality():  # fake sends never complete; a network's do (send_completion.py)
                compiled.train_step(**batch, pre_sharded=True)
            for hook in hooks:
                hook.remove()
            held = _keys(recorder, compiled)
            optimizer.step()
            held["optimizer"] = {recorder.storage_key(t) for s in optimizer.state.values() for t in s.values()
                                 if isinstance(t, torch.Tensor)} - {None}
            optimizer.zero_grad()
            log.counter_records = list(counter.records)
            del batch
            log.memory = _memory(recorder, held, first_event)
    except Exception as error:  # noqa: BLE001 - the step failing is a finding: kept with what ran before it
        log.failure = f"{type(error).__name__}: {error}"
        log.failed_in = _failing_action(error)
    finally:
        leave_fake_world()
    log.calls, log.host_reads = recorder.calls, recorder.host_reads
    log.device_problems = recorder.device_problems
    log.seconds = time.perf_counter() - started
    return log


def _failing_action(error: BaseException) -> str:
    """The schedule action the step was running when ``error`` was raised ("" outside the schedule)."""
    found, trace = "", error.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code in EXECUTOR_CODES:
            found = str(trace.tb_frame.f_locals.get("action", found))
        trace = trace.tb_next
    return found


def _keys(recorder: Recorder, compiled) -> dict:
    """Storage keys of what the rank holds by part, read after the step (before the optimizer runs)."""
    params = [t for _, t in compiled.named_model_parameters()] + list(compiled.parameters())
    grads = [t.grad for t in params if t.grad is not None]
    buffers = compiled.executor.buffers.tensors()
    keys = lambda tensors: {recorder.storage_key(t) for t in tensors} - {None}  # noqa: E731
    return {"parameters": keys(params), "gradients": keys(grads), "communication": keys(buffers)}


LARGEST_SITES = 12  # the sites a memory report names, largest first


def _memory(recorder: Recorder, held: dict, first_event: int) -> MemoryReport:
    """The step's peak split by part: a storage the rank holds after the step is counted as what holds it
    (parameters, gradients, optimizer state, receive buffers); any other by where it was made (the recorder's
    allocation sites: gathered ZeRO-3 parameters, gradient buckets, the backward's working set, weight casts,
    activations)."""
    live = recorder.live_at_peak()
    parts: dict = {}
    sites: dict = {}
    for key, size in live.items():
        part = next((name for name in ("parameters", "gradients", "optimizer", "communication")
                     if key in held.get(name, ())), None) or recorder.part_of.get(key, "activations")
        parts[part] = parts.get(part, 0) + size
        site = (part, recorder.site_of.get(key, ""))
        sites[site] = sites.get(site, 0) + size
    largest = sorted(((size, part, where) for (part, where), size in sites.items()), reverse=True)[:LARGEST_SITES]
    return MemoryReport(peak=recorder.peak, parts=parts, resting=recorder.live, largest=tuple(largest),
                        allocations=sum(1 for _, size in recorder.events[first_event:] if size > 0),
                        peak_action=recorder.peak_action, host_peak=recorder.host_peak)
