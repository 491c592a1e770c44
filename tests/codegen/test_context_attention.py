"""Context-parallel attention (ring, all-to-all and USP) against full-sequence SDPA on 2 and 4 gloo CPU ranks.

One 4-rank launch runs every case (spawning ranks costs seconds): the cp groups are the named mesh's, cp = 2
(ranks 0-1 and 2-3) and cp = 4 (all); USP runs at cp 4 as an all-to-all over 2 ranks (0-1, 2-3) x a ring over
2 (0-2, 1-3). Each rank builds the full q, k, v and a loss weight from one seed,
computes full-sequence SDPA and its gradients with the same mask, then runs the op on its shard (the
load-balanced layout) and compares its output rows and its q, k, v gradients with its rows of the
reference. The ranks' local losses add up to the reference loss, so each rank's gradient is its slice of
the reference gradient. Each case's CommCounter records are compared with the cost formulas
(passes/planning/context_parallel_cost.py), and what the ring keeps for its backward with the memory formula.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xirang.codegen.ops.collectives import group_rank
from xirang.codegen.ops.comm_counter import CommCounter
from xirang.codegen.ops.context_attention import (CAUSAL, NO_MASK, AttentionMask, kv_head_repeats, ring_attention,
                                        sequence_positions, shard_sequence, ulysses_attention, unshard_sequence)
from xirang.codegen.ops.context_attention_layout import chunk_length
from xirang.codegen.ops.context_attention_usp import usp_attention
from xirang.codegen.runtime.launch.launcher import launch
from xirang.codegen.runtime.launch.process_groups import build_context_groups, build_mesh_groups
from xirang.ir.errors import InvalidValue
from xirang.ir.mesh import Mesh
from xirang.passes.planning.context_parallel_cost import (attention_saved_bytes, ring_attention_bytes,
                                                          ring_exposed_seconds, ulysses_attention_bytes,
                                                          ulysses_kv_heads, usp_attention_bytes)

WORLD = 4
BATCH, HEAD_DIM = 2, 8
WINDOW = AttentionMask(window=5)  # cuts chunks of 2 (cp 4, S 16) and 4 (cp 2, S 16) mid-block
METHODS = {"ring": ring_attention, "ulysses": ulysses_attention, "usp": usp_attention}
USP_A2A = 2  # USP's all-to-all degree, at cp 4
TOLERANCE = 1e-5  # fp32 against fp32 SDPA

# (method, cp, mask, (query heads, kv heads), sequence, dtype): every method x cp x mask once, GQA in most
DEFAULT_CASES = [(method, cp, mask, heads, 16, torch.float32)
                 for method in METHODS for cp in (2, 4) if method != "usp" or cp == 4
                 for mask, heads in ((CAUSAL, (4, 2)), (WINDOW, (8, 2)), (NO_MASK, (4, 4)))]
# the grid: kv heads cp does not divide (repeated for all-to-all), one kv head, a window wider than a rank's
# share, a longer sequence, and bf16 (held to bf16 SDPA's own error, see test_bf16_error_as_sdpa)
MATRIX_CASES = ([(method, cp, mask, heads, 48, torch.float32)
                 for method in METHODS for cp in (2, 4) if method != "usp" or cp == 4
                 for mask in (CAUSAL, AttentionMask(window=13), NO_MASK)
                 for heads in ((8, 1), (4, 2), (8, 8))]
                + [(method, cp, mask, (4, 2), 32, torch.bfloat16)
                   for method in METHODS for cp in (2, 4) if method != "usp" or cp == 4
                   for mask in (CAUSAL, WINDOW)])


def _reference(Q, K, V, C, mask, keep=None):
    """Full-sequence SDPA (fp32) with ``mask``'s bool mask (and the key padding mask ``keep`` (B, S)), its output
    and q, k, v gradients for loss Σ out·C."""
    q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
    positions = torch.arange(Q.shape[2])
    attn_mask = None if mask == NO_MASK else mask.visible(positions, positions)
    if keep is not None:
        attn_mask = keep[:, None, None, :] & (True if attn_mask is None else attn_mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=K.shape[1] != Q.shape[1])
    (out * C).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _saved_bytes(fn):
    """Run ``fn`` recording the bytes autograd keeps for the backward (distinct storages)."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return out, sum(storages.values())


def _case(groups, case, seed):
    method, cp, mask, (hq, hkv), seq, dtype = case
    group = groups[cp]
    g = torch.Generator().manual_seed(seed)
    Q, C = (torch.randn(BATCH, hq, seq, HEAD_DIM, generator=g) for _ in range(2))
    K, V = (torch.randn(BATCH, hkv, seq, HEAD_DIM, generator=g) for _ in range(2))
    ref = _reference(Q, K, V, C, mask)
    q, k, v = (shard_sequence(t, 2, group).to(dtype).requires_grad_() for t in (Q, K, V))
    counter = CommCounter()
    where = (groups["usp"].a2a, groups["usp"].ring) if method == "usp" else (group,)
    out, saved = _saved_bytes(lambda: METHODS[method](q, k, v, *where, mask=mask, counter=counter))
    (out.float() * shard_sequence(C, 2, group)).sum().backward()
    errors = [(a.float() - shard_sequence(b, 2, group)).abs().max().item()
              for a, b in zip((out, q.grad, k.grad, v.grad), ref)]
    result = {"errors": errors, "saved": saved,
              "records": [(r.kind, r.nbytes, r.group_size, r.label) for r in counter.records]}
    if dtype != torch.float32:  # bf16 SDPA's own error against the fp32 reference, on this rank's rows
        refs = _reference(*(t.to(dtype).float() for t in (Q, K, V)), C, mask)  # inputs rounded alike
        low = [t.clone().requires_grad_() for t in (Q.to(dtype), K.to(dtype), V.to(dtype))]
        positions = torch.arange(seq)
        low_out = F.scaled_dot_product_attention(*low, attn_mask=None if mask == NO_MASK else
                                                 mask.visible(positions, positions), enable_gqa=hkv != hq)
        (low_out.float() * C).sum().backward()
        result["sdpa_errors"] = [(shard_sequence(a.float() - b, 2, group)).abs().max().item()
                                 for a, b in zip((low_out, *(t.grad for t in low)), refs)]
        result["errors"] = [(a.float() - shard_sequence(b, 2, group)).abs().max().item()
                            for a, b in zip((out, q.grad, k.grad, v.grad), refs)]
    return result


# (method, cp, mask, (query heads, kv heads)) with a key padding mask: every method and cp, causal (left
# padding: the first rows of a sample see no key at all) and a sliding window (random bits)
PADDED_CASES = [(method, cp, mask, (4, 2)) for method in METHODS for cp in (2, 4) if method != "usp" or cp == 4
                for mask in (CAUSAL, WINDOW)]


def _padded_case(groups, case, seed, seq=16):
    """A case with a key padding mask: sample 0 left-padded by 5 tokens, sample 1 by random bits (the sliding
    window case), given to the op whole (B, S) as the lowering's ``key_keep`` gives it."""
    method, cp, mask, (hq, hkv) = case
    g = torch.Generator().manual_seed(seed)
    Q, C = (torch.randn(BATCH, hq, seq, HEAD_DIM, generator=g) for _ in range(2))
    K, V = (torch.randn(BATCH, hkv, seq, HEAD_DIM, generator=g) for _ in range(2))
    keep = torch.stack([torch.arange(seq) >= 5, torch.rand(seq, generator=g) < (0.5 if mask.window else 1.1)])
    ref = _reference(Q, K, V, C, mask, keep)
    group = groups[cp]
    q, k, v = (shard_sequence(t, 2, group).requires_grad_() for t in (Q, K, V))
    where = (groups["usp"].a2a, groups["usp"].ring) if method == "usp" else (group,)
    out = METHODS[method](q, k, v, *where, mask=mask, keep=keep)
    (out * shard_sequence(C, 2, group)).sum().backward()
    return [(a - shard_sequence(b, 2, group)).abs().max().item() for a, b in zip((out, q.grad, k.grad, v.grad), ref)]


def _layout(groups, cp, seq=16):
    """shard then unshard is the identity, forward and backward; positions are the chunks'."""
    group = groups[cp]
    full = torch.randn(3, seq, 5, generator=torch.Generator().manual_seed(7))
    weight = torch.randn(3, seq, 5, generator=torch.Generator().manual_seed(8))
    local = shard_sequence(full, 1, group).clone().requires_grad_()
    counter = CommCounter()
    whole = unshard_sequence(local, 1, group, counter=counter)
    (whole * weight).sum().backward()
    return {"round_trip": (whole - full).abs().max().item(),
            "grad": (local.grad - shard_sequence(weight, 1, group)).abs().max().item(),
            "positions": sequence_positions(seq, group).tolist(),
            "positions_sharded": shard_sequence(torch.arange(seq), 0, group).tolist(),
            "rank": group_rank(group),
            "records": [(r.kind, r.nbytes, r.group_size) for r in counter.records]}


def _rank_checks(rank, world, cases):
    groups = {cp: build_mesh_groups(Mesh(dp=WORLD // cp, pp=1, tp=1, cp=cp)).group("cp") for cp in (2, 4)}
    groups["usp"] = build_context_groups(Mesh(dp=1, pp=1, tp=1, cp=WORLD), USP_A2A)
    return {"cases": [_case(groups, case, seed=100 + i) for i, case in enumerate(cases)],
            "padded": [_padded_case(groups, case, seed=200 + i) for i, case in enumerate(PADDED_CASES)],
            "layout": {cp: _layout(groups, cp) for cp in (2, 4)}}


def _name(case) -> str:
    method, cp, mask, (hq, hkv), seq, dtype = case
    masked = "none" if not mask.causal else f"window{mask.window}" if mask.window else "causal"
    return f"{method}-cp{cp}-{masked}-hq{hq}-hkv{hkv}-s{seq}-{str(dtype).removeprefix('torch.')}"


@pytest.fixture(scope="module")
def ranks():
    return launch(_rank_checks, WORLD, (DEFAULT_CASES,), timeout_s=300)


@pytest.fixture(scope="module")
def matrix_ranks():
    return launch(_rank_checks, WORLD, (MATRIX_CASES,), timeout_s=600)


def _expected_bytes(case):
    method, cp, mask, (hq, hkv), seq, dtype = case
    size = torch.finfo(dtype).bits // 8
    if method == "ring":
        return {"send": ring_attention_bytes(seq=seq, batch=BATCH, kv_heads=hkv, head_dim=HEAD_DIM, dtype_bytes=size,
                                             cp=cp)}
    if method == "usp":
        exchange, ring = usp_attention_bytes(seq=seq, batch=BATCH, q_heads=hq, kv_heads=hkv, head_dim=HEAD_DIM,
                                             dtype_bytes=size, cp=cp, a2a=USP_A2A)
        return {"all_to_all": exchange, "send": ring}
    return {"all_to_all": ulysses_attention_bytes(seq=seq, batch=BATCH, q_heads=hq, kv_heads=hkv, head_dim=HEAD_DIM,
                                   dtype_bytes=size, cp=cp)}


def _check_numerics(results, cases):
    worst = {}
    for rank, result in enumerate(results):
        for case, got in zip(cases, result["cases"]):
            if case[5] == torch.float32:
                assert max(got["errors"]) < TOLERANCE, (_name(case), rank, got["errors"])
            worst[_name(case)] = max(worst.get(_name(case), 0.0), *got["errors"])
    return worst


def _check_bytes(results, cases):
    for rank, result in enumerate(results):
        for case, got in zip(cases, result["cases"]):
            expected, cp = _expected_bytes(case), case[1]
            usp = case[0] == "usp"
            sizes = {"send": cp // USP_A2A, "all_to_all": USP_A2A} if usp else {"send": cp, "all_to_all": cp}
            assert {r[0] for r in got["records"]} == set(expected)
            assert all(r[2] == sizes[r[0]] for r in got["records"]), (_name(case), got["records"])
            for kind, traffic in expected.items():
                forward = sum(r[1] for r in got["records"] if r[0] == kind and "forward" in r[3])
                backward = sum(r[1] for r in got["records"] if r[0] == kind and "backward" in r[3])
                assert (forward, backward) == (traffic.forward, traffic.backward), (_name(case), rank, kind)


def test_matches_full_sequence_sdpa(ranks):
    """Output and q, k, v gradients within 1e-5 of full-sequence SDPA: ring and all-to-all, cp 2 and 4,
    causal, sliding window and no mask, grouped-query heads."""
    worst = _check_numerics(ranks, DEFAULT_CASES)
    print("worst |difference| per case:", worst)


def test_a_key_padding_mask_matches_sdpa_fully_masked_rows_too(ranks):
    """Ring, all-to-all and USP with a key padding mask (left padding under the causal mask: rows that see no key,
    which SDPA gives output 0 and no gradient; random bits under a window): output and q, k, v gradients within
    1e-5 of full-sequence SDPA with the same mask."""
    for rank, result in enumerate(ranks):
        for case, errors in zip(PADDED_CASES, result["padded"]):
            assert max(errors) < TOLERANCE, (case[:2], case[2], rank, errors)


def test_bytes_equal_the_cost_formulas(ranks):
    _check_bytes(ranks, DEFAULT_CASES)


def _check_saved(results, cases):
    for rank, result in enumerate(results):
        for case, got in zip(cases, result["cases"]):
            method, cp, mask, (hq, hkv), seq, dtype = case
            if dtype != torch.float32:
                continue
            heads = hkv if method == "ring" else ulysses_kv_heads(hq, hkv, USP_A2A if method == "usp" else cp)
            expected = attention_saved_bytes(seq=seq, batch=BATCH, q_heads=hq, kv_heads=heads, head_dim=HEAD_DIM,
                                             dtype_bytes=4, cp=cp, dense_mask=method == "ulysses" and bool(mask.window))
            assert got["saved"] == expected, (_name(case), rank, got["saved"], expected)


def test_saved_bytes_equal_the_memory_formula(ranks):
    """What autograd keeps of one attention (q, k, v, output, fp32 lse; all-to-all: the repeated kv heads, and
    the S x S mask SDPA is handed for a window) is the formula's bytes."""
    _check_saved(ranks, DEFAULT_CASES)


def test_layout_round_trip_and_positions(ranks):
    for result in ranks:
        for cp, got in result["layout"].items():
            assert got["round_trip"] == 0 and got["grad"] == 0
            r, c = got["rank"], 16 // (2 * cp)
            expected = list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
            assert got["positions"] == expected == got["positions_sharded"]
            assert got["records"] == [("all_gather", 3 * 16 * 5 * 4, cp)]  # the whole sequence, fp32
    # cp = 2, rank 0 holds chunks 0 and 3 of 4 (Megatron-Core's layout), rank 1 chunks 1 and 2
    assert ranks[0]["layout"][2]["positions"] == [0, 1, 2, 3, 12, 13, 14, 15]
    assert ranks[1]["layout"][2]["positions"] == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.matrix
def test_matrix_matches_sdpa_and_formulas(matrix_ranks):
    worst = _check_numerics(matrix_ranks, MATRIX_CASES)
    _check_bytes(matrix_ranks, MATRIX_CASES)
    _check_saved(matrix_ranks, MATRIX_CASES)
    print("worst |difference| per case:", worst)


@pytest.mark.matrix
def test_bf16_error_as_sdpa(matrix_ranks):
    """bf16 inputs: the split attention's error against fp32 SDPA (on the same rounded inputs) is of bf16
    SDPA's own size. Bound: 4x SDPA's worst error plus 2 bf16 ulps at 1 (2 * 2^-7): the ring adds the
    blocks' dK/dV in bf16 on each hop (TransformerEngine's choice, half the bytes of fp32), up to cp roundings."""
    for rank, result in enumerate(matrix_ranks):
        for case, got in zip(MATRIX_CASES, result["cases"]):
            if case[5] == torch.bfloat16:
                for mine, sdpa in zip(got["errors"], got["sdpa_errors"]):
                    assert mine <= 4 * sdpa + 2 ** -6, (_name(case), rank, got["errors"], got["sdpa_errors"])


# --- single-process: errors, the formulas' own checks --------------------------------------------

def test_uneven_sequence_and_heads_are_refused_naming_the_numbers():
    with pytest.raises(InvalidValue, match=r"sequence of 20 tokens cannot be cut into 2 x cp = 8"):
        chunk_length(20, 4, "test")
    with pytest.raises(InvalidValue, match=r"cp = 4 does not divide the 6 query heads"):
        kv_head_repeats(6, 3, 4)
    with pytest.raises(InvalidValue, match=r"6 query heads, 3 kv heads, cp = 4"):
        ulysses_kv_heads(6, 3, 4)


def test_kv_head_rule_is_one_rule():
    """The op's repeat and the cost model's head count are the same rule (they live apart: ops import no planner)."""
    for hq in (4, 8, 12, 16, 32):
        for hkv in (h for h in range(1, hq + 1) if hq % h == 0):
            for cp in (c for c in (2, 4, 8, 16) if hq % c == 0):
                heads = ulysses_kv_heads(hq, hkv, cp)
                assert heads == hkv * kv_head_repeats(hq, hkv, cp)
                assert heads % cp == 0 and hq % heads == 0  # splits evenly, each rank's q heads keep their kv head
    assert ulysses_kv_heads(64, 8, 16) == 16  # Llama-3-70B's 8 kv heads at cp 16


def test_ring_formulas_by_hand():
    # S 1024, B 1, Hkv 8, d 128, bf16, cp 4: a block is 8 * 256 * 128 * 2 = 524288 bytes
    traffic = ring_attention_bytes(seq=1024, batch=1, kv_heads=8, head_dim=128, dtype_bytes=2, cp=4)
    assert (traffic.forward, traffic.backward) == (6 * 524288, (6 + 8) * 524288)
    assert ring_attention_bytes(seq=7, batch=1, kv_heads=1, head_dim=1, dtype_bytes=2, cp=1).forward == 0
    # hidden when a step's attention outlasts its transfer; backward's last hop home is always exposed
    assert ring_exposed_seconds(transfer_s=1.0, attention_forward_s=2.0, attention_backward_s=4.0, cp=4) == (0.0, 1.0)
    assert ring_exposed_seconds(transfer_s=1.0, attention_forward_s=0.5, attention_backward_s=1.0, cp=4) == \
        (1.5, 0.0 + 2 * 1.0 + 0.0 + 1.0)


def test_ulysses_formulas_by_hand():
    # S 1024, B 1, Hq 32, Hkv 8, d 128, bf16, cp 4: buffers 256 * (64 + 16) * 128 * 2
    traffic = ulysses_attention_bytes(seq=1024, batch=1, q_heads=32, kv_heads=8, head_dim=128, dtype_bytes=2, cp=4)
    assert traffic.forward == traffic.backward == 256 * 80 * 128 * 2
    assert traffic.forward_sent == traffic.forward * 3 / 4
