"""codegen/check/meta_cache.py: a remembered meta answer is the kernel's (metadata, fresh storages), and what
the formulation excludes (aliases, random draws, mutations) always runs its kernel."""
from __future__ import annotations

import torch

from xirang.codegen.check.meta_cache import MetaCache, cacheable

aten = torch.ops.aten


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _same_metadata(a, b):
    return (a.dtype, a.shape, a.stride(), a.storage_offset(), a.untyped_storage().nbytes()) == \
        (b.dtype, b.shape, b.stride(), b.storage_offset(), b.untyped_storage().nbytes())


def test_a_repeated_op_is_answered_with_the_kernels_metadata_on_a_fresh_storage():
    cache = MetaCache()
    x = _meta(8, 16).t()  # a transposed input: the output keeps its layout, which the answer must too
    y = _meta(16, 8, dtype=torch.bfloat16)
    first = cache.run(aten.add.Tensor, (x, y), {})
    second = cache.run(aten.add.Tensor, (x, y), {})
    assert (cache.misses, cache.hits) == (1, 1)
    kernel = aten.add.Tensor(x, y)
    assert _same_metadata(second, kernel) and _same_metadata(first, kernel)
    assert second.stride() == (1, 16) and second.dtype == torch.float32  # promoted, transposed like x
    assert second.untyped_storage()._cdata not in {t.untyped_storage()._cdata for t in (first, x, y)}


def test_outputs_sharing_a_storage_and_other_arguments_change_the_key():
    cache = MetaCache()
    x = _meta(4, 6)
    out, mean, rstd = cache.run(aten.native_layer_norm.default, (x, [6], None, None, 1e-5), {})
    again = cache.run(aten.native_layer_norm.default, (x, [6], None, None, 1e-5), {})
    assert cache.hits == 1 and all(_same_metadata(a, b) for a, b in zip((out, mean, rstd), again))
    cache.run(aten.sum.dim_IntList, (x, [0]), {})
    other = cache.run(aten.sum.dim_IntList, (x, [1]), {})  # another dim: another key, not the first answer
    assert other.shape == (4,) and cache.hits == 1


def test_aliases_random_draws_and_mutations_always_run_their_kernel():
    cache = MetaCache()
    x = _meta(4, 6)
    for _ in range(2):  # _unsafe_view's schema declares no alias, yet it returns a view of its input
        view = cache.run(aten._unsafe_view.default, (x, [24]), {})
        assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert cache.hits == 0
    assert not cacheable(aten.bernoulli.p) and not cacheable(aten.native_dropout.default)
    assert not cacheable(aten.add_.Tensor) and not cacheable(aten.view.default)
    assert cacheable(aten.mm.default) and cacheable(aten._to_copy.default)


def test_outputs_an_output_mask_leaves_out_are_remembered_as_none():
    """A split backward asks native_layer_norm_backward for the input's gradient only (B) or the weight's only
    (W): its kernel returns None for the rest, and the remembered answer does too."""
    cache = MetaCache()
    x, grad, weight = _meta(4, 6), _meta(4, 6), _meta(6)
    mean, rstd = _meta(4, 1), _meta(4, 1)
    for mask in ([True, False, False], [False, True, True]):
        args = (grad, x, [6], mean, rstd, weight, weight, mask)
        first, second = (cache.run(aten.native_layer_norm_backward.default, args, {}) for _ in range(2))
        kernel = aten.native_layer_norm_backward.default(*args)
        for a, b, c in zip(first, second, kernel):
            assert (a is None) == (b is None) == (c is None)
            assert c is None or _same_metadata(b, c) and _same_metadata(a, c)
    assert (cache.misses, cache.hits) == (2, 2)
