"""A tuned plan's trial table (``xirang tune``, xirang_compile/tune.py): one row per configuration that was
compiled and run for a few steps on the real ranks, with what the cost model predicted for it before and
after its re-fit, and what was measured. Plain data in the plan JSON (``Plan.trials``), so ``xirang
explain`` shows it from a saved file and plans without it load as before."""
from __future__ import annotations

from dataclasses import dataclass, fields

from xirang.ir.mesh import Mesh
from xirang.ir.plan_checks import check_float, check_int, check_keys, check_seq, check_str, check_type


@dataclass(frozen=True)
class Trial:
    """One configuration run on the ranks. Seconds per optimizer step (``train_step``, no optimizer update);
    ``measured_step_seconds`` is the median over ``steps`` measured steps (the trial's warm-up left out) and
    ``spread`` the fraction (slowest - fastest) / median of those steps. ``bubble_ratio``: the pipeline's
    idle fraction, 1 - (mean rank's compute seconds) / (the last compute's end), median over the steps.
    ``peak_memory_bytes``: per rank, what the step held at its peak (the device allocator's peak, or on the
    CPU the saved activations' peak plus parameters and gradients). ``refit_step_seconds``: the re-fitted
    cost model's price (0.0 when it could not be re-priced). ``planner_choice``: the configuration the
    cost model alone chose; ``chosen``: the one chosen by measurement."""

    label: str  # the configuration in words (Candidate.label)
    mesh: Mesh
    micro_batch: int
    num_micro_batches: int
    schedule: str
    virtual_stages: int
    recompute: str
    predicted_step_seconds: float
    measured_step_seconds: float
    steps: int
    spread: float = 0.0
    bubble_ratio: float = 0.0
    peak_memory_bytes: tuple[int, ...] = ()
    refit_step_seconds: float = 0.0
    planner_choice: bool = False
    chosen: bool = False

    def __post_init__(self):
        check_str(self.label, "label")
        check_type(self.mesh, Mesh, "mesh")
        for name in ("micro_batch", "num_micro_batches", "virtual_stages", "steps"):
            check_int(getattr(self, name), name)
        check_str(self.schedule, "schedule")
        check_str(self.recompute, "recompute")
        for name in ("predicted_step_seconds", "measured_step_seconds", "spread", "bubble_ratio",
                     "refit_step_seconds"):
            object.__setattr__(self, name, check_float(getattr(self, name), name))
        object.__setattr__(self, "peak_memory_bytes", check_seq(
            self.peak_memory_bytes, "peak_memory_bytes", lambda v, w: check_int(v, w, minimum=0)))
        check_type(self.planner_choice, bool, "planner_choice")
        check_type(self.chosen, bool, "chosen")

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**data, "mesh": self.mesh.to_json(), "peak_memory_bytes": list(self.peak_memory_bytes)}

    @classmethod
    def from_json(cls, data) -> "Trial":
        names = tuple(f.name for f in fields(cls))
        check_keys(data, names, "trial", required=names[:10])
        return cls(**{**data, "mesh": Mesh.from_json(data["mesh"]),
                      "peak_memory_bytes": tuple(data.get("peak_memory_bytes", ()))})


def ranks_by(values) -> list[int]:
    """1-based rank of each value, smallest first (ties keep their order)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for position, index in enumerate(order):
        ranks[index] = position + 1
    return ranks


def planner_gap(trials) -> float:
    """How much slower the cost model's own choice measured than the measured-fastest trial (0.0: it was the
    fastest; a fraction otherwise), or 0.0 without a planner's choice in the table."""
    own = [t for t in trials if t.planner_choice]
    if not own or not trials:
        return 0.0
    best = min(t.measured_step_seconds for t in trials)
    return own[0].measured_step_seconds / best - 1.0


def trial_lines(trials) -> list[str]:
    """The trial table ``xirang explain`` prints for a tuned plan ([] for an untuned one)."""
    if not trials:
        return []
    predicted_rank = ranks_by([t.predicted_step_seconds for t in trials])
    measured_rank = ranks_by([t.measured_step_seconds for t in trials])
    header = (f"{'':3}{'configuration':<52} {'predicted':>9} {'re-fit':>8} {'measured':>9} {'spread':>6} "
              f"{'bubble':>6} {'peak MiB':>9} {'rank p/m':>8}")
    lines = ["", f"Tuned by trial runs ({trials[0].steps} measured steps each after a warm-up, no optimizer update; "
                 f"ms per step, median):", header, "-" * len(header)]
    for trial, p, m in zip(trials, predicted_rank, measured_rank):
        mark = ("*" if trial.chosen else " ") + ("P" if trial.planner_choice else " ") + " "
        refit = f"{trial.refit_step_seconds * 1e3:8.4g}" if trial.refit_step_seconds else f"{'-':>8}"
        peak = max(trial.peak_memory_bytes, default=0) / 2**20
        lines.append(f"{mark}{trial.label:<52} {trial.predicted_step_seconds * 1e3:9.4g} {refit} "
                     f"{trial.measured_step_seconds * 1e3:9.4g} {trial.spread:6.0%} {trial.bubble_ratio:6.0%} "
                     f"{peak:9.1f} {f'{p}/{m}':>8}")
    lines.append("-" * len(header))
    gap = planner_gap(trials)
    own = "the cost model's own choice (P) was the measured fastest" if gap <= 0 else \
        f"the cost model's own choice (P) measured {gap:.1%} slower than the fastest"
    lines.append(f"* chosen by measurement; {own}. spread: (slowest - fastest) / median of the measured steps; "
                 f"bubble: the pipeline's idle fraction; peak: the busiest rank; rank p/m: by predicted / measured "
                 f"step.")
    return lines
