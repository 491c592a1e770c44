"""Bucketed data-parallel gradient sync: numerics, launch-before-backward-ends, bf16, accumulation.

One 2-rank gloo launch runs the distributed checks (each rank returns a dict); the single-rank
tests (group=None, no process group) check bucketing and error paths directly.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.runtime.data_parallel.grad_sync import GradientBuckets, assign_buckets
from xirang.codegen.runtime.launch.launcher import launch
from xirang.ir.errors import XirangError

WORLD = 2
WIDTHS = (8, 16, 16, 16, 16, 4)  # five Linear layers
# (8*16 + 16) + 3 * (16*16 + 16) + (16*4 + 4) = 1028 parameters, 4112 bytes in fp32
PARAM_BYTES = 1028 * 4
BUCKET_BYTES = 1100  # a 16x16 layer and a bias (1088 bytes) fit, a second weight does not


def _mlp():
    torch.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, WIDTHS[0], generator=g), torch.randn(8, WIDTHS[-1], generator=g)


def _reference_grads():
    model = _mlp()
    x, y = _data()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def _max_err(model, ref):
    return max((p.grad - r).abs().max().item() for p, r in zip(model.parameters(), ref))


def _step(rank, reduce_dtype=None, micro_batches=1):
    """One data-parallel step of the MLP on this rank's half of the batch; returns the model,
    the event log and the counter."""
    model, (x, y), log, counter = _mlp(), _data(), [], CommCounter()
    buckets = GradientBuckets(list(model.parameters()), dist.group.WORLD, bucket_bytes=BUCKET_BYTES,
                              reduce_dtype=reduce_dtype, event_log=log, counter=counter)
    xs, ys = x.chunk(WORLD)[rank].chunk(micro_batches), y.chunk(WORLD)[rank].chunk(micro_batches)
    for m, (xm, ym) in enumerate(zip(xs, ys)):
        loss = torch.nn.functional.mse_loss(model(xm), ym) / micro_batches
        if m < micro_batches - 1:
            with buckets.no_sync():
                loss.backward()
            log.append(("micro_batch_done", m, 0.0))
        else:
            loss.backward()
    buckets.wait()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    log.append(("step", None, 0.0))
    return model, buckets, log, counter


def _repeated_steps(rank, set_to_none: bool) -> tuple:
    """Three synced backwards of the same half-batch, ``zero_grad(set_to_none)`` before each (no
    optimizer step, so each must give the full-batch gradient); per step the largest error and
    whether every ``.grad`` is its slot of a bucket buffer (nothing copied back at ``wait()``)."""
    model, (x, y) = _mlp(), _data()
    buckets = GradientBuckets(list(model.parameters()), dist.group.WORLD, bucket_bytes=BUCKET_BYTES)
    ref, errors, in_buffers = _reference_grads(), [], []
    storages = lambda: {b.storage.untyped_storage().data_ptr() for b in buckets.buckets}  # noqa: E731
    for _ in range(3):
        model.zero_grad(set_to_none=set_to_none)
        torch.nn.functional.mse_loss(model(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank]).backward()
        buckets.wait()
        errors.append(_max_err(model, ref))
        in_buffers.append(all(p.grad.untyped_storage().data_ptr() in storages() for p in model.parameters()))
    return errors, in_buffers


def _rank_checks(rank, world):
    ref = _reference_grads()
    out = {}
    model, buckets, log, counter = _step(rank)
    out["fp32_err"] = _max_err(model, ref)
    out["buckets"] = [[tuple(p.shape) for p in b] for b in buckets.bucket_params]
    out["events"] = [(kind, bucket) for kind, bucket, _ in log]
    times = {(kind, bucket): t for kind, bucket, t in log}
    out["first_launch_before_backward_done"] = times[("launch", 0)] < times[("backward_done", None)]
    out["records"] = [(r.kind, r.nbytes, r.group_size, r.label) for r in counter.records]

    model, buckets, _, counter = _step(rank, reduce_dtype=torch.bfloat16)
    out["bf16_copies_let_go"] = [bucket.storage is None and not bucket.slots for bucket in buckets.buckets]
    out["bf16_rel_err"] = max(((p.grad - r).abs().max() / r.abs().max()).item()
                              for p, r in zip(model.parameters(), ref))
    out["bf16_dtypes"] = {str(p.grad.dtype) for p in model.parameters()}
    out["bf16_bytes"] = counter.total_bytes("all_reduce")

    model, _, log, counter = _step(rank, micro_batches=2)
    out["accum_err"] = _max_err(model, ref)
    out["accum_events"] = [(kind, bucket) for kind, bucket, _ in log]
    out["accum_calls"] = counter.calls()

    out["repeated_kept"] = _repeated_steps(rank, set_to_none=False)
    out["repeated_fresh"] = _repeated_steps(rank, set_to_none=True)
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(_rank_checks, WORLD, timeout_s=90)


def test_averaged_gradients_equal_full_batch_gradient(ranks):
    for rank, result in enumerate(ranks):
        assert result["fp32_err"] < 1e-6, f"rank {rank}: {result['fp32_err']}"


def test_buckets_follow_reverse_layer_order(ranks):
    # Gradient-ready order is the reverse of forward: last bias, last weight, then the previous
    # layer's bias joins (336 bytes); each 1024-byte weight then opens a bucket its preceding
    # layer's bias fills up (1088 bytes); the first weight (512 bytes) is the last bucket.
    assert ranks[0]["buckets"] == [[(4,), (4, 16), (16,)], [(16, 16), (16,)], [(16, 16), (16,)],
                                   [(16, 16), (16,)], [(16, 8)]]


def test_first_bucket_launched_before_backward_finished_and_all_waited_before_step(ranks):
    for result in ranks:
        n = len(result["buckets"])
        assert n >= 4
        launches = [("launch", i) for i in range(n)]
        waits = [("wait", i) for i in range(n)]
        # every bucket went out during the backward, in bucket order, and was waited before the step
        assert result["events"] == launches + [("backward_done", None)] + waits + [("step", None)]
        assert result["first_launch_before_backward_done"]


def test_counter_records_one_all_reduce_per_bucket(ranks):
    sizes = [(4 + 64 + 16) * 4, (256 + 16) * 4, (256 + 16) * 4, (256 + 16) * 4, 128 * 4]
    for result in ranks:
        assert result["records"] == [("all_reduce", size, 2, f"grad bucket {i}")
                                     for i, size in enumerate(sizes)]
        assert sum(sizes) == PARAM_BYTES


def test_bf16_reduction_is_close_and_casts_back(ranks):
    # bf16 keeps 8 significant bits: each rank's gradient and the sum are rounded once each
    # (relative error <= 2^-8 each), so 2^-6 of the tensor's largest entry bounds the error.
    for result in ranks:
        assert result["bf16_rel_err"] < 2 ** -6
        assert result["bf16_dtypes"] == {"torch.float32"}
        assert result["bf16_bytes"] == PARAM_BYTES // 2


def test_a_bf16_copy_of_fp32_gradients_is_let_go_after_the_step(ranks):
    """The bf16 buffer a bucket reduces in is not the gradients (they stay fp32): kept across steps it would be
    held through the next forwards, 2 B a parameter the plan does not price (a 70B rank: about 4 GiB)."""
    for rank, result in enumerate(ranks):
        assert result["bf16_copies_let_go"] and all(result["bf16_copies_let_go"]), rank


def test_no_sync_accumulation_reduces_once_on_last_micro_batch(ranks):
    for result in ranks:
        assert result["accum_err"] < 1e-6
        events = result["accum_events"]
        assert events[0] == ("micro_batch_done", 0)  # nothing launched during the first
        assert events.count(("backward_done", None)) == 1
        assert result["accum_calls"] == 5


def test_gradients_are_their_bucket_slots_every_step_whether_zeroed_or_set_to_none(ranks):
    # kept (zero_grad(set_to_none=False)): autograd accumulates into the slot, which is averaged in
    # place; fresh: autograd hands a new tensor, the hook divides it into the slot and .grad becomes it
    for result in ranks:
        for errors, in_buffers in (result["repeated_kept"], result["repeated_fresh"]):
            assert max(errors) < 1e-6, errors
            assert in_buffers == [True, True, True]


# --- one rank (group=None): the same machinery without the collective -------------------------

def test_assign_buckets_by_size_dtype_and_reverse_order():
    f32 = lambda n: torch.zeros(n)                          # noqa: E731 - 4 bytes per element
    bf16 = lambda n: torch.zeros(n, dtype=torch.bfloat16)   # noqa: E731
    params = [f32(10), bf16(10), f32(10), f32(30), bf16(10)]
    # reverse order: #4 bf16 20 B, #3 f32 120 B, #2 f32 40 B (120 + 40 > 100: new bucket), ...
    assert assign_buckets(params, bucket_bytes=100) == [[3], [4, 1], [2, 0]]
    assert assign_buckets(params, bucket_bytes=10**6) == [[4, 1], [3, 2, 0]]


def _tiny(log=None, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return model, GradientBuckets(list(model.parameters()), None, bucket_bytes=1, event_log=log,
                                  **kwargs)


def test_single_rank_keeps_gradients_and_logs_order():
    log = []
    model, buckets = _tiny(log)
    model(torch.ones(3, 4)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    buckets.wait()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    assert [e for e, _, _ in log] == ["launch"] * 4 + ["backward_done"] + ["wait"] * 4


def test_single_rank_bf16_reduction_rounds_like_bf16():
    model, buckets = _tiny(reduce_dtype=torch.bfloat16)
    model(torch.randn(3, 4)).sum().backward()
    expected = [p.grad.bfloat16().float() for p in model.parameters()]
    buckets.wait()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))


def test_second_synced_backward_before_wait_is_refused():
    model, buckets = _tiny()
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(XirangError, match="already all-reduced"):
        model(torch.ones(1, 4)).sum().backward()


def test_wait_names_parameters_without_gradient():
    model, buckets = _tiny()
    model[1].bias.grad = None
    (model[1].weight.sum() * 0 + model[0](torch.ones(1, 4)).sum()).backward()
    with pytest.raises(XirangError, match=r"#3 shape \(2,\)"):
        buckets.wait()
