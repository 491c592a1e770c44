"""The compiled step at world = 1 does the eager step's work and no more (issue 14: no slower than eager):
the same aten ops, one detach besides (the loss it returns, cut from the graph), and the same bits.
And the batch checks it runs cheaply (a batch laid out like the last one that passed is not checked
again) still refuse a bad batch that follows good ones."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import xirang
from examples.gpt import GPTConfig, build_gpt
from xirang.ir.errors import XirangError

CONFIG = GPTConfig(vocab_size=128, seq_len=16, hidden=32, heads=4, layers=2)
BATCH = 4


class AtenOps(TorchDispatchMode):
    """Counts every aten op run under it, forward and backward."""

    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _batch(seed: int = 0, size: int = BATCH) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, CONFIG.vocab_size, (size, CONFIG.seq_len), generator=generator),
            "labels": torch.randint(0, CONFIG.vocab_size, (size, CONFIG.seq_len), generator=generator)}


def _gpt():
    torch.manual_seed(0)
    return build_gpt(CONFIG, device="cpu")


@pytest.fixture(scope="module")
def compiled():
    """Tiny GPT at world = 1, the whole batch one micro-batch (as the planner picks for this size)."""
    return xirang.compile(_gpt(), world=1, hardware="cpu", example_kwargs=_batch(), global_batch=BATCH,
                          micro_batch=BATCH)


def test_world1_step_runs_the_eager_ops_and_gives_its_bits(compiled):
    for param in compiled.parameters():
        param.grad = None
    eager, batch = _gpt(), _batch(1)
    with AtenOps() as eager_ops:
        eager_loss = eager(**batch)
        eager_loss.backward()
    with AtenOps() as compiled_ops:
        loss = compiled.train_step(**batch)
    extra = compiled_ops.seen - eager_ops.seen
    assert extra == Counter({"aten.detach.default": 1}), f"ops the compiled step runs beyond eager: {extra}"
    assert not eager_ops.seen - compiled_ops.seen
    assert torch.equal(loss, eager_loss.detach())
    grads = compiled.full_gradients()
    for name, param in eager.named_parameters():
        assert torch.equal(grads[name], param.grad), name


def test_two_micro_batches_still_average_the_loss():
    """m > 1 keeps the 1/m scaling (skipped at m = 1 only, where it is exact): the loss is the mean."""
    model = xirang.compile(_gpt(), world=1, hardware="cpu", example_kwargs=_batch(), global_batch=BATCH,
                           micro_batch=BATCH // 2)
    batch = _batch(2)
    loss = model.train_step(**batch)
    assert torch.allclose(loss, _gpt()(**batch), rtol=1e-6, atol=0)


def test_a_bad_batch_after_good_ones_is_still_refused(compiled):
    good = _batch(3)
    compiled.train_step(**good)
    compiled.train_step(**good)  # laid out as the last one: passes without the checks
    bad = [({**good, "input_ids": good["input_ids"].int()}, "dtype int32"),
           ({**good, "labels": good["labels"][:, :8]}, "labels.* 8 on dim 1"),
           ({**good, "input_ids": good["input_ids"][:2], "labels": good["labels"][:2]}, "global batch of 2"),
           ({"input_ids": good["input_ids"]}, "missing"),
           ({**good, "extra": good["labels"]}, "does not read")]
    for batch, words in bad:
        with pytest.raises(XirangError, match=words):
            compiled.train_step(**batch)
        compiled.train_step(**good)  # a good batch between: the next bad one meets a fresh cache
    with pytest.raises(XirangError, match="must be True or False"):
        compiled.train_step(**good, pre_sharded=1)  # equal to True, but not a bool
