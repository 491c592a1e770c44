"""What ``xirang calibrate`` measured on the machine at hand: collective prices per (kind, group size)
and the compute facts the cost model reads, with every raw sample and each fit's residual kept so a
person can see how well the straight lines hold.

A ``Calibration`` rides on a ``World`` (``World.calibration``) and round-trips in its JSON. The cost
model prices a collective of a kind and group size it holds with the measured line
``alpha + beta * nbytes`` instead of the link-level formulas (``passes/planning/cost_collectives``).
Pure data: the microbenchmarks live in ``codegen/runtime/calibration/calibrate.py``, the fits here (no torch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

from xirang.ir.errors import InvalidValue
from xirang.ir.plan_parts import COLLECTIVE_KINDS

CALIBRATION_VERSION = 1
# The kinds the cost model prices, one list with the plan's; nbytes follows its convention: one rank's full
# buffer (all_reduce: the buffer; reduce_scatter: each rank's input; all_gather: each rank's output;
# all_to_all: each rank's send buffer; broadcast: the root's buffer; send: the message).


def _number(value, what: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise InvalidValue(f"{what} must be a {kind} finite number, got {value!r}")
    return float(value)


def fit_line(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares fit of ``seconds ≈ alpha + beta · size`` with alpha, beta >= 0.

    Formulation: minimise Σ_i ((t_i - alpha - beta·n_i) / t_i)², the error *relative* to each sample,
    so a 10 µs sample counts as much as a 10 ms one (an absolute fit would let the largest message
    set alpha, and the small messages that alpha prices would be ignored). Closed form of the 2x2
    weighted normal equations (weights w_i = 1/t_i²); if the unconstrained optimum has a negative
    coordinate, that coordinate is fixed at 0 and the other refitted alone (the constrained optimum
    of a convex quadratic lies on that edge). Returns (alpha, beta, residual), residual the root mean
    square relative error of the fitted line over the samples.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise InvalidValue(f"fit_line needs at least two (size, seconds) samples of equal count, got "
                           f"{len(sizes)} sizes and {len(seconds)} times")
    n = [_number(s, "a sample size") for s in sizes]
    t = [_number(s, "a sample time", positive=True) for s in seconds]
    w = [1.0 / ti ** 2 for ti in t]
    sw, sn, snn = sum(w), sum(wi * ni for wi, ni in zip(w, n)), sum(wi * ni * ni for wi, ni in zip(w, n))
    st, snt = sum(wi * ti for wi, ti in zip(w, t)), sum(wi * ni * ti for wi, ni, ti in zip(w, n, t))
    det = sw * snn - sn * sn
    alpha, beta = ((snn * st - sn * snt) / det, (sw * snt - sn * st) / det) if det > 0 else (-1.0, -1.0)
    if alpha < 0 or beta < 0 or det <= 0:
        only_beta = (0.0, snt / snn if snn > 0 else 0.0)  # alpha = 0 edge
        only_alpha = (st / sw, 0.0)  # beta = 0 edge
        alpha, beta = min((only_beta, only_alpha), key=lambda ab: _relative_sse(ab, n, t))
    residual = math.sqrt(_relative_sse((alpha, beta), n, t) / len(n))
    return alpha, beta, residual


def _relative_sse(ab, n, t) -> float:
    return sum(((ti - ab[0] - ab[1] * ni) / ti) ** 2 for ni, ti in zip(n, t))


@dataclass(frozen=True)
class CollectiveFit:
    """The measured price of one collective ``kind`` on groups of ``group_size`` ranks over ``backend``:
    ``seconds(nbytes) = alpha + beta · nbytes`` (alpha in s, beta in s/byte), fitted over ``samples``
    ((nbytes, median seconds) pairs, all groups of that size running at once), with ``residual`` the
    fit's RMS relative error."""

    kind: str
    group_size: int
    backend: str
    alpha: float
    beta: float
    samples: tuple[tuple[float, float], ...] = ()
    residual: float = 0.0

    def __post_init__(self):
        if self.kind not in COLLECTIVE_KINDS:
            raise InvalidValue(f"CollectiveFit kind {self.kind!r} is unknown; known: {', '.join(COLLECTIVE_KINDS)}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2:
            raise InvalidValue(f"CollectiveFit {self.kind}: group_size must be an int >= 2, got {self.group_size!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise InvalidValue(f"CollectiveFit {self.kind}: backend must be a non-empty str, got {self.backend!r}")
        object.__setattr__(self, "alpha", _number(self.alpha, f"CollectiveFit {self.kind} alpha"))
        object.__setattr__(self, "beta", _number(self.beta, f"CollectiveFit {self.kind} beta"))
        object.__setattr__(self, "residual", _number(self.residual, f"CollectiveFit {self.kind} residual"))
        object.__setattr__(self, "samples", tuple((float(n), float(s)) for n, s in self.samples))

    @classmethod
    def fitted(cls, kind: str, group_size: int, backend: str,
               samples: Sequence[tuple[float, float]]) -> "CollectiveFit":
        """The least-squares line (``fit_line``) through ``samples``."""
        alpha, beta, residual = fit_line([n for n, _ in samples], [s for _, s in samples])
        return cls(kind, group_size, backend, alpha, beta, tuple(samples), residual)

    def seconds(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes

    def to_json(self) -> dict:
        return {"kind": self.kind, "group_size": self.group_size, "backend": self.backend,
                "alpha_s": self.alpha, "beta_s_per_byte": self.beta,
                "bandwidth_bytes_per_s": 1.0 / self.beta if self.beta else None,
                "residual": self.residual, "samples": [list(s) for s in self.samples]}

    @classmethod
    def from_json(cls, data: dict) -> "CollectiveFit":
        keys = {"kind", "group_size", "backend", "alpha_s", "beta_s_per_byte"}
        if not isinstance(data, dict) or not keys <= set(data):
            raise InvalidValue(f"bad collective fit {data!r}: expected an object with the keys "
                               f"{', '.join(sorted(keys))} "
                               f"(and optionally residual, samples, bandwidth_bytes_per_s)")
        return cls(data["kind"], data["group_size"], data["backend"], data["alpha_s"], data["beta_s_per_byte"],
                   tuple(tuple(s) for s in data.get("samples", ())), data.get("residual", 0.0))


OP_CLASSES = ("matmul", "attention", "other")  # Calibration.op_fixed_s: products, fused attention, the rest
# The non-matmul op kinds timed apart (Calibration.other_kind_efficiency, and their own op_fixed_s): per
# element a CPU core runs them at rates 1.7x apart, so one "other" rate prices gelu too fast and a layer
# norm too slow. "softmax" stands for softmax and log-softmax; cross-entropy is its own kind (its
# backward also fills a gradient as large as the logits, so it ran at half its log-softmax's rate).
OTHER_KINDS = ("gelu", "layer_norm", "softmax", "cross_entropy")


@dataclass(frozen=True)
class Calibration:
    """One calibration run on ``ranks`` local ranks of ``device_kind`` ("cpu" or "cuda") over ``backend``.

    - ``collectives``: the measured lines, at most one per (kind, group size).
    - ``backward_op_overhead_s``: fixed seconds the backward adds per op that needs a gradient (an
      autograd node run and its gradient kernel's dispatch), beside ``DeviceSpec.op_overhead_s``
      for the forward dispatch.
    - ``comm_overlaps_compute``: whether a collective in flight runs beside compute without slowing
      it. False where the ranks' communication threads share the cores that compute (CPU ranks,
      gloo): the cost model then leaves no gradient sync hidden behind the backward.
    - ``parallel_ranks``: how many of the ranks run at full speed at once: ``ranks`` where each has its
      own device; on CPU ranks sharing fewer cores, the effective core count, ranks / (a matmul's
      time with every rank busy / its time with one rank busy); below 1 where the job gets less than
      a core (other load, switching among ranks). None: not measured (as ``ranks``).
    - ``waiting_share``: on shared cores, what a rank waiting for a message (a pipeline rank in its
      bubble) costs the busy ones, as a fraction of what a busy rank costs them: 0 where waiting
      blocks, 1 where it spins as hard as compute.
    - ``op_fixed_s``: per op class ("matmul", "attention", "other") and per non-matmul kind timed apart
      (``OTHER_KINDS``, which then pay theirs in place of the class's), the fixed seconds one call costs
      forward and backward beyond its dispatch (``DeviceSpec.op_overhead_s`` and the backward's per-op
      cost): the intercept of the class's measured line ``seconds = c + FLOPs / rate`` at training
      sizes (packing, blocking and threading set-up that does not shrink with the work). It weighs
      at small micro-batches: a CPU's matmul of 128 rows spends about a third of its time there.
    - ``recompute_saved_s``: what a recomputed region costs per tensor its ops save for the backward,
      beyond running its forward again (``torch.utils.checkpoint``'s saved-tensor hooks: a handle
      packed in the forward, the recompute found and its value unpacked in the backward; measured as
      a block stack's checkpointed step less its plain step and one more forward, over the tensors
      saved). 0: not measured (a full recompute then costs one more forward, as on the presets).
    - ``pipeline_message_s``: on shared cores, what one pipeline message (a cut's activation, or its
      gradient) costs the ranks in CPU, both sides together (the isend and irecv calls, gloo's loop
      thread copying it through loopback, and the caches the compute around it then refills), at the
      rate of every rank busy (its measured CPU times ranks / cores), as (seconds per message, seconds
      per byte). Its wall time alone (the "send" line) leaves this out: a message's CPU is taken from
      cores the other ranks compute on. None: not measured (GPUs, or files written before).
    - ``split_backward_extra``: what a split backward (the zero-bubble schedules' BackwardInput then
      BackwardWeight, as the pipeline executor runs them) costs beyond the fused backward, as a fraction
      of the fused backward's time: measured on a stage of transformer blocks at training rows
      (``calibration/op_classes.split_backward_sample``). On CPU ranks it is 0.2-0.3 (the weights' gradients
      run as one autograd call per weight group, after B, from gradients B kept). 0: not measured (the
      two halves priced as the fused backward, as on the presets and GPUs).
    - ``other_kind_efficiency``: per non-matmul op kind (``OTHER_KINDS``), its measured FLOP rate as
      a fraction of the fp32 matmul peak, as ``Efficiency.other`` is for the whole class (fitted from
      the kind's own samples, ``calibration/op_classes.other_samples``): the cost model prices a node of
      that kind at it, any other non-matmul node at ``Efficiency.other``. Empty: not measured (files
      written before; every kind at the class rate).
    - ``attention_by_seq``: per sequence length timed apart, fused attention's (rate as a fraction of
      the fp32 matmul peak, fixed seconds per call beyond its dispatches), each from its own line: a
      CPU's flash-attention kernel runs seq 128 at about two thirds of its seq-512 rate per counted
      FLOP. The cost model prices a node at the line of the nearest sequence length; empty (files
      written before): at ``Efficiency.attention`` and ``op_fixed_s["attention"]``.
    - ``other_kind_bands``: per non-matmul op kind, its measured time between the sizes timed, as
      bands of FLOPs (forward and backward, as the analysis counts them): ``[[up to FLOPs, rate fraction,
      fixed seconds], ...]`` in increasing order, the last band open (``None``), each the line through
      the two samples that bound it. Why: a CPU runs these ops at a rate that falls as their tensors
      outgrow its caches (on the development box log-softmax 2.0 ns an element up to 2 M elements, 3.3
      at 4 M, 4.4 at 8 M), so one line through every size priced a large cross-entropy 3x fast. The
      cost model prices a node of that kind at the band of its local FLOPs; empty (files written
      before): at ``other_kind_efficiency`` and the kind's ``op_fixed_s``.
    - ``raw``: every measurement (compute samples, fits' inputs) as JSON data, for people to read.
    """

    ranks: int
    backend: str
    device_kind: str
    collectives: tuple[CollectiveFit, ...] = ()
    backward_op_overhead_s: float = 0.0
    comm_overlaps_compute: bool = True
    raw: Mapping = field(default_factory=dict)
    parallel_ranks: Optional[float] = None
    waiting_share: float = 0.0
    op_fixed_s: Mapping[str, float] = field(default_factory=dict)
    recompute_saved_s: float = 0.0
    pipeline_message_s: Optional[tuple] = None
    split_backward_extra: float = 0.0
    other_kind_efficiency: Mapping[str, float] = field(default_factory=dict)
    attention_by_seq: Mapping[int, tuple] = field(default_factory=dict)
    other_kind_bands: Mapping[str, tuple] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise InvalidValue(f"Calibration ranks must be a positive int, got {self.ranks!r}")
        fits = tuple(self.collectives)
        if not all(isinstance(f, CollectiveFit) for f in fits):
            raise InvalidValue(f"Calibration collectives must be CollectiveFit objects, got {fits!r}")
        keys = [(f.kind, f.group_size) for f in fits]
        if len(set(keys)) != len(keys):
            raise InvalidValue(f"Calibration holds two fits for one (kind, group size): {sorted(keys)}")
        object.__setattr__(self, "collectives", fits)
        object.__setattr__(self, "backward_op_overhead_s",
                           _number(self.backward_op_overhead_s, "Calibration backward_op_overhead_s"))
        object.__setattr__(self, "raw", MappingProxyType(dict(self.raw)))
        object.__setattr__(self, "recompute_saved_s",
                           _number(self.recompute_saved_s, "Calibration recompute_saved_s"))
        object.__setattr__(self, "split_backward_extra",
                           _number(self.split_backward_extra, "Calibration split_backward_extra"))
        share = _number(self.waiting_share, "Calibration waiting_share")
        if share > 1:
            raise InvalidValue(f"Calibration waiting_share must be a fraction in [0, 1], got {share!r}")
        object.__setattr__(self, "waiting_share", share)
        if self.parallel_ranks is not None:
            value = _number(self.parallel_ranks, "Calibration parallel_ranks", positive=True)
            object.__setattr__(self, "parallel_ranks", min(value, float(self.ranks)))
        if self.pipeline_message_s is not None:
            line = tuple(self.pipeline_message_s)
            if len(line) != 2:
                raise InvalidValue(f"Calibration pipeline_message_s must be (seconds per message, seconds per "
                                   f"byte), got {self.pipeline_message_s!r}")
            object.__setattr__(self, "pipeline_message_s", tuple(
                _number(v, "Calibration pipeline_message_s") for v in line))
        object.__setattr__(self, "_table", {key: f for key, f in zip(keys, fits)})
        fixed = dict(self.op_fixed_s)
        if not set(fixed) <= set(OP_CLASSES + OTHER_KINDS):
            raise InvalidValue(f"Calibration op_fixed_s keys must be among {OP_CLASSES + OTHER_KINDS}, "
                               f"got {sorted(fixed)}")
        object.__setattr__(self, "op_fixed_s", MappingProxyType(
            {name: _number(value, f"Calibration op_fixed_s[{name!r}]") for name, value in fixed.items()}))
        kinds = dict(self.other_kind_efficiency)
        if not set(kinds) <= set(OTHER_KINDS):
            raise InvalidValue(f"Calibration other_kind_efficiency keys must be among {OTHER_KINDS}, "
                               f"got {sorted(kinds)}")
        for name, value in kinds.items():
            if _number(value, f"Calibration other_kind_efficiency[{name!r}]", positive=True) > 1:
                raise InvalidValue(f"Calibration other_kind_efficiency[{name!r}] must be a fraction in (0, 1], "
                                   f"got {value!r}")
        object.__setattr__(self, "other_kind_efficiency",
                           MappingProxyType({name: float(value) for name, value in kinds.items()}))
        lines = {}
        for seq, line in dict(self.attention_by_seq).items():
            where = f"Calibration attention_by_seq[{seq!r}]"
            key = int(seq) if isinstance(seq, str) and seq.isdigit() else seq  # JSON keys are strings
            if isinstance(key, bool) or not isinstance(key, int) or key < 1 or not isinstance(line, (list, tuple)) \
                    or len(line) != 2:
                raise InvalidValue(f"{where} must map a positive sequence length to (rate fraction, fixed "
                                   f"seconds), got {seq!r}: {line!r}")
            rate, fixed = (_number(value, where) for value in line)
            if not 0 < rate <= 1:
                raise InvalidValue(f"{where}: the rate must be a fraction in (0, 1], got {rate!r}")
            lines[key] = (rate, fixed)
        object.__setattr__(self, "attention_by_seq", MappingProxyType(dict(sorted(lines.items()))))
        object.__setattr__(self, "other_kind_bands", MappingProxyType(
            {kind: _bands(kind, bands) for kind, bands in dict(self.other_kind_bands).items()}))

    def attention_line(self, seq: float) -> Optional[tuple]:
        """``attention_by_seq``'s line at the measured sequence length nearest ``seq`` (by ratio), or None
        where none was measured."""
        if not self.attention_by_seq or not seq > 0:
            return None
        nearest = min(self.attention_by_seq, key=lambda measured: (abs(math.log(measured / seq)), measured))
        return self.attention_by_seq[nearest]

    def other_kind_line(self, kind: Optional[str], flops: float) -> Optional[tuple]:
        """(rate fraction, fixed seconds) of ``other_kind_bands``' band holding ``flops`` for ``kind``, or
        None where that kind has no bands."""
        bands = self.other_kind_bands.get(kind) if kind is not None else None
        if not bands:
            return None
        return next((rate, fixed) for upper, rate, fixed in bands if upper is None or flops <= upper)

    def pipeline_message_seconds(self, nbytes: float) -> float:
        """``pipeline_message_s`` (measured) at a message of ``nbytes``."""
        per_message, per_byte = self.pipeline_message_s
        return per_message + per_byte * nbytes

    def fit(self, kind: str, group_size: int) -> Optional[CollectiveFit]:
        """The measured line for ``kind`` on ``group_size`` ranks, or None if not measured."""
        return self._table.get((kind, group_size))

    # The raw table is a read-only dict (not hashable): identity of a calibration is its fits.
    def __hash__(self) -> int:
        return hash((self.ranks, self.backend, self.device_kind, self.collectives,
                     self.backward_op_overhead_s, self.comm_overlaps_compute, self.parallel_ranks,
                     self.waiting_share, tuple(sorted(self.op_fixed_s.items())), self.recompute_saved_s,
                     self.pipeline_message_s, self.split_backward_extra,
                     tuple(sorted(self.other_kind_efficiency.items())), tuple(self.attention_by_seq.items()),
                     tuple(self.other_kind_bands.items())))

    def __eq__(self, other) -> bool:
        return isinstance(other, Calibration) and self.to_json() == other.to_json()

    def __reduce__(self):
        return (Calibration, (self.ranks, self.backend, self.device_kind, self.collectives,
                              self.backward_op_overhead_s, self.comm_overlaps_compute, dict(self.raw),
                              self.parallel_ranks, self.waiting_share, dict(self.op_fixed_s),
                              self.recompute_saved_s, self.pipeline_message_s, self.split_backward_extra,
                              dict(self.other_kind_efficiency), dict(self.attention_by_seq),
                              dict(self.other_kind_bands)))

    def to_json(self) -> dict:
        return {"version": CALIBRATION_VERSION, "ranks": self.ranks, "backend": self.backend,
                "device_kind": self.device_kind, "collectives": [f.to_json() for f in self.collectives],
                "backward_op_overhead_s": self.backward_op_overhead_s,
                "comm_overlaps_compute": self.comm_overlaps_compute, "parallel_ranks": self.parallel_ranks,
                "waiting_share": self.waiting_share, "op_fixed_s": dict(self.op_fixed_s),
                "recompute_saved_s": self.recompute_saved_s,
                "pipeline_message_s": list(self.pipeline_message_s) if self.pipeline_message_s else None,
                "split_backward_extra": self.split_backward_extra,
                "other_kind_efficiency": dict(self.other_kind_efficiency),
                "attention_by_seq": {str(seq): list(line) for seq, line in self.attention_by_seq.items()},
                "other_kind_bands": {kind: [list(band) for band in bands]
                                     for kind, bands in self.other_kind_bands.items()},
                "raw": _plain(self.raw)}

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        keys = {"ranks", "backend", "device_kind", "collectives"}
        if not isinstance(data, dict) or not keys <= set(data):
            raise InvalidValue(f"bad calibration {str(data)[:200]!r}: expected an object with the keys "
                               f"{', '.join(sorted(keys))}; write one with `xirang calibrate`")
        if data.get("version", CALIBRATION_VERSION) != CALIBRATION_VERSION:
            raise InvalidValue(f"calibration version {data.get('version')!r} is not {CALIBRATION_VERSION}; "
                               f"re-run `xirang calibrate`")
        return cls(data["ranks"], data["backend"], data["device_kind"],
                   tuple(CollectiveFit.from_json(f) for f in data["collectives"]),
                   data.get("backward_op_overhead_s", 0.0), bool(data.get("comm_overlaps_compute", True)),
                   data.get("raw", {}), data.get("parallel_ranks"), data.get("waiting_share", 0.0),
                   data.get("op_fixed_s", {}), data.get("recompute_saved_s", 0.0),
                   data.get("pipeline_message_s"), data.get("split_backward_extra", 0.0),
                   data.get("other_kind_efficiency", {}),
                   data.get("attention_by_seq", {}), data.get("other_kind_bands", {}))


def _bands(kind, bands) -> tuple:
    """``Calibration.other_kind_bands[kind]`` checked: bands of increasing upper FLOPs, the last open."""
    where = f"Calibration other_kind_bands[{kind!r}]"
    if kind not in OTHER_KINDS:
        raise InvalidValue(f"{where}: the kind must be among {OTHER_KINDS}")
    if not isinstance(bands, (list, tuple)):
        raise InvalidValue(f"{where} must be a list of bands, got {bands!r}")
    checked, below = [], 0.0
    for i, band in enumerate(bands):
        if not isinstance(band, (list, tuple)) or len(band) != 3:
            raise InvalidValue(f"{where} must be a list of [up to FLOPs (None: no limit), rate fraction, fixed "
                               f"seconds], got {band!r}")
        upper, rate, fixed = band
        last = i == len(bands) - 1
        if (upper is None) != last or (upper is not None and _number(upper, where) <= below):
            raise InvalidValue(f"{where}: the bands' upper FLOPs must increase and only the last be None "
                               f"(open), got {list(bands)!r}")
        rate = _number(rate, where, positive=True)
        if rate > 1:
            raise InvalidValue(f"{where}: a rate must be a fraction in (0, 1], got {rate!r}")
        checked.append((None if upper is None else float(upper), rate, _number(fixed, where)))
        below = float(upper) if upper is not None else below
    if not checked:
        raise InvalidValue(f"{where}: give at least one band, the last open (None)")
    return tuple(checked)


def _plain(value):
    """A JSON-ready copy (read-only mappings and tuples made dicts and lists)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
