"""The cost terms of a plan besides collectives: compute, pipeline bubble, gradient-sync overlap,
memory per device, and the closed-form Megatron figures used to check them.

Sources, cited at each term: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21 (bubble, step FLOPs, parameters, tp traffic); Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models", 2022 (activation memory);
Rajbhandari et al., "ZeRO", SC'20 (model states). Collectives are priced in ``cost_collectives``.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Optional, Sequence

# Efficiency is a device's (ir/device.py: a DeviceSpec field, per generation); re-exported here, where
# it was defined before, so `from xirang.passes.planning.cost_model import Efficiency` keeps working.
from xirang.ir.device import DeviceSpec, Efficiency
from xirang.ir.plan import RECOMPUTE_MODES
from xirang.ir.schedules import SCHEDULE_SPECS, ScheduleSpec, schedule_spec
from xirang.ir.world import World

from xirang.passes.planning.cost_collectives import collective_cost
from xirang.ir.errors import InvalidValue

# --- compute -------------------------------------------------------------------------------------


def compute_time(flops: float, nbytes: float, device: DeviceSpec, dtype: str, *,
                 efficiency: Optional[Efficiency] = None, is_matmul: bool = True,
                 is_attention: bool = False) -> float:
    """Roofline (Williams et al. 2009): the larger of FLOPs at the achievable peak and bytes moved
    at the achievable memory bandwidth. ``efficiency``: the device's own (``DeviceSpec.efficiency``,
    per generation) unless given. A fused attention op (``is_attention``) runs at
    ``efficiency.attention`` where the device has its own figure, else as a matmul."""
    efficiency = device.efficiency if efficiency is None else efficiency
    if is_attention and efficiency.attention is not None:
        rate = efficiency.attention
    else:
        rate = efficiency.matmul if is_matmul or is_attention else efficiency.other
    return max(flops / (device.peak(dtype) * rate),
               nbytes / (device.memory_bandwidth * efficiency.memory))


# Bytes per parameter one mixed-precision Adam step moves through device memory, pass by pass as
# DeepSpeed's FP16_Optimizer.step runs it (deepspeed/runtime/fp16/fused_optimizer.py, 2021): the overflow
# check reads each 16-bit gradient, copies it to fp32 and sums that (CheckOverflow._has_inf_or_nan:
# 2 + 4 + 4); the gradients are cast to fp32 and concatenated into one flat buffer (2 + 4, 4 + 4); the
# gradient norm reads it (4); unscale-and-clip multiplies it in place (4 + 4); fused Adam reads master
# weight, m, v and gradient and writes the first three (16 + 12); the fp32 master is copied to the
# 16-bit weights (4 + 2).
ADAM_STEP_BYTES_PER_PARAM = (2 + 4 + 4) + (2 + 4 + 4 + 4) + 4 + (4 + 4) + (16 + 12) + (4 + 2)


def optimizer_step_seconds(params: float, device: DeviceSpec) -> float:
    """A memory-bound Adam step over ``params`` local parameters: ``ADAM_STEP_BYTES_PER_PARAM`` per
    parameter at the device's achievable memory bandwidth. 1.9e9 parameters on an A100-80GB
    (2.039 TB/s x 0.35): 1.9e9 x 70 / 7.14e11 = 0.186 s."""
    return compute_time(0.0, params * ADAM_STEP_BYTES_PER_PARAM, device, "fp32", is_matmul=False)


def gradient_accumulation_seconds(params: float, grad_bytes: float, device: DeviceSpec) -> float:
    """One backward's weight gradients added into ``.grad`` in place (autograd's AccumulateGrad, over the
    micro-batches of a step): the old gradient and the new one read, the sum written, ``3 x grad_bytes``
    per local parameter at the device's achievable memory bandwidth. Runtimes that fuse the addition into
    the weight-gradient GEMM (Megatron-LM's gradient_accumulation_fusion, 2022) do not pay it.
    1.888e9 16-bit gradients on an A100-80GB (2.039 TB/s x 0.35): 1.888e9 x 6 / 7.14e11 = 15.9 ms."""
    return compute_time(0.0, params * 3 * grad_bytes, device, "fp32", is_matmul=False)


# --- pipeline schedules --------------------------------------------------------------------------
# p stages, m micro-batches per step, v model chunks per device (interleaved only). Times are those
# of one device's whole share of the layers for one micro-batch, forward plus backward. The closed
# forms live with the schedules themselves (ir/schedules.py ``SCHEDULE_SPECS``), tested there
# against the schedules the executor runs; these are their float views for pricing.

SCHEDULES: Mapping[str, ScheduleSpec] = SCHEDULE_SPECS  # name -> ScheduleSpec (bubble, in flight)


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1, backward_ratio: float = 2.0) -> float:
    """Idle time relative to the ideal (bubble-free) step time: (p-1)/m for GPipe and 1F1B,
    (p-1)/(v·m) interleaved (Narayanan et al. 2021, eq. 1 and sec. 2.2.2). p=4, m=8: 3/8. The
    zero-bubble schedules' depends on ``backward_ratio`` (backward over forward time, its two
    halves B and W equal; Qi et al. 2024): ZB-H1 and ZB-H2 at p=4, m=8, ratio 2: 1/8."""
    try:
        hash((schedule, p, m, v, backward_ratio))
    except TypeError:  # not a name or not ints: let the spec's checks say which
        return float(schedule_spec(schedule).bubble_fraction(p, m, v, backward_ratio))
    return _bubble_fraction(schedule, p, m, v, backward_ratio)


@lru_cache(maxsize=4096, typed=True)  # the search prices many candidates of few (schedule, p, m, v)
def _bubble_fraction(schedule: str, p: int, m: int, v: int, backward_ratio: float) -> float:
    return float(schedule_spec(schedule).bubble_fraction(p, m, v, backward_ratio))


def bubble_share(schedule: str, p: int, m: int, v: int = 1, backward_ratio: float = 2.0) -> float:
    """Idle fraction of the actual step time: b/(1+b) for b = bubble_fraction, i.e.
    (p-1)/(m+p-1) for 1F1B and GPipe, (p-1)/(v·m+p-1) interleaved. p=4, m=8: 3/11; ZB-H1 1/9."""
    return float(schedule_spec(schedule).bubble_share(p, m, v, backward_ratio))


def pipeline_step_time(schedule: str, p: int, m: int, t_micro_batch: float, v: int = 1,
                       backward_ratio: float = 2.0) -> float:
    """Step time = m·t·(1 + bubble_fraction): (m + p - 1)·t for GPipe and 1F1B, (m + (p-1)/v)·t
    interleaved, with t the forward+backward time of one micro-batch on one device (all its v
    chunks); ``backward_ratio`` is its backward over its forward (the zero-bubble schedules' bubble
    depends on it). Assumes balanced stages and free point-to-point sends (add those separately)."""
    return m * t_micro_batch * (1 + bubble_fraction(schedule, p, m, v, backward_ratio))


def blocking_1f1b_stage_ends(forward: Sequence[float], backward: Sequence[float],
                             transfer: Sequence[float], m: int) -> list[float]:
    """When each stage ends its last backward under DeepSpeed's PipelineEngine ``TrainSchedule``, whose
    sends and receives are blocking and issued one after the other (deepspeed/runtime/pipe/schedule.py:
    "The communication is blocking and must be paired with a RecvActivation on the next stage").

    Formulation: 2(m + p - 1) slots; stage s runs the forward of micro-batch j in slot 2j + s and its
    backward in slot 2j + 2p - 1 - s. A stage in a backward slot first sends its previous slot's
    activation to s + 1, then receives this slot's gradient from s + 1; in the same slot s + 1 (in a
    forward slot) receives that activation and sends that gradient. The pair's transfers rendezvous
    (a blocking send waits for its receiver): they start when both stages are free and take
    ``transfer[s]`` each, one after the other (not two directions at once), then each stage computes
    (``forward[s]`` / ``backward[s]``, idle where the slot has no micro-batch). Times only: no memory.
    p = 2, m = 1, forward 1, backward 2, transfer 0.5: stage 0 ends at 1 + 0.5 + 1 + 2 + 0.5 + 2 = 7.
    """
    p = len(forward)
    if len(backward) != p or len(transfer) != p - 1 or p < 1 or m < 1:
        raise InvalidValue(f"blocking_1f1b_stage_ends: one forward and backward per stage and one transfer per "
                           f"cut, m >= 1; got {p} forwards, {len(backward)} backwards, {len(transfer)} "
                           f"transfers, m={m}")

    def forward_of(s: int, slot: int) -> bool:  # a micro-batch's forward in this slot of stage s
        return (slot - s) % 2 == 0 and 0 <= (slot - s) // 2 < m

    def backward_of(s: int, slot: int) -> bool:
        return (slot - s) % 2 == 1 and 0 <= (slot + s + 1 - 2 * p) // 2 < m

    free = [0.0] * p
    for slot in range(2 * (m + p - 1)):
        for s in range(slot % 2 == 0, p - 1, 2):  # stages in a backward slot pair with the next stage
            sends = forward_of(s, slot - 1) + backward_of(s, slot)
            if sends:
                free[s] = free[s + 1] = max(free[s], free[s + 1]) + sends * transfer[s]
        for s in range(p):
            free[s] += forward[s] if forward_of(s, slot) else backward[s] if backward_of(s, slot) else 0.0
    return free


# --- data-parallel gradient sync overlapped with the backward -----------------------------------


def exposed_comm_time(comm_seconds: Sequence[float], backward_seconds: Sequence[float]) -> float:
    """Communication left on the critical path after the backward ends.

    Bucket i is ready once the backward of buckets 0..i is done (buckets in the order backward
    fills them, last layers first, as in PyTorch DDP; Li et al. 2020); all-reduces run one after
    another on one stream. So the last bucket never overlaps, and exposed =
    max(0, end of the last all-reduce - total backward time). Contention between the all-reduce
    and the backward kernels is not modelled.
    """
    if len(comm_seconds) != len(backward_seconds):
        raise InvalidValue(f"one backward time per bucket: {len(comm_seconds)} buckets, "
                         f"{len(backward_seconds)} backward times")
    ready = comm_free = 0.0
    for comm, backward in zip(comm_seconds, backward_seconds):
        ready += backward
        comm_free = max(comm_free, ready) + comm
    return max(0.0, comm_free - ready)


def exposed_prefetched_gathers(gather_seconds: Sequence[float], forward_seconds: Sequence[float]) -> float:
    """ZeRO-3's parameter all-gathers left on the critical path of a forward (FSDP's forward prefetch,
    Zhao et al. 2023, sec. 4.3): bucket 0's gather is issued when the forward starts and waited on at
    once; bucket k+1's is issued when bucket k's compute starts, the gathers one after another on one
    stream, and bucket k+1's compute waits for its gather. Exposed = the forward's end less its compute.

    Closed form: bucket k+1's gather is issued when bucket k's compute starts, and that is never
    before the previous gather ends (bucket k waited for it), so bucket k+1 starts max(f_k, g_{k+1})
    after bucket k: exposed = g_0 + sum_{k>=1} max(0, g_k - f_{k-1})."""
    if len(gather_seconds) != len(forward_seconds):
        raise InvalidValue(f"one forward time per bucket: {len(gather_seconds)} gathers, "
                           f"{len(forward_seconds)} forward times")
    if not gather_seconds:
        return 0.0
    return gather_seconds[0] + math.fsum(max(0.0, g - f) for g, f in zip(gather_seconds[1:], forward_seconds))


def exposed_gradient_sync(bucket_bytes: Sequence[float], backward_seconds: Sequence[float],
                          group: tuple[int, ...], world: World) -> float:
    """``exposed_comm_time`` with each bucket all-reduced on the dp ``group`` at its cheapest."""
    comm = [collective_cost("all_reduce", nbytes, group, world).seconds for nbytes in bucket_bytes]
    return exposed_comm_time(comm, backward_seconds)


# --- memory per device ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer states on one device."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


# Mixed-precision Adam (Rajbhandari et al. 2020, sec. 3.1): fp16/bf16 parameter 2 + gradient 2,
# fp32 master copy, momentum and variance 4 + 4 + 4 = 12: 16 bytes per parameter.
PARAM_BYTES, GRAD_BYTES, ADAM_STATE_BYTES = 2, 2, 12


def model_state_bytes(num_params: float, *, dp: int = 1, zero_stage: int = 0) -> ModelStateBytes:
    """Model states of ``num_params`` parameters (those on this device, after tp and pp) under
    mixed-precision Adam; ZeRO stage 1 shards optimizer states over ``dp``, stage 2 gradients
    too, stage 3 parameters too (Rajbhandari et al. 2020, fig. 1)."""
    if zero_stage not in (0, 1, 2, 3):
        raise InvalidValue(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise InvalidValue(f"dp must be a positive int, got {dp!r}")
    return ModelStateBytes(params=PARAM_BYTES * num_params / (dp if zero_stage >= 3 else 1),
                           grads=GRAD_BYTES * num_params / (dp if zero_stage >= 2 else 1),
                           optimizer=ADAM_STATE_BYTES * num_params / (dp if zero_stage >= 1 else 1))




# What Xirang's runtime holds per local parameter at a step's peak (measured by the dry run, ``xirang
# check``, part by part): fp32 weights (the optimizer's dtype; half-precision copies are made per use and
# remade in the backward, codegen/runtime/memory/weight_casts.py), fp32 gradients (``.grad``; the plan's reduce
# dtype is a copy made after the backward), and AdamW's two fp32 moments. No fp32 master copy is kept
# beside the weights, so the 16 bytes split 4 + 4 + 8, not Megatron's 2 + 2 + 12.
RUNTIME_PARAM_BYTES, RUNTIME_GRAD_BYTES, RUNTIME_ADAM_BYTES = 4, 4, 8


def runtime_state_bytes(num_params: float, *, dp: int = 1, zero_stage: int = 0,
                        reduce_copy_bytes: float = 0.0) -> ModelStateBytes:
    """Model states the runtime holds at a step's peak for ``num_params`` local parameters. ZeRO (1 and 3,
    codegen/runtime/data_parallel/dist_optimizer.py, param_shards.py): AdamW's moments for this rank's 1/dp slice, plus
    the slice itself as the optimizer's own fp32 parameter and its gradient-norm mask (the whole weights
    stay, gathered, through the step's forwards and backwards: ZeRO-3 frees them between steps only, so
    its peak is ZeRO-1's). ``reduce_copy_bytes``: bytes per element of the dp buckets where they are a
    copy of the gradients (reduced in half precision, ``plan.grad_reduce_dtype``: 2; an fp32 bucket is the
    gradients' own storage: 0), alive with them once the backward stages them."""
    if zero_stage not in (0, 1, 3):
        raise InvalidValue(f"the runtime implements zero_stage 0, 1 and 3, got {zero_stage!r}")
    shard = 1 / dp if zero_stage else 1.0
    # the slice, in fp32, and a byte per element of it saying whether this rank counts it in the norm
    slice_bytes = (RUNTIME_PARAM_BYTES + 1) * shard if zero_stage else 0.0
    return ModelStateBytes(params=(RUNTIME_PARAM_BYTES + slice_bytes) * num_params,
                           grads=(RUNTIME_GRAD_BYTES + reduce_copy_bytes) * num_params,
                           optimizer=RUNTIME_ADAM_BYTES * shard * num_params)


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, *,
                               sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes one transformer layer keeps for its backward, 16-bit activations
    (Korthikanti et al. 2022, eqs. 1-2 and table 2), per micro-batch:

    - none:      s·b·h·(10 + 24/t + 5·a·s/(h·t)); at t=1 this is s·b·h·(34 + 5·a·s/h);
                 with sequence parallel s·b·h·(34/t + 5·a·s/(h·t)).
    - selective: the same without the attention-score term 5·a·s/(h·t), which is recomputed.
    - full:      only the layer input, 2·s·b·h; with sequence parallel that input is the
                 sequence shard Megatron checkpoints, 2·s·b·h/t.
    """
    if recompute not in RECOMPUTE_MODES:
        raise InvalidValue(f"unknown recompute mode {recompute!r}; known: {', '.join(RECOMPUTE_MODES)}")
    if sequence_parallel and t == 1:
        sequence_parallel = False  # nothing to shard: both formulas agree at t = 1
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    linear = 34 / t if sequence_parallel else 10 + 24 / t
    attention = 5 * a * s / (h * t) if recompute == "none" else 0
    return sbh * (linear + attention)


def activation_bytes_in_flight(bytes_per_layer: float, layers_per_device: int, schedule: str,
                               p: int, m: int, v: int = 1) -> float:
    """Activations stage 0 (the fullest) holds at its peak: one micro-batch of all its layers times
    the schedule's micro-batches in flight (m GPipe, min(p, m) 1F1B, p + (p-1)/v interleaved)."""
    in_flight = float(schedule_spec(schedule).in_flight(p, m, v))
    return bytes_per_layer * layers_per_device * in_flight


@dataclass(frozen=True)
class DeviceMemory:
    """Peak bytes on one device: model states plus activations in flight."""

    states: ModelStateBytes
    activations: float

    @property
    def total(self) -> float:
        return self.states.total + self.activations


def memory_per_device(num_params: float, bytes_per_layer: float, layers_per_device: int,
                      schedule: str, p: int, m: int, v: int = 1, *, dp: int = 1,
                      zero_stage: int = 0) -> DeviceMemory:
    """``model_state_bytes`` plus ``activation_bytes_in_flight`` (no allocator fragmentation,
    workspace or temporary buffers: leave headroom when comparing with device memory)."""
    return DeviceMemory(model_state_bytes(num_params, dp=dp, zero_stage=zero_stage),
                        activation_bytes_in_flight(bytes_per_layer, layers_per_device,
                                                   schedule, p, m, v))


# --- Megatron closed forms (Narayanan et al. 2021, sec. 5.1 and appendix) ------------------------


def megatron_params(l: int, h: int, V: int, s: int) -> float:  # noqa: E741 (the paper's symbols)
    """GPT parameters: P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))
    = 12·l·h² (attention and MLP weights) + 13·l·h (biases, norms) + (V+s)·h (embeddings)."""
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def megatron_flops(B: int, s: int, l: int, h: int, V: int, recompute: bool = True) -> float:  # noqa: E741 (the paper's symbols)
    """FLOPs of one training iteration of global batch B.

    Forward is 24·B·s·l·h²·(1 + s/(6h)) plus 2·B·s·h·V for the logits; backward is twice the
    forward; full recompute runs the layers' forward once more (not the logits):
    with recompute 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)),
    without        72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).
    """
    if recompute:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def tp_traffic_per_layer(b: int, s: int, h: int, t: int, bytes_per_element: int = 2) -> float:
    """Bytes each device sends for tensor parallelism per layer and micro-batch, forward plus
    backward: two all-reduces of b·s·h each way, a ring moving 2(t-1)/t of it per device,
    8·b·s·h·(t-1)/t elements (Narayanan et al. 2021 sec. 3.3). Full recompute repeats the
    forward's two all-reduces, which this figure, like the paper's, leaves out."""
    return 8 * b * s * h * (t - 1) / t * bytes_per_element
