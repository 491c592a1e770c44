"""Attention of a block of queries against a block of keys, with its log-sum-exp, and the merge of blocks.

The ring (``context_attention_ring.py``) attends its queries to one key/value block at a time and combines the partial
results exactly, by the online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022): a
block's output o_b = softmax(s_b) v_b with lse_b = log Σ exp(s_b) per query row, and two blocks merge as

    lse = log(exp(lse_1) + exp(lse_2)),   o = exp(lse_1 − lse) o_1 + exp(lse_2 − lse) o_2.

Everything here computes in fp32 whatever the inputs' dtype (the merge's exponentials lose everything in
bf16). The backward of one block needs only the final lse and Δ = rowsum(dO ∘ O) (FlashAttention-2's
backward): P = exp(S − lse), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − Δ), dQ = dS K · scale, dK = dSᵀ Q · scale.

Grouped-query attention (fewer key/value heads than query heads) is computed by viewing the query heads
as (kv heads, group) and broadcasting each key/value head over its group, so k and v are never repeated
(and the ring passes only the kv heads); query head h reads kv head h // group, as SDPA's ``enable_gqa``.

These are matmul-and-softmax kernels written out (the block's scores are materialised): exact, any device,
and fake/meta tensors run them. On a GPU a fused kernel that returns the lse would replace them.

Masks are given by ``AttentionMask`` on global positions: key j is visible to query i when

    (not causal or j <= i)  and  (window is None or i − j < window)

(a sliding ``window`` as Mistral's: each token sees itself and the window − 1 tokens before it), and
where a key padding mask ``keep`` (B, S) is given, also ``keep[b, j]`` (Hugging Face's ``attention_mask``:
a padded key is seen by no query). A query row that sees no key at all (a left-padded sequence's pads under
a causal mask) gets output 0, log-sum-exp −inf and no gradient, which is what torch's SDPA gives such a
row (and Hugging Face, which adds no fix of its own on torch >= 2.5).
``visibility`` classifies a pair of position ranges so the ring skips blocks nothing in reaches and
builds a mask only where a block is cut.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from xirang.ir.errors import InvalidValue

NEG_INF = float("-inf")


@dataclass(frozen=True)
class AttentionMask:
    """Which keys a query sees, by global positions (module docstring): causal, optionally a sliding
    window (causal only); ``AttentionMask(causal=False)`` is no mask (bidirectional)."""

    causal: bool = True
    window: Optional[int] = None

    def __post_init__(self):
        if self.window is not None:
            if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
                raise InvalidValue(f"AttentionMask window must be a positive int, got {self.window!r}",
                                   where="AttentionMask(window=...)", hint="pass the sliding window in tokens, or None")
            if not self.causal:
                raise InvalidValue("a sliding window is supported on causal attention only (Mistral's)",
                                   where="AttentionMask(causal=False, window=...)",
                                   hint="pass causal=True with the window, or no window")

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool (len(q_pos), len(k_pos)): True where the key is visible to the query."""
        diff = q_pos[:, None] - k_pos[None, :]  # i - j
        seen = diff >= 0 if self.causal else torch.ones_like(diff, dtype=torch.bool)
        return seen & (diff < self.window) if self.window is not None else seen


CAUSAL = AttentionMask()
NO_MASK = AttentionMask(causal=False)


class Seen(enum.Enum):
    """How much of a (query range, key range) block a mask lets through."""

    NONE = 0
    ALL = 1
    PART = 2


def visibility(mask: AttentionMask, q_start: int, k_start: int, q_len: int, k_len: int) -> Seen:
    """Whether queries at positions [q_start, q_start + q_len) see none, all or part of the keys at
    [k_start, k_start + k_len): by the extremes of i − j over the block."""
    low, high = q_start - (k_start + k_len - 1), (q_start + q_len - 1) - k_start  # min and max of i - j
    if not mask.causal:
        return Seen.ALL
    if high < 0 or (mask.window is not None and low >= mask.window):
        return Seen.NONE
    if low >= 0 and (mask.window is None or high < mask.window):
        return Seen.ALL
    return Seen.PART


def with_key_keep(visible: Optional[torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
    """``visible`` (Sq, Sk) or None (all seen) and the keys' padding bits ``keep`` (B, Sk) as one bool mask
    (B, 1, 1, Sq, Sk), the shape ``_scores`` broadcasts over kv heads and their query groups."""
    keys = keep[:, None, None, None, :]
    return keys if visible is None else keys & visible


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, S, d) -> (B, Hkv, group, S, d) in fp32: query head h in kv head h // group."""
    b, hq, s, d = q.shape
    return q.float().reshape(b, kv_heads, hq // kv_heads, s, d)


def _scores(q, k, scale, visible):
    """fp32 scores (B, Hkv, group, Sq, Sk), hidden keys at −inf."""
    s = (_grouped(q, k.shape[1]) @ k.float().unsqueeze(2).transpose(-1, -2)) * scale
    return s if visible is None else s.masked_fill(~visible, NEG_INF)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with −inf (a row that sees no key here) as 0, so exp(s − lse) is 0 there instead of nan."""
    return lse.masked_fill(lse == NEG_INF, 0.0)


def block_forward(q, k, v, scale: float, visible: Optional[torch.Tensor]):
    """(output fp32 (B, Hq, Sq, d), lse fp32 (B, Hq, Sq)) of q against one key/value block; a row that
    sees no key gets output 0 and lse −inf."""
    b, hq, sq, d = q.shape
    s = _scores(q, k, scale, visible)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - _finite(lse).unsqueeze(-1)) @ v.float().unsqueeze(2)
    return out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq)


def block_backward(q, k, v, dout, lse, delta, scale: float, visible: Optional[torch.Tensor]):
    """(dq, dk, dv), fp32, of one block given the merged ``lse`` and ``delta`` = rowsum(dO ∘ O), both
    fp32 (B, Hq, Sq) (module docstring); dk and dv are summed over each kv head's query group."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    shape = (b, hkv, hq // hkv, sq)
    p = torch.exp(_scores(q, k, scale, visible) - _finite(lse).reshape(shape).unsqueeze(-1))
    do = _grouped(dout, hkv)
    dv = (p.transpose(-1, -2) @ do).sum(dim=2)
    ds = p * (do @ v.float().unsqueeze(2).transpose(-1, -2) - delta.reshape(shape).unsqueeze(-1))
    dq = (ds @ k.float().unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ _grouped(q, hkv)).sum(dim=2) * scale
    return dq.reshape(b, hq, sq, d), dk, dv


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one block's (output, lse) into the running fp32 ``out`` and ``lse``, in place (module docstring)."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)  # both −inf: the row has seen nothing yet, keep 0
    out.copy_(out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new)


def default_scale(head_dim: int, scale: Optional[float]) -> float:
    return head_dim ** -0.5 if scale is None else float(scale)


def full_attention(q, k, v, mask: AttentionMask, scale: Optional[float], keep: Optional[torch.Tensor] = None):
    """SDPA over whole sequences in order (one rank, or all-to-all's heads): the mask as a causal flag, or
    as a bool (S, S) mask where a window cuts it, (B, 1, S, S) with a key padding mask ``keep`` (B, S);
    grouped-query heads by ``enable_gqa``."""
    gqa = k.shape[1] != q.shape[1]
    if mask.window is None and keep is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, scale=scale,
                                                                enable_gqa=gqa)
    positions = torch.arange(q.shape[2], device=q.device)
    visible = mask.visible(positions, positions)
    if keep is not None:
        visible = visible & keep[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
