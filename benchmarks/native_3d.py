"""The hand-configured PyTorch-native 3D baseline that benchmarks/race_native.py races Xirang against.

What a PyTorch user writes by hand, with public APIs only, for the GPT of examples/gpt.py:
- tp: DTensor (``parallelize_module`` on the mesh's "tp" dim), Megatron's plan: q, k, v and the
  MLP's up projection column-parallel, the attention output and the MLP's down projection
  row-parallel; embeddings, LayerNorms and the LM head replicated. The fused qkv Linear of
  examples/gpt.py is split into three Linears first (its weight's row-slices): a column split of
  the fused weight would give rank 0 all of q and half of k instead of its heads of each.
- pp: ``torch.distributed.pipelining`` stages of consecutive layers (the first also embeds, the
  last also applies ln_f and the head) run by ``ScheduleGPipe`` or ``Schedule1F1B``.
- dp: DDP around the stage where tp = 1 (pipelining runs all but the last backward under
  ``no_sync``), else one flat all-reduce of the gradients after the backward (DDP does not take
  DTensor parameters).
Every weight is copied from the reference model, so the native run starts where Xirang's does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from xirang.ir.errors import XirangError

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


class _Attention(nn.Module):
    """examples/gpt.py's attention with q, k, v as separate Linears, so each can be split by heads."""

    def __init__(self, fused, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        q_w, k_w, v_w = fused.qkv.weight.detach().chunk(3)
        q_b, k_b, v_b = fused.qkv.bias.detach().chunk(3)
        self.q, self.k, self.v = _linear(q_w, q_b), _linear(k_w, k_b), _linear(v_w, v_b)
        self.proj = _linear(fused.proj.weight.detach(), fused.proj.bias.detach())

    def forward(self, x):
        batch, seq, _ = x.shape
        # -1 heads: under tp each rank holds heads / tp of them
        q, k, v = (lin(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class _Block(nn.Module):
    def __init__(self, block, head_dim: int):
        super().__init__()
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.attn = _Attention(block.attn, head_dim)
        self.up, self.down = block.mlp.up, block.mlp.down

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class NativeStage(nn.Module):
    """Layers [first, last) of the GPT; stage 0 embeds the token ids, the last stage returns logits."""

    def __init__(self, gpt, first: int, last: int, head_dim: int):
        super().__init__()
        layers = len(gpt.layers)
        self.embed = first == 0
        self.head = last == layers
        if self.embed:
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        self.blocks = nn.ModuleList(_Block(gpt.layers[i], head_dim) for i in range(first, last))
        if self.head:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x):
        if self.embed:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.head else x


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


_TP_PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


class NativeRun:
    """This rank's native program for mesh (dp, tp, pp): ``step(batch)`` trains one step (forward,
    backward, dp sync, optimizer) and returns the loss of this rank's share, or None where the rank
    does not compute the loss (not the last stage, or tp rank > 0)."""

    def __init__(self, gpt, mesh: tuple, schedule: str, micro_batches: int, make_optimizer):
        dp, tp, pp = mesh
        layers = len(gpt.layers)
        if layers % pp:
            raise XirangError(f"{layers} layers do not split over pp={pp}", where="NativeRun",
                              hint="pick pp dividing the layer count")
        self.device_mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
        self.dp, self.pp, self.tp = dp, pp, tp
        self.dp_rank = self.device_mesh.get_local_rank("dp")
        self.pp_rank = self.device_mesh.get_local_rank("pp")
        self.tp_rank = self.device_mesh.get_local_rank("tp")
        per = layers // pp
        head_dim = gpt.config.hidden // gpt.config.heads
        module = NativeStage(gpt, self.pp_rank * per, (self.pp_rank + 1) * per, head_dim)
        if tp > 1:
            for block in module.blocks:
                parallelize_module(block, self.device_mesh["tp"], _TP_PLAN)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.dp_group = self.device_mesh["dp"].get_group() if dp > 1 else None
        self.flat_dp = dp > 1 and tp > 1
        if dp > 1 and tp == 1:
            module = nn.parallel.DistributedDataParallel(module, process_group=self.dp_group)
        self.module = module
        self.optimizer = make_optimizer(self.params)
        self.schedule = None
        if pp > 1:
            stage = PipelineStage(module, self.pp_rank, pp, torch.device("cpu"),
                                  group=self.device_mesh["pp"].get_group())
            self.schedule = SCHEDULES[schedule](stage, n_microbatches=micro_batches, loss_fn=loss_fn)

    def step(self, batch: dict):
        ids = batch["input_ids"].chunk(self.dp)[self.dp_rank]
        labels = batch["labels"].chunk(self.dp)[self.dp_rank]
        last = self.pp_rank == self.pp - 1
        if self.schedule is None:
            loss = loss_fn(self.module(ids), labels)
            loss.backward()
            loss = loss.detach()
        else:
            losses = []
            if self.pp_rank == 0:
                self.schedule.step(ids)
            elif last:
                self.schedule.step(target=labels, losses=losses)
            else:
                self.schedule.step()
            loss = torch.stack(losses).detach().mean() if last else None
        if self.flat_dp:
            self._all_reduce_grads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss) if last and self.tp_rank == 0 else None

    def _all_reduce_grads(self):
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
