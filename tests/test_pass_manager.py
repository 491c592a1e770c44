"""The pass manager: order checked before running, provides checked, graph linted, passes timed,
failures name the passes already run, and the dump instrument writes one file per pass."""
from __future__ import annotations

import pytest
import torch

from xirang.ir.errors import PassFailure, PassOrderError
from xirang.ir.meta_keys import FLOPS, ROLE, TENSOR
from xirang.ir.pass_spec import CompileContext, compiler_pass
from xirang.pass_manager import PassManager
from xirang.passes.analysis.parameters import count_parameters
from xirang.passes.analysis.tensors import annotate_tensors
from xirang.passes.analysis.trace import trace_model


class TwoLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.b(self.a(x)).sum()


def context():
    return CompileContext(model=TwoLinear(), example_args=(torch.zeros(3, 4),))


def test_pass_before_its_requirement_fails_at_construction_naming_both():
    with pytest.raises(PassOrderError) as caught:
        PassManager([trace_model, count_parameters, annotate_tensors])
    message = str(caught.value)
    assert "'count_parameters' requires meta key 'xr_tensor'" in message
    assert "pass 'annotate_tensors' provides" in message and "move 'annotate_tensors' before" in message


def test_requirement_no_pass_provides_is_reported():
    with pytest.raises(PassOrderError, match="requires meta key 'xr_flops', which no pass in the list provides"):
        PassManager([trace_model, compiler_pass(requires=(FLOPS,))(lambda gm, ctx: gm)])


def test_a_pass_that_does_not_provide_what_it_declares_fails_naming_passes_run():
    @compiler_pass(requires=(TENSOR,), provides=(FLOPS,))
    def forgetful(gm, ctx):
        """Declares FLOPS but never sets it."""
        return gm

    with pytest.raises(PassFailure) as caught:
        PassManager([trace_model, annotate_tensors, forgetful]).run(None, context())
    assert "'forgetful' declares it provides 'xr_flops'" in str(caught.value)
    assert "passes already run: trace_model, annotate_tensors, forgetful" in str(caught.value)


def test_an_exception_in_a_pass_names_the_passes_already_run():
    @compiler_pass(requires=(ROLE,))
    def broken(gm, ctx):
        raise ValueError("boom")

    with pytest.raises(PassFailure) as caught:
        PassManager([trace_model, annotate_tensors, broken]).run(None, context())
    assert "pass 'broken' failed: ValueError: boom" in str(caught.value)
    assert "passes already run: trace_model, annotate_tensors" in str(caught.value)


def test_lint_rejects_undeclared_keys_and_wrong_types():
    @compiler_pass(requires=(ROLE,))
    def scribble(gm, ctx):
        next(iter(gm.graph.nodes)).meta["xr_made_up"] = 1
        return gm

    @compiler_pass(requires=(ROLE,))
    def mistype(gm, ctx):
        ROLE.set(next(iter(gm.graph.nodes)), 42)
        return gm

    with pytest.raises(PassFailure, match="undeclared meta key 'xr_made_up'"):
        PassManager([trace_model, scribble]).run(None, context())
    with pytest.raises(PassFailure, match="meta key 'xr_role' holds int"):
        PassManager([trace_model, mistype]).run(None, context())


def test_timings_and_dump(tmp_path):
    run = PassManager([trace_model, annotate_tensors, count_parameters], dump_dir=tmp_path).run(None, context())
    assert [t.name for t in run.timings] == ["trace_model", "annotate_tensors", "count_parameters"]
    assert all(t.seconds >= 0 for t in run.timings) and "total" in run.timing_table()
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert dumps == ["00_trace_model.txt", "01_annotate_tensors.txt", "02_count_parameters.txt"]
    assert "xr_param_count" in (tmp_path / "02_count_parameters.txt").read_text()
    assert "xr_param_count" not in (tmp_path / "01_annotate_tensors.txt").read_text()
