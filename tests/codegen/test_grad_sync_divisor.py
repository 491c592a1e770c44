"""The gradient hook's per-call work: the group-size divisor (bitwise the int's division, no cast per call)
and the slot views (made once per bucket storage, re-made only with it).

Single process, no process group: the divisor is checked against ``torch.div(x, world)`` directly for
group sizes no test launch could reach; the multi-rank behaviour is tests/codegen/test_grad_sync*.py's.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from xirang.codegen.runtime.data_parallel.grad_sync import GradientBuckets, group_divisor
from xirang.codegen.runtime.launch.launcher import launch

WORLDS = (1, 2, 3, 6, 7, 8, 12, 24, 257, 1000, 4099)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _spread(dtype: torch.dtype) -> torch.Tensor:
    """Values over many binades (gradients span several), rounded to ``dtype``."""
    g = torch.Generator().manual_seed(0)
    scale = 10.0 ** torch.randint(-6, 4, (20000,), generator=g).double()
    return (torch.randn(20000, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_divisor_divides_bitwise_as_the_int(dtype):
    x = _spread(dtype)
    for world in WORLDS:
        divisor = group_divisor(world, dtype)
        out = torch.empty_like(x)
        torch.div(x, divisor, out=out)
        in_place = x.clone().div_(divisor)
        expected = torch.div(x, world)
        assert out.dtype == dtype and torch.equal(out, expected), (dtype, world)
        assert torch.equal(in_place, expected), (dtype, world)


def test_the_samples_tell_other_divisors_apart():
    # the check above could not pass with a reciprocal multiply, nor with the divisor kept in a half
    # type that cannot hold the group size (why group_divisor falls back to float32 there)
    x32, bf16 = _spread(torch.float32), _spread(torch.bfloat16)
    assert not torch.equal(x32 * (1 / 3), torch.div(x32, 3))
    assert not torch.equal(torch.div(bf16, torch.tensor(257, dtype=torch.bfloat16)), torch.div(bf16, 257))
    assert group_divisor(257, torch.bfloat16).dtype == torch.float32
    assert group_divisor(8, torch.bfloat16).dtype == torch.bfloat16


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _tiny():
    model = _tiny_model()
    return model, GradientBuckets(list(model.parameters()), None, bucket_bytes=1)


def _step(model, buckets):
    model.zero_grad(set_to_none=True)
    model(torch.ones(3, 4, dtype=next(model.parameters()).dtype)).sum().backward()
    buckets.wait()


def test_staging_casts_nothing_per_gradient():
    # an int divisor is wrapped and cast (aten::_to_copy) once per gradient; the forward and backward of
    # two Linear layers in fp32 cast nothing themselves
    model, buckets = _tiny()
    _step(model, buckets)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, buckets)
    names = [event.key for event in prof.key_averages()]
    assert "aten::div" in names and "aten::_to_copy" not in names, names


def test_slots_are_kept_across_steps_and_remade_with_the_storage():
    model, buckets = _tiny()
    _step(model, buckets)
    slots = [dict(bucket.slots) for bucket in buckets.buckets]
    _step(model, buckets)
    for bucket, before in zip(buckets.buckets, slots):
        for param in bucket.params:
            assert bucket.slots[id(param)][0] is before[id(param)][0]  # the same view object, not re-sliced
            assert param.grad is bucket.slots[id(param)][0]
    # the parameters change dtype in place (same objects): the storage, slots and divisor follow
    model.double()
    _step(model, buckets)
    for bucket in buckets.buckets:
        assert bucket.storage.dtype == torch.float64 and bucket.divisor.dtype == torch.float64
        for param in bucket.params:
            assert param.grad.dtype == torch.float64 and param.grad is bucket.slots[id(param)][0]
            assert param.grad.data_ptr() == bucket.storage.data_ptr()  # one parameter per bucket here


def _two_rank_checks(rank, world):
    """Per rank: whether the averaged gradients are bitwise (g0 / 2) + (g1 / 2) (a sum of two is the same
    in either order), and, under ZeRO-1 over two steps, whether each shard is bitwise that average's
    slice and no bucket keeps its storage or its slots."""
    def grads_of(half):
        model = _tiny_model()
        model(torch.randn(4, 4, generator=torch.Generator().manual_seed(half))).sum().backward()
        return {name: p.grad for name, p in model.named_parameters()}
    halves = [grads_of(half) for half in range(world)]
    expected = {name: torch.div(halves[0][name], 2) + torch.div(halves[1][name], 2) for name in halves[0]}
    data = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))

    model = _tiny_model()
    buckets = GradientBuckets(list(model.parameters()), dist.group.WORLD, bucket_bytes=1)
    model(data).sum().backward()
    buckets.wait()
    out = {"bitwise": all(torch.equal(p.grad, expected[name]) for name, p in model.named_parameters())}

    model = _tiny_model()
    name_of = {id(p): name for name, p in model.named_parameters()}
    buckets = GradientBuckets(list(model.parameters()), dist.group.WORLD, bucket_bytes=1)
    shards = {}
    buckets.shard_gradients(range(len(buckets.buckets)), lambda index, shard: shards.__setitem__(index, shard))
    out["zero"] = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(data).sum().backward()
        buckets.wait()
        for bucket in buckets.buckets:
            flat = torch.cat([expected[name_of[id(p)]].flatten() for p in bucket.params])
            flat = torch.cat([flat, flat.new_zeros(-flat.numel() % world)])
            out["zero"].append((torch.equal(shards[bucket.index], flat.chunk(world)[rank]),
                                bucket.storage is None and not bucket.slots))
    return out


def test_two_ranks_average_bitwise_and_zero_drops_slots_with_the_storage():
    for rank, result in enumerate(launch(_two_rank_checks, 2, timeout_s=90)):
        assert result["bitwise"], rank
        assert result["zero"] and all(shard_ok and dropped for shard_ok, dropped in result["zero"]), result["zero"]
