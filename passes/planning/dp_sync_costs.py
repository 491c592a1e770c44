"""Price the data-parallel gradient sync a step leaves after its last backward (the "dp_exposed" cause).

- Buckets of ``bucket_elements(dp)`` gradient elements are all-reduced on the dp group of their
  pipeline rank as the backward fills them (Li et al. 2020, PyTorch DDP), queued on one stream
  (``cost_model.exposed_comm_time``); ``estimate`` takes a closed form for gradients produced at an even
  rate, ``exact`` fills the buckets unit by unit in backward order. Where the World's calibration says
  communication does not overlap compute (CPU ranks: gloo's threads run on the cores that compute),
  every bucket's all-reduce is exposed.
- ZeRO-1 (``Candidate.zero_stage`` 1, codegen/runtime/data_parallel/dist_optimizer.py): ZeRO's P_os (Rajbhandari et
  al. 2020, fig. 1; ``model_state_bytes(zero_stage=1)``): 2 + 2 + 12/dp bytes per parameter at bf16,
  4 + 4 + 8/dp at fp32 (Megatron-LM's distributed optimizer with fp32 gradients, 6 + 12/dp, is the
  same rule over its fp32 gradient buffer; Xirang's gradients are in the plan's precision; the memory
  is ``plan_costs``'). Each bucket's all-reduce becomes a reduce-scatter (half a ring all-reduce's
  time), and the updated parameters are all-gathered, in fp32 (``PARAM_STORAGE_BYTES``: the runtime
  keeps parameters in fp32 and casts in the graph), before the next forward: the runtime does not
  overlap that gather, so all of it is exposed.
- ZeRO-3 (``Candidate.zero_stage`` 3, codegen/runtime/data_parallel/param_shards.py), the variant the runtime runs:
  parameters gathered per bucket at the step's first forward and kept until its last backward
  (torchtitan's choice under pipelining: no re-gather per micro-batch), gradients reduce-scattered as
  ZeRO-1's. The gathers move zero-1's bytes but are prefetched one bucket ahead in the forward:
  exposed is the first bucket's and what a gather outlasts its bucket's forward
  (``cost_model.exposed_prefetched_gathers``), added to the exposed reduce-scatter.
- Staging (``staging``): before its bucket's all-reduce each local gradient is divided by dp into its
  slot of the bucket's flat buffer, once per step (``codegen/runtime/data_parallel/grad_sync.py``; DDP copies into its
  buckets the same way): a memory-bound pass, read and written once, on the compute thread (a CUDA
  kernel on the compute stream), so it adds to the step as compute whatever the overlap.
No torch here.
"""
from __future__ import annotations

import math
from typing import Sequence

from xirang.passes.planning.cost_model import compute_time, exposed_comm_time
from xirang.passes.planning.plan_search_space import Candidate

PARAM_STORAGE_BYTES = 4  # what ZeRO's all-gather moves per element: parameters are stored in fp32


def bucket_elements(dp: int) -> int:
    """Gradient elements per all-reduce bucket: Megatron-LM's default max(40M, 1M·dp) (core DDP),
    large enough that the per-bucket latency of a ring over many nodes stays small."""
    return max(40_000_000, 1_000_000 * dp)


class DpSyncPricer:
    """The dp sync of candidates priced by one ``CandidatePricer`` (its units, links and caches)."""

    def __init__(self, pricer):
        self.pricer = pricer
        # each kind of device once (a World of 256 nodes of one kind has one): the staging pass is priced
        # at the slowest, and asked for every candidate's every pipeline rank
        self._devices = tuple(dict.fromkeys(node.device for node in pricer.world.nodes))

    def rank_grads(self, c: Candidate, stages: Sequence[tuple[int, int]]) -> tuple[float, float]:
        p = self.pricer
        n = p.units(c)
        grads = math.fsum(n.grads[b] - n.grads[a] for a, b in stages) * p.grad_bytes
        return grads, math.fsum(n.backward_prefix[b] - n.backward_prefix[a] for a, b in stages)

    def staging(self, c: Candidate, stages) -> float:
        """Seconds of the pass that divides the ``stages``' local gradients into their bucket slots (read
        and written once), at the slowest device's memory bandwidth; 0 without dp (nor cp: its gradients
        are summed over dp x cp)."""
        if c.dp * c.cp == 1:
            return 0.0
        grads = self.rank_grads(c, stages)[0]
        return max(compute_time(0.0, 2 * grads, device, "fp32", is_matmul=False) for device in self._devices)

    def estimate(self, c: Candidate, rank: int, stages) -> float:
        """Buckets of equal size filled at an even rate: the all-reduce queue ends either after the
        last bucket (ready when the backward ends) or after all buckets queued behind the first,
        whichever is later (the maximum of ``exposed_comm_time``'s recurrence, which is linear in
        the bucket index here)."""
        p = self.pricer
        grads, backward = self.rank_grads(c, stages)
        if grads <= 0:
            return 0.0
        cap, group = bucket_elements(c.dp) * p.grad_bytes, p.dp_group(c, rank)
        full, rest = divmod(grads, cap)
        kind = "reduce_scatter" if c.zero_stage else "all_reduce"
        last = p.cost(kind, rest or cap, group)
        count = full + (rest > 0)
        total = (count - 1) * p.cost(kind, cap, group) + last
        gather = self.zero_gather(c, grads, group, stages)
        if not p.overlap:
            return total + gather
        return max(last, backward * min(1.0, cap / grads) + total - backward) + gather

    def zero_gather(self, c: Candidate, grads: float, group, stages=()) -> float:
        """The all-gather of every bucket's parameters, fp32. ZeRO-1: before the next forward, all exposed.
        ZeRO-3: at the first forward, bucket k+1's issued as bucket k's block starts
        (``exposed_prefetched_gathers``; each bucket's share of the ``stages``' forward its gradients'
        share): the first bucket's gather is exposed, the others where they outlast a bucket's forward."""
        p = self.pricer
        if not c.zero_stage or grads <= 0:
            return 0.0
        scale, cap = PARAM_STORAGE_BYTES / p.grad_bytes, bucket_elements(c.dp) * p.grad_bytes
        full, rest = divmod(grads, cap)
        if c.zero_stage == 1 or not p.overlap:
            return full * p.cost("all_gather", cap * scale, group) + (
                p.cost("all_gather", rest * scale, group) if rest else 0.0)
        n = p.units(c)
        forward = math.fsum(math.fsum(n.seconds[a:b]) - (n.backward_prefix[b] - n.backward_prefix[a])
                            for a, b in stages)
        if full == 0:  # one bucket: its gather is all exposed
            return p.cost("all_gather", rest * scale, group)
        # exposed_prefetched_gathers' closed form over full equal buckets and the remainder last, in O(1)
        # (a rank of a dp-only mesh holds hundreds of buckets, priced for each of ~10^4 candidates)
        whole, per = p.cost("all_gather", cap * scale, group), forward * cap / grads
        tail = max(0.0, p.cost("all_gather", rest * scale, group) - per) if rest else 0.0
        return whole + (full - 1) * max(0.0, whole - per) + tail

    def exact(self, c: Candidate, rank: int, stages) -> float:
        """Buckets filled in backward order (last unit first), a unit's gradients arriving evenly
        over its backward; all-reduces queued on one stream (``exposed_comm_time``)."""
        p = self.pricer
        n, cap = p.units(c), bucket_elements(c.dp) * p.grad_bytes
        group, kind = p.dp_group(c, rank), "reduce_scatter" if c.zero_stage else "all_reduce"
        comm, backward, filled, elapsed = [], [], 0.0, 0.0
        for u in reversed([u for a, b in stages for u in range(a, b)]):
            left = (n.grads[u + 1] - n.grads[u]) * p.grad_bytes
            rate = n.backward[u] / left if left else 0.0
            elapsed += 0.0 if left else n.backward[u]
            while left > 0:
                room = cap - filled
                if left < room:
                    filled, elapsed, left = filled + left, elapsed + left * rate, 0.0
                    break
                comm.append(p.cost(kind, cap, group))
                backward.append(elapsed + room * rate)
                left, filled, elapsed = left - room, 0.0, 0.0
        if filled:
            comm.append(p.cost(kind, filled, group))
            backward.append(elapsed)
        elif elapsed:  # backward of units with no parameters after the last bucket is ready
            comm.append(0.0)
            backward.append(elapsed)
        gather = self.zero_gather(c, self.rank_grads(c, stages)[0], group, stages)
        return (exposed_comm_time(comm, backward) if p.overlap else math.fsum(comm)) + gather
