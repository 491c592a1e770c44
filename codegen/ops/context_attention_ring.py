"""Ring attention: key/value blocks passed around the cp group, each attended while the next one travels.

Forward (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Megatron-Core/TransformerEngine's
``AttnFuncWithCPAndKVP2P``). Rank r holds the queries, keys and values of its two chunks
(``context_attention_layout.py``). In cp steps it attends its queries to every rank's key/value block:
at step i it holds the block of rank (r − i) mod cp, and before attending it posts the send of that block
to rank r + 1 and the receive of the next one from rank r − 1, so the transfer runs while the block is
attended. The blocks' outputs are merged by their log-sum-exp in fp32 (``context_attention_blocks.py``).
Per (query chunk, key chunk) pair the mask is looked at by global positions: a pair nothing reaches is
skipped, a pair seen whole needs no mask. With the causal layout each step attends the same amount (half
of the two chunks' pairs), which is the load balance.

Backward (the standard ring backward): the key/value blocks travel the ring again in the same order, and
beside each one a buffer of its gradient dK, dV: at step i rank r adds its queries' contribution to the
gradient of the block it holds (received from r − 1, which added its own) and sends it on to r + 1; after
the last step each block's gradient has visited every rank and is sent home, one hop further. So the
forward sends cp − 1 key/value blocks per rank, the backward cp − 1 key/value blocks and cp gradient
blocks (in the inputs' dtype, as TransformerEngine's). dQ stays local, in fp32 until the end.

Every send is recorded on the ``CommCounter`` (kind "send", the message's bytes, group size cp);
``passes/planning/context_parallel_cost.py`` states the totals.

Point to point by ``dist.batch_isend_irecv`` (NCCL runs the send and receive of a step as one group,
which both directions between the same two ranks at cp = 2 need); tags keep the key/value and gradient
messages of a step apart on gloo, which matches by tag.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from xirang.codegen.ops.collectives import group_rank, group_size
from xirang.codegen.ops.comm_counter import CommCounter, record_call
from xirang.codegen.ops.context_attention_blocks import (CAUSAL, AttentionMask, Seen, block_backward,
                                                         block_forward, default_scale, full_attention, merge_into,
                                                         visibility, with_key_keep)
from xirang.codegen.ops.context_attention_layout import chunks_of_rank
from xirang.ir.errors import InvalidValue

KV_TAG, GRAD_TAG = 0, 1  # the two messages a backward step has in flight from the same peer


def exchange(tensor: torch.Tensor, group, counter: Optional[CommCounter], label: str, tag: int) -> Callable:
    """Post the send of ``tensor`` to the next rank of the ring and the receive of one alike from the
    previous; returns a function that waits for both and gives the received tensor."""
    cp, rank = group_size(group), group_rank(group)
    outgoing = tensor.contiguous()
    incoming = torch.empty_like(outgoing)
    record_call(counter, "send", outgoing.nbytes, cp, label)
    ops = [dist.P2POp(dist.isend, outgoing, dist.get_global_rank(group, (rank + 1) % cp), group, tag),
           dist.P2POp(dist.irecv, incoming, dist.get_global_rank(group, (rank - 1) % cp), group, tag)]
    if outgoing.device.type == "meta":
        # the dry run of a GPU program (plain meta tensors, fake group): batch_isend_irecv asks the group for
        # the meta device's backend, which none has; the same two messages posted one by one record alike
        works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
    else:
        works = dist.batch_isend_irecv(ops)

    def wait() -> torch.Tensor:
        for work in works:
            work.wait()
        return incoming
    return wait


def _pairs(mask: AttentionMask, rank: int, source: int, cp: int, c: int, device, keep: Optional[torch.Tensor]):
    """Per query chunk a (0, 1) of ``rank``: (a, key chunks b of ``source``'s block it sees, the bool mask
    over them or None when all is seen); query chunks that see nothing of the block are left out. ``keep``
    (B, S) bool by global key position (a padding mask, ``context_attention_blocks.py``) joins the mask as
    (B, 1, 1, Sq, Sk), each key block's bits read at its chunks' positions."""
    q_chunks, k_chunks = chunks_of_rank(rank, cp), chunks_of_rank(source, cp)
    for a, qi in enumerate(q_chunks):
        seen = [(b, visibility(mask, qi * c, ki * c, c, c)) for b, ki in enumerate(k_chunks)]
        keys = [b for b, how in seen if how is not Seen.NONE]
        if not keys:
            continue
        visible = None
        k_pos = torch.cat([torch.arange(k_chunks[b] * c, (k_chunks[b] + 1) * c, device=device) for b in keys])
        if any(how is Seen.PART for _, how in seen):
            visible = mask.visible(torch.arange(qi * c, (qi + 1) * c, device=device), k_pos)
        if keep is not None:
            visible = with_key_keep(visible, keep.index_select(1, k_pos))
        yield a, keys, visible


def _keys(block: torch.Tensor, keys: list, c: int) -> torch.Tensor:
    """The key chunks ``keys`` (0, 1 or both, in order) of a (…, 2c, d) block along its sequence dim."""
    return block if len(keys) == 2 else block.narrow(-2, keys[0] * c, c)


def _forward(q, k, v, group, mask, scale, counter, keep):
    cp, rank = group_size(group), group_rank(group)
    c = q.shape[2] // 2
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    for step in range(cp):
        arriving = exchange(kv, group, counter, "ring_attention.forward kv", KV_TAG) if step < cp - 1 else None
        for a, keys, visible in _pairs(mask, rank, (rank - step) % cp, cp, c, q.device, keep):
            block_out, block_lse = block_forward(q.narrow(2, a * c, c), _keys(kv[0], keys, c), _keys(kv[1], keys, c),
                                                 scale, visible)
            merge_into(out.narrow(2, a * c, c), lse.narrow(2, a * c, c), block_out, block_lse)
        if arriving is not None:
            kv = arriving()
    return out.to(q.dtype), lse


def _backward(q, k, v, out, lse, dout, group, mask, scale, counter, keep):
    cp, rank = group_size(group), group_rank(group)
    c = q.shape[2] // 2
    delta = (dout.float() * out.float()).sum(dim=-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    gradient_arriving = None
    for step in range(cp):
        arriving = exchange(kv, group, counter, "ring_attention.backward kv", KV_TAG) if step < cp - 1 else None
        grads = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # dK, dV of the block held
        for a, keys, visible in _pairs(mask, rank, (rank - step) % cp, cp, c, q.device, keep):
            rows = slice(a * c, (a + 1) * c)
            dq_a, dk, dv = block_backward(q[:, :, rows], _keys(kv[0], keys, c), _keys(kv[1], keys, c),
                                          dout[:, :, rows], lse[:, :, rows], delta[:, :, rows], scale, visible)
            dq[:, :, rows] += dq_a
            _keys(grads[0], keys, c).add_(dk)
            _keys(grads[1], keys, c).add_(dv)
        if gradient_arriving is not None:  # the ranks before this one's part of this block's gradient
            grads += gradient_arriving().float()
        gradient_arriving = exchange(grads.to(k.dtype), group, counter, "ring_attention.backward dkv", GRAD_TAG)
        if arriving is not None:
            kv = arriving()
    dk, dv = gradient_arriving()  # this rank's own block, back from its last hop
    return dq.to(q.dtype), dk, dv


class RingAttention(torch.autograd.Function):
    """Forward: ring attention (module docstring). Backward: the ring backward, dK/dV travelling too."""

    @staticmethod
    def forward(ctx, q, k, v, group, mask, scale, counter, keep):
        out, lse = _forward(q, k, v, group, mask, scale, counter, keep)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, mask, scale, counter, keep)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(q, k, v, out, lse, dout.contiguous(), *ctx.args), None, None, None, None, None)


def check_qkv(q, k, v, where: str) -> None:
    """q (B, Hq, S, d), k and v (B, Hkv, S, d) with Hkv dividing Hq: SDPA's layout of self-attention."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise InvalidValue(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not self-attention "
                           f"inputs laid out (batch, heads, local sequence, head dim)", where=where,
                           hint="pass q, k, v as SDPA takes them (k and v of one shape, the sequence and head dim "
                                "of q's)")
    if q.shape[1] % k.shape[1]:
        raise InvalidValue(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads",
                           where=where, hint="grouped-query attention needs the kv heads to divide the query heads")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, mask: AttentionMask = CAUSAL,
                   scale: Optional[float] = None, counter: Optional[CommCounter] = None,
                   keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence of the cp ``group`` by the ring (module
    docstring). q (B, Hq, S/cp, d), k and v (B, Hkv, S/cp, d), all in the load-balanced layout
    (``shard_sequence``); returns this rank's output rows, (B, Hq, S/cp, d) in q's dtype. ``group`` None
    or of one rank: plain attention (the layout is the sequence in order). ``keep``: a key padding mask,
    (B, S) bool over the whole sequence in order (False: the key is hidden from every query); a row that
    then sees no key gets output 0 and no gradient, as SDPA gives it."""
    check_qkv(q, k, v, "ring_attention")
    scale = default_scale(q.shape[-1], scale)
    if group_size(group) == 1:
        return full_attention(q, k, v, mask, scale, keep)
    if q.shape[2] % 2:
        raise InvalidValue(f"a local sequence of {q.shape[2]} tokens is not two equal chunks (q {tuple(q.shape)})",
                           where="ring_attention", hint="shard the sequence with shard_sequence: its length must "
                                                        "be a multiple of 2 x cp")
    return RingAttention.apply(q, k, v, group, mask, scale, counter, keep)
