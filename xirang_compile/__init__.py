"""Xirang: compile a single-device PyTorch model into a 3D-parallel training program.

Public API (so far): ``analyze`` (trace + analysis passes, per-block report), the cluster and
device descriptions (``World``, ``parse_world``, ``DeviceSpec``, ``device_spec``), the process-grid
``Mesh`` and the placements ``Shard``, ``Replicate``, ``Partial``.
"""
from xirang.ir.device import DEVICE_PRESETS, DeviceSpec, device_spec
from xirang.ir.mesh import Mesh
from xirang.ir.placement import Partial, Replicate, Shard
from xirang.ir.plan import Plan, PlanError
from xirang.ir.world import LinkSpec, NodeSpec, World, parse_world

from xirang.analyze import AnalysisReport, analyze
from xirang.ir.errors import PassFailure, PassOrderError, TraceError, XirangError
from xirang.plan_api import plan

__all__ = [
    "analyze", "AnalysisReport", "plan",
    "World", "NodeSpec", "LinkSpec", "parse_world", "DeviceSpec", "device_spec", "DEVICE_PRESETS",
    "Mesh", "Shard", "Replicate", "Partial", "Plan", "PlanError",
    "XirangError", "TraceError", "PassOrderError", "PassFailure",
]

from xirang.codegen.runtime.launch.launcher import launch  # noqa: E402  (local CPU ranks for xirang.compile)

from xirang.compile_api import compile  # noqa: E402,A001
from xirang.codegen.ops.random_ops import ExactReference  # noqa: E402  (the eager reference of rng="exact")

__all__ += ["compile", "launch", "ExactReference"]

from xirang.codegen.runtime.data.rank_batches import RankBatches, SyntheticTokens, TokenFile  # noqa: E402
from xirang.codegen.runtime.data_parallel.grad_norm import step_if_finite  # noqa: E402

__all__ += ["RankBatches", "TokenFile", "SyntheticTokens", "step_if_finite"]
from xirang.hf_weights import empty_pretrained, load_pretrained, save_pretrained  # noqa: E402
# non-finite steps met with a policy (stop, skip, rollback), loss spikes reported (codegen/runtime/numerics/)
from xirang.codegen.runtime.numerics.loss_spikes import LossSpikes  # noqa: E402
from xirang.codegen.runtime.numerics.nonfinite import NonFiniteGuard, StepOutcome  # noqa: E402

__all__ += ["NonFiniteGuard", "StepOutcome", "LossSpikes"]

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
