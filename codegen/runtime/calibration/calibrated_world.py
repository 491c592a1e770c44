"""The World ``xirang calibrate`` writes, fitted from what its microbenchmarks measured on every rank
(``codegen/runtime/calibration/calibrate.py`` runs them).

- Compute: each rate is the slope of ``seconds = c + work / rate`` over the timed sizes (least squares,
  ``ir/calibration.fit_line``); the intercept c is the op's fixed cost there. The matmul and memory
  efficiencies are 1: nothing is left for a datasheet derating. Non-matmul FLOPs and fused attention
  were timed too: their efficiencies are their measured rates over the matmul's (a CPU core runs
  gelu or a layer norm at a few percent of its matmul rate, and its flash-attention kernel at about
  half), files written before had none. Each non-matmul kind (gelu, layer norm, softmax,
  cross-entropy) has its own line too: its rate (``Calibration.other_kind_efficiency``, a fraction of
  the matmul's) and its intercept (``op_fixed_s[kind]``); the class rate is fitted over their sums,
  and the class's fixed cost, which the other non-matmul ops pay (adds and multiplies mostly), is the
  add's intercept. The add and those kinds are timed with their inputs out of cache
  (``calibrate.cache_flush``), as training meets them. Each kind also gets bands by size
  (``Calibration.other_kind_bands``, ``size_bands``): between each two neighbouring sizes timed, the
  line through those two, since these ops slow per element as their tensors outgrow the caches.
- Ranks sharing cores (N ranks on C cores): compute is timed on rank 0 alone, and every figure is
  brought to every rank busy: seconds times N / C (each rank gets C / N of a core) times what the
  same work's CPU grows by beside the other ranks. That growth is the training workload's together
  / alone CPU (``sharing``), split by its two sizes into a per-row part, which slows the
  FLOP rates, and a per-call part, which slows the per-op fixed costs (``training_slowdowns``: time
  slicing costs small ops far more than FLOPs). ``parallel_ranks`` k = C over the FLOP part: how many
  ranks compute at full speed at once. ``waiting_share``: where between "a waiting rank costs
  nothing" and "as much as a busy one" the pipeline's waiting ranks are.
- Recompute: a block stack's step with every block checkpointed, less its plain step and one more
  forward, over the tensors its forward saves (``Calibration.recompute_saved_s``): the non-reentrant
  checkpoint's hooks cost per saved tensor, beyond the forward that a full recompute runs again.
- Split backward (zero-bubble schedules): a transformer stage's forward with its split backward (B
  then W, as the executor runs them) less its forward with the fused backward, over the fused
  backward (``Calibration.split_backward_extra``).
- Pipeline messages on shared cores: the CPU one message takes, both sides (the mean rank's, a
  line in its bytes), times N / C (``Calibration.pipeline_message_s``).
- Collectives: one alpha-beta line per kind and group size (``CollectiveFit``), from the slowest rank
  of each sample back to back, or from the mean rank where each call followed a chunk of work (the
  compute price already puts that work at the mean rank's).
"""
from __future__ import annotations

import os
import statistics
from typing import Sequence

import torch

from xirang.codegen.runtime.calibration.op_classes import KIND_GRADIENTS
from xirang.ir.calibration import Calibration, CollectiveFit, fit_line
from xirang.ir.device import DeviceSpec, Efficiency
from xirang.ir.world import LinkSpec, NodeSpec, World


def _slowest(per_rank: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Sample-wise worst over ranks of [[x, seconds], ...] lists measured at the same x."""
    return [[rows[0][0], max(row[1] for row in rows)] for rows in zip(*per_rank)]


def _mean(per_rank: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Sample-wise mean over ranks of [[x, seconds], ...] lists measured at the same x."""
    return [[rows[0][0], statistics.fmean(row[1] for row in rows)] for rows in zip(*per_rank)]


def _rate(samples: Sequence[Sequence[float]], what: str) -> tuple[float, dict]:
    """Work per second of ``seconds ≈ c + work / rate`` fitted to (work, seconds) samples; the
    intercept c is the op's fixed cost at these sizes. Returns the rate and the fit for the file."""
    c, per_unit, residual = fit_line([s[0] for s in samples], [s[1] for s in samples])
    fit = {"intercept_s": c, "residual": residual, "samples": [list(s) for s in samples]}
    if per_unit <= 0:
        # noise hid the growth with size (tiny --quick sizes on a busy machine): the throughput of
        # the largest sample, all its time counted as work, is the conservative rate
        work, seconds = max(samples)
        fit.update(intercept_s=0.0, note=f"{what}: time did not grow with size; rate of the largest sample")
        return work / seconds, {**fit, "rate": work / seconds}
    return 1.0 / per_unit, {**fit, "rate": 1.0 / per_unit}


def _per_call_and_row(small: dict, large: dict, key: str) -> tuple[float, float]:
    """(seconds per call, seconds per row) of the training workload from its two sizes' ``key`` CPU
    seconds: each timed call is ``repeats`` passes of ``fixed + rows · per_row``."""
    a_small, a_large = small[key] / small["repeats"], large[key] / large["repeats"]
    per_row = (a_large - a_small) / (large["rows"] - small["rows"])
    return a_small - small["rows"] * per_row, per_row


def training_slowdowns(sharing: dict) -> tuple[float, float] | None:
    """(FLOP slowdown, fixed-cost slowdown) of ranks that train: each part's together / alone CPU,
    never below 1; None without the training workload. With one size only, both are its whole ratio."""
    training, small = sharing.get("training"), sharing.get("training_small")
    if not training or training.get("alone_cpu_s", 0.0) <= 0:
        return None
    whole = max(1.0, training["together_cpu_s"] / training["alone_cpu_s"])
    if not small or small.get("rows") is None or training.get("rows", 0) <= small["rows"]:
        return whole, whole
    fixed_alone, row_alone = _per_call_and_row(small, training, "alone_cpu_s")
    fixed_together, row_together = _per_call_and_row(small, training, "together_cpu_s")
    if min(fixed_alone, row_alone, fixed_together, row_together) <= 0:  # noise swamped one part
        return whole, whole
    return max(1.0, row_together / row_alone), max(1.0, fixed_together / fixed_alone)


def split_backward_extra(sample: dict | None) -> float | None:
    """The split backward's extra time over the fused backward, as a fraction of the fused one, from
    ``op_classes.split_backward_sample`` (never below 0); None without the sample. A ratio of
    two times of the same rank: where ranks share cores both grow alike, so no N / C scaling applies."""
    if not sample or sample["fused_s"] <= sample["forward_s"]:
        return None
    return max(0.0, (sample["split_s"] - sample["fused_s"]) / (sample["fused_s"] - sample["forward_s"]))


def other_kind_samples(other) -> tuple[dict, list]:
    """({kind: samples}, the class's samples) of ``compute["other"]``: per kind (``other_samples``),
    the class's a sum of one op of each kind at each size; results measured before kinds were timed
    apart hold the class's samples only."""
    if not isinstance(other, dict):
        return {}, other
    per_kind = {kind: samples for kind, samples in other.items() if samples}
    class_samples = [[sum(column[0] for column in at_size), sum(column[1] for column in at_size)]
                     for at_size in zip(*per_kind.values())]
    return per_kind, class_samples


def size_bands(samples, peak: float, dispatch_s: float) -> list:
    """``Calibration.other_kind_bands`` of one kind (before the sharing scaling): [up to FLOPs, rate as a
    fraction of ``peak``, fixed seconds beyond ``dispatch_s``] for each pair of neighbouring sizes timed
    (samples at one size: their median), the line through the pair (``fit_line``: both terms kept
    non-negative), the last band open. Fewer than two sizes: none."""
    by_size: dict = {}
    for flops, seconds in samples:
        by_size.setdefault(float(flops), []).append(float(seconds))
    points = sorted((flops, statistics.median(times)) for flops, times in by_size.items())
    out = []
    for i, ((f0, t0), (f1, t1)) in enumerate(zip(points, points[1:])):
        alpha, beta, _ = fit_line([f0, f1], [t0, t1])
        rate = min(1.0, 1.0 / beta / peak) if beta > 0 else 1.0
        out.append([None if i == len(points) - 2 else f1, rate, max(0.0, alpha - dispatch_s)])
    return out


def calibrated_world(results: Sequence[dict], *, backend: str, device: str) -> World:
    """The World of one node of ``len(results)`` devices, every figure measured (see module doc)."""
    ranks = len(results)
    raw: dict = {"threads_per_rank": results[0]["threads"], "cpu_count": os.cpu_count()}
    compute, sharing = results[0]["compute"], results[0]["sharing"]
    # N ranks on k cores (``sharing``; GPUs: k = N): what the pipeline's idle ranks give back
    parallel, waiting, slowdown, fixed_slowdown, cores = float(ranks), 0.0, 1.0, 1.0, ranks
    if sharing is not None and sharing["together_s"] > 0:
        # N ranks on C cores, every rank busy: each gets C / N of a core, and its work takes more CPU
        # beside the others (the training workload's together / alone CPU, its per-row part for FLOPs,
        # its per-call part for fixed costs): seconds alone times N / C times that
        cores = min(results[0].get("cores") or os.cpu_count() or 1, ranks)
        raw["sharing"] = dict(sharing)
        flops_ratio, fixed_ratio = 1.0, 1.0
        slowdowns = training_slowdowns(sharing)
        if slowdowns is not None:
            flops_ratio, fixed_ratio = slowdowns
            raw["training_slowdown"], raw["fixed_cost_slowdown"] = slowdowns
            sharing = sharing["training"]
        slowdown, fixed_slowdown = ranks / cores * flops_ratio, ranks / cores * fixed_ratio
        parallel = cores / flops_ratio
        # where between "a waiting rank costs nothing" (rank 0 beside waiters as fast as alone) and
        # "as much as a busy one" (as slow as with every rank busy) the pipeline's waiting ranks are
        spread = sharing["together_s"] - sharing["alone_s"]
        waiting = (sharing["beside_waiters_s"] - sharing["alone_s"]) / spread if spread > 0 else 0.0
        waiting = min(1.0, max(0.0, waiting))
    peaks = {}  # rates of one rank on its own; slowed below to every rank busy where cores are shared
    for dtype, samples in compute["matmul"].items():
        peaks[dtype], raw[f"matmul_{dtype}"] = _rate(samples, f"{dtype} matmul")
    # fp16 is not timed: priced at the bf16 rate, the other 16-bit path (CPUs without fp16 units
    # upcast both)
    peaks["fp16"] = peaks.get("bfloat16", peaks["float32"])
    bandwidth, raw["elementwise"] = _rate(compute["elementwise"], "elementwise add")
    op_forward, op_backward = compute["op_forward_s"], compute["op_backward_s"]
    # each class's intercept less the dispatches the per-op costs already price (Calibration.op_fixed_s):
    # a matmul sample is one linear op whose backward gives three gradients, as is an attention
    # sample
    def beyond_three_gradients(intercept: float) -> float:
        return max(0.0, intercept - op_forward - 3 * op_backward)
    fixed = {"matmul": beyond_three_gradients(raw["matmul_float32"]["intercept_s"])}
    other, attention = 1.0, None  # a calibration without these samples: as every rank's matmul rate
    kinds = {}  # each non-matmul kind's rate as a fraction of the matmul's (Calibration.other_kind_efficiency)
    bands = {}  # and its bands by size (Calibration.other_kind_bands)
    if compute.get("other"):
        per_kind, class_samples = other_kind_samples(compute["other"])
        rate, raw["other_flops"] = _rate(class_samples, "non-matmul ops")
        other = min(1.0, rate / peaks["float32"])
        for kind, samples in per_kind.items():
            rate, raw[f"other_{kind}"] = _rate(samples, kind)
            kinds[kind] = min(1.0, rate / peaks["float32"])
            dispatches = op_forward + KIND_GRADIENTS[kind] * op_backward  # what the per-op costs price
            fixed[kind] = max(0.0, raw[f"other_{kind}"]["intercept_s"] - dispatches)
            bands[kind] = size_bands(samples, peaks["float32"], dispatches)
        if per_kind:
            # each kind pays its own; the class's fixed cost is then the rest's, adds and multiplies
            # mostly: the add's (its line's intercept, a forward alone). Their backward passes the
            # gradient on, which the per-op backward cost prices.
            fixed["other"] = max(0.0, raw["elementwise"]["intercept_s"] - op_forward)
        else:  # results from before the kinds were timed apart: a class sample is three ops, one gradient each
            fixed["other"] = max(0.0, raw["other_flops"]["intercept_s"] / 3 - op_forward - op_backward)
    by_seq = {}  # sequence length -> (rate fraction, fixed seconds): Calibration.attention_by_seq
    if compute.get("attention"):
        samples = compute["attention"]  # [FLOPs, seconds] or, timed per sequence length, [FLOPs, seconds, seq]
        rate, raw["attention"] = _rate([s[:2] for s in samples], "fused attention")
        attention = min(1.0, rate / peaks["float32"])
        fixed["attention"] = beyond_three_gradients(raw["attention"]["intercept_s"])
        for seq in sorted({int(s[2]) for s in samples if len(s) > 2}):
            rows = [s[:2] for s in samples if len(s) > 2 and int(s[2]) == seq]
            if len(rows) > 1:  # a line needs two sizes
                rate, raw[f"attention_seq{seq}"] = _rate(rows, f"fused attention at seq {seq}")
                by_seq[seq] = (min(1.0, rate / peaks["float32"]),
                               beyond_three_gradients(raw[f"attention_seq{seq}"]["intercept_s"]))
    recompute_saved = 0.0  # checkpoint's cost per saved tensor beyond the forward it runs again
    sample = compute.get("recompute")
    if sample and sample.get("saved_tensors"):
        extra = sample["checkpointed_s"] - sample["plain_s"] - sample["forward_s"]
        raw["recompute"] = dict(sample)
        recompute_saved = max(0.0, extra) / sample["saved_tensors"]
    split_extra = split_backward_extra(compute.get("split_backward"))
    if split_extra is not None:
        raw["split_backward"] = dict(compute["split_backward"])
    # every compute figure at what ranks that train get (the classes' rate ratios stay)
    peaks = {dtype: rate / slowdown for dtype, rate in peaks.items()}
    bandwidth = bandwidth / slowdown
    op_forward, op_backward = op_forward * fixed_slowdown, op_backward * fixed_slowdown
    fixed = {name: seconds * fixed_slowdown for name, seconds in fixed.items()}
    by_seq = {seq: (rate, seconds * fixed_slowdown) for seq, (rate, seconds) in by_seq.items()}
    bands = {kind: [(upper, rate, seconds * fixed_slowdown) for upper, rate, seconds in kind_bands]
             for kind, kind_bands in bands.items() if kind_bands}
    recompute_saved *= fixed_slowdown  # hooks and bookkeeping: a per-call cost, as the fixed ones
    raw["collectives_in_context"] = sharing is not None
    raw["note"] = ("rates and per-op costs are one rank's with every rank busy (where ranks share cores: "
                   "timed alone, slowed by N / C and the training workload's growth)")
    fits = []
    for key in results[0]["collectives"]:
        kind, size = key.split("/")
        per_rank = [r["collectives"][key] for r in results]
        # back to back, a collective ends at its slowest rank; in context, each rank's time runs from
        # the end of its own work, which the compute price already puts at the mean rank's: the mean
        samples = _mean(per_rank) if results[0]["sharing"] is not None else _slowest(per_rank)
        fits.append(CollectiveFit.fitted(kind, int(size), backend, [tuple(s) for s in samples]))
    message = None  # a pipeline message's CPU, both sides, at every rank busy: measured CPU times N / C
    rows = [r.get("message_cpu") for r in results]
    if sharing is not None and all(rows):
        samples = _mean(rows)
        # a size whose mean is not positive is one the noise of the rounds without messages swallowed:
        # no figure to fit; under two sizes left, messages go unpriced and the file says why
        measured = [s for s in samples if s[1] > 0]
        raw["pipeline_message"] = {"cpu_samples": samples, "ranks_per_core": ranks / cores}
        if len(measured) >= 2:
            per_message, per_byte, residual = fit_line([x for x, _ in measured], [y for _, y in measured])
            message = (per_message * ranks / cores, per_byte * ranks / cores)
            raw["pipeline_message"]["residual"] = residual
        else:
            raw["pipeline_message"]["note"] = (f"not priced: {len(samples) - len(measured)} of {len(samples)} "
                                               "sizes measured no CPU above the rounds without messages")
    on_gpu = device.startswith("cuda")
    if on_gpu:
        memory = torch.cuda.get_device_properties(0).total_memory
    else:  # the ranks share the host's memory
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks
    spec = DeviceSpec(
        name="cpu" if not on_gpu else torch.cuda.get_device_name(0).lower().replace(" ", "-"),
        peak_flops={"fp32": peaks["float32"], "bf16": peaks.get("bfloat16", peaks["float32"]),
                    "fp16": peaks["fp16"]},
        memory_bytes=int(memory), memory_bandwidth=bandwidth,
        # a CPU's host link is a copy within its own memory: read and written, half the bandwidth
        # each way (as the "cpu" preset); a GPU's is PCIe, not measured here
        host_link_bytes_per_s=bandwidth / 2 if not on_gpu else None,
        op_overhead_s=op_forward,
        # the peaks above are rates reached at training sizes with every rank busy: nothing is left
        # for a datasheet derating to discount; the other ops' rates are measured as fractions of them
        efficiency=Efficiency(matmul=1.0, other=other, memory=1.0, attention=attention))
    send = next((f for f in fits if f.kind == "send"), None)
    link = LinkSpec(1.0 / send.beta if send and send.beta else 1e12, send.alpha if send else 0.0)
    raw["inter_node"] = "not measured: one node; the intra-node link stands in for it"
    calibration = Calibration(ranks, backend, "cuda" if on_gpu else "cpu", tuple(fits), op_backward,
                              # gloo's communication threads run on the cores the ranks compute on
                              comm_overlaps_compute=on_gpu, raw=raw, parallel_ranks=float(parallel),
                              waiting_share=waiting, op_fixed_s=fixed, recompute_saved_s=recompute_saved,
                              pipeline_message_s=message, split_backward_extra=split_extra or 0.0,
                              attention_by_seq=by_seq, other_kind_bands=bands,
                              # fractions of the matmul peak: they follow its N / C x growth scaling
                              other_kind_efficiency=kinds)
    return World((NodeSpec(ranks, spec),), link, link, calibration)
