"""Context-parallel attention under the dry run's conditions: fake tensors (or plain meta tensors, a GPU
program's) and torch's fake process group, as ``xirang.check`` runs a step (codegen/check/rank_step.py).

Each of the 4 ranks of a cp = 4 mesh runs ring and all-to-all attention forward and backward in this
process, one after another, under the dry run's ``Recorder``. The ops must run without a real peer (the fake
group delivers nothing, so the values are meaningless, but shapes, dtypes and the calls are the real ones),
count the formulas' bytes, and the recorded sends must meet their receives (the dry run's proof (b)).
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from xirang.codegen.check.proofs import ClassLog, prove_no_deadlock, prove_sends
from xirang.codegen.check.rank_step import join_fake_world, leave_fake_world
from xirang.codegen.check.recorder import Recorder
from xirang.codegen.check.records import RankLog
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.ops.context_attention import CAUSAL, AttentionMask, ring_attention, ulysses_attention
from xirang.codegen.runtime.launch.process_groups import build_mesh_groups
from xirang.ir.mesh import Mesh
from xirang.passes.planning.context_parallel_cost import ring_attention_bytes, ulysses_attention_bytes

MESH = Mesh(dp=1, pp=1, tp=1, cp=4)
B, HQ, HKV, SEQ, D = 2, 8, 2, 64, 16  # full sequence 64: 16 local rows per rank


def _step(rank: int, device: str, method, mask) -> tuple:
    """One rank's attention forward and backward on tensors without values; (log, counter, output, grads)."""
    join_fake_world(rank, MESH.size)
    try:
        recorder = Recorder(torch.device(device))
        fakes = FakeTensorMode(allow_non_fake_inputs=True) if device == "cpu" else torch.device("meta")
        with fakes, recorder:
            group = build_mesh_groups(MESH).group("cp")
            q = torch.randn(B, HQ, SEQ // 4, D, dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(B, HKV, SEQ // 4, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            counter = CommCounter()
            recorder.calls.clear()
            out = method(q, k, v, group, mask=mask, counter=counter)
            out.sum().backward()
        return RankLog(rank=rank, coords=MESH.coords(rank), calls=recorder.calls), counter, out, (q, k, v)
    finally:
        leave_fake_world()


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("method, mask", [(ring_attention, CAUSAL), (ring_attention, AttentionMask(window=20)),
                                          (ulysses_attention, CAUSAL)])
def test_runs_on_fakes_counts_the_formulas_and_sends_meet(device, method, mask):
    logs = []
    for rank in range(MESH.size):
        log, counter, out, inputs = _step(rank, device, method, mask)
        logs.append(log)
        assert out.shape == (B, HQ, SEQ // 4, D) and out.dtype == torch.bfloat16
        assert all(t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype for t in inputs)
        if device == "cpu":
            assert isinstance(out, FakeTensor)
        else:
            assert out.is_meta
        if method is ring_attention:
            expected = ring_attention_bytes(seq=SEQ, batch=B, kv_heads=HKV, head_dim=D, dtype_bytes=2, cp=4)
            sends = [c for c in log.calls if c.kind == "send"]
            assert {c.peer for c in sends} == {MESH.group("cp", rank)[(rank + 1) % 4]}  # the next rank only
            assert sum(c.count * 2 for c in sends) == expected.forward + expected.backward  # what went out, bf16
        else:
            expected = ulysses_attention_bytes(seq=SEQ, batch=B, q_heads=HQ, kv_heads=HKV, head_dim=D, dtype_bytes=2,
                                               cp=4)
        assert counter.total_bytes() == expected.forward + expected.backward
    classes = [ClassLog(log, (log.rank,)) for log in logs]
    assert prove_sends(MESH, classes) == []
    for ordered_pairs in (False, True):  # gloo (messages matched by tag), NCCL (each pair's messages in order)
        assert prove_no_deadlock(MESH, classes, ordered_pairs=ordered_pairs) == []
