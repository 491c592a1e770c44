"""Xirang: compile a single-device PyTorch model into a 3D-parallel training program.

Public API (so far): ``analyze`` (trace + analysis passes, per-block report), the cluster and
device descriptions (``World``, ``parse_world``, ``DeviceSpec``, ``device_spec``), the process-grid
``Mesh`` and a plan's placements ``PlanShard``, ``PlanReplicate``, ``PlanPartial``.

The placements are not torch.distributed.tensor's ``Shard``/``Replicate``/``Partial`` and do not take
their names: ``PlanShard`` has ``chunks`` (Megatron's fused [q | k | v] layout, a slice of each piece),
which no public DTensor placement expresses, ``PlanPartial``'s reduction is ``op`` ("sum", "avg",
"max", "min"), and they are plan data (JSON a person can edit, keys of the sharding-rule tables), never
attached to a tensor. The old names are refused naming the new ones (``__getattr__`` below).
"""
from xirang.ir.device import DEVICE_PRESETS, DeviceSpec, device_spec
from xirang.ir.mesh import Mesh
from xirang.ir.placement import PlanPartial, PlanReplicate, PlanShard
from xirang.ir.plan import Plan, PlanError
from xirang.ir.world import LinkSpec, NodeSpec, World, parse_world

from xirang.analyze import AnalysisReport, analyze
from xirang.ir.errors import PassFailure, PassOrderError, TraceError, XirangError
from xirang.options import DebugHooks, PlanChoices, RuntimeOptions
from xirang.plan_api import plan

__all__ = [
    "analyze", "AnalysisReport", "plan", "PlanChoices", "RuntimeOptions", "DebugHooks",
    "World", "NodeSpec", "LinkSpec", "parse_world", "DeviceSpec", "device_spec", "DEVICE_PRESETS",
    "Mesh", "PlanShard", "PlanReplicate", "PlanPartial", "Plan", "PlanError",
    "XirangError", "TraceError", "PassOrderError", "PassFailure",
]

from xirang.codegen.runtime.launch.launcher import launch  # noqa: E402  (local CPU ranks for xirang.compile)

from xirang.compile_api import compile  # noqa: E402,A001
from xirang.codegen.ops.random_ops import ExactReference  # noqa: E402  (the eager reference of rng="exact")

__all__ += ["compile", "launch", "ExactReference"]

from xirang.codegen.runtime.data.rank_batches import RankBatches, SyntheticTokens, TokenFile  # noqa: E402
from xirang.codegen.runtime.data_parallel.grad_norm import step_if_finite  # noqa: E402

__all__ += ["RankBatches", "TokenFile", "SyntheticTokens", "step_if_finite"]
# non-finite steps met with a policy (stop, skip, rollback), loss spikes reported (codegen/runtime/numerics/)
from xirang.codegen.runtime.numerics.loss_spikes import LossSpikes  # noqa: E402
from xirang.codegen.runtime.numerics.nonfinite import NonFiniteGuard, StepOutcome  # noqa: E402

__all__ += ["NonFiniteGuard", "StepOutcome", "LossSpikes"]
from xirang.hf_weights import empty_pretrained, load_pretrained, save_pretrained  # noqa: E402

__all__ += ["empty_pretrained", "load_pretrained", "save_pretrained"]

# distributed checkpoints: save per-rank shards, resume under any plan (codegen/runtime/checkpoint/save_load.py)
from xirang.codegen.runtime.checkpoint.save_load import PendingCheckpoint, load_checkpoint, save_checkpoint  # noqa: E402
from xirang.codegen.runtime.checkpoint.store import latest_checkpoint  # noqa: E402

__all__ += ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "PendingCheckpoint"]

# the plan re-priced from a run's measured steps (xirang_compile/reprice.py, codegen/runtime/calibration/step_costs.py)
from xirang.codegen.runtime.calibration.step_costs import MeasuredCosts  # noqa: E402
from xirang.reprice import Repricing, reprice  # noqa: E402

__all__ += ["reprice", "Repricing", "MeasuredCosts"]

# from-scratch weights, tensor by tensor on their own streams: no rank builds the whole model
from xirang.codegen.runtime.state.weight_init import init_weights, parameters_on_meta  # noqa: E402

__all__ += ["init_weights", "parameters_on_meta"]

# the full-scale check: every rank's program run on fake tensors, collectives, sends, deadlock and memory proven
from xirang.check_api import CheckReport, check  # noqa: E402

__all__ += ["check", "CheckReport"]

# the plan chosen by measurement: the planner's best few run for a few steps on the ranks (xirang_compile/tune.py)
from xirang.tune import TuneResult, tune  # noqa: E402

__all__ += ["tune", "TuneResult"]


_RENAMED = {"Shard": "PlanShard", "Replicate": "PlanReplicate", "Partial": "PlanPartial"}


def __getattr__(name: str):
    """``xirang.Shard`` and the other placements' old names: refused naming the new ones (not an
    AttributeError, whose ``from xirang import Shard`` would say only "cannot import name")."""
    if name in _RENAMED:
        raise XirangError(f"xirang.{name} was renamed xirang.{_RENAMED[name]}: Xirang's plan placements do not "
                          f"reuse torch.distributed.tensor's names (they are plan data, and PlanShard has chunks)",
                          where=f"xirang.{name}", hint=f"write xirang.{_RENAMED[name]} (from xirang import "
                                                       f"{_RENAMED[name]})")
    raise AttributeError(f"module 'xirang' has no attribute {name!r}")
