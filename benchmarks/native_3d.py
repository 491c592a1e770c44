"""The hand-configured PyTorch-native 3D baseline that benchmarks/race_native.py races Xirang against.

What a PyTorch user writes by hand, with public APIs only, for the GPT of examples/gpt.py, as strong
as the native stack allows at every mesh (torchtitan's choices where it has them):
- tp: DTensor (``parallelize_module`` on the mesh's "tp" dim), Megatron's plan: q, k, v and the
  MLP's up projection column-parallel, the attention output and the MLP's down projection
  row-parallel; the token embedding row-parallel (vocabulary-parallel: each rank looks up its rows,
  one all-reduce), the LM head column-parallel with its logits left sharded over the vocabulary and
  the cross-entropy computed on the shards under ``loss_parallel`` (no rank gathers the logits);
  positions and LayerNorms replicated. The fused qkv Linear of examples/gpt.py is split into three
  Linears first (its weight's row-slices): a column split of the fused weight would give rank 0 all
  of q and half of k instead of its heads of each.
- pp: ``torch.distributed.pipelining`` stages of consecutive pieces (the embedding, each layer, ln_f
  with the head) run by ``ScheduleGPipe`` or ``Schedule1F1B``, cut where a careful user would cut by
  hand: the contiguous split whose busiest stage has the fewest forward FLOPs by Megatron's count
  (``balanced_split``; the head weighs more than a layer here, so an even split of the layers would
  leave the last stage the slowest).
- dp: DDP around the stage where tp = 1 (pipelining runs all but the last backward under
  ``no_sync``). DDP does not take DTensor parameters, so where tp > 1 this file does what DDP does
  with them: gradients in buckets (DDP's sizes: 1 MiB first, then 25 MiB, parameters in reverse
  order), each bucket's all-reduce started asynchronously as soon as its last gradient of the step
  is accumulated (a post-accumulate-grad hook; on the last micro-batch under a pipeline), in bucket
  order on every rank, so the reduction overlaps the rest of the backward; the step waits for them
  before the optimizer.
Every weight is copied from the reference model, so the native run starts where Xirang's does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

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
    """Pieces [first, last) of the GPT, piece 0 the embedding, 1..L the layers, L + 1 ln_f and the head:
    the stage holding piece 0 embeds the token ids, the one holding the last returns logits."""

    def __init__(self, gpt, first: int, last: int, head_dim: int):
        super().__init__()
        layers = len(gpt.layers)
        self.embed = first == 0
        self.head = last == layers + 2
        if self.embed:
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        self.blocks = nn.ModuleList(_Block(gpt.layers[piece - 1], head_dim)
                                    for piece in range(max(first, 1), min(last, layers + 1)))
        if self.head:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x):
        if self.embed:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.head else x


def piece_flops(config) -> list[float]:
    """Forward FLOPs per token of each piece by Megatron's count (Narayanan et al. 2021, sec. 5.1): a layer
    24 h^2 + 4 s h (the four projections, the MLP, the attention scores and their product with v), the head
    2 h V; the embedding a lookup."""
    h, s, vocab = config.hidden, config.seq_len, config.vocab_size
    return [0.0] + [24 * h * h + 4 * s * h] * config.layers + [2 * h * vocab]


def balanced_split(costs: list[float], stages: int) -> list[int]:
    """Start piece of each stage: the contiguous split, every stage non-empty, whose costliest stage costs
    least (dynamic programming over the pieces; ties to the earlier cut)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise XirangError(f"{n} pieces do not split into {stages} stages", where="balanced_split",
                          hint=f"pick pp of at most {n}")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    best = {(0, 0): (0.0, [])}  # (stages used, pieces covered) -> (max stage cost, starts)
    for used in range(1, stages + 1):
        for end in range(used, n - (stages - used) + 1):
            options = [(max(best[used - 1, start][0], prefix[end] - prefix[start]), best[used - 1, start][1] + [start])
                       for start in range(used - 1, end) if (used - 1, start) in best]
            best[used, end] = min(options, key=lambda option: option[0])
    return best[stages, n][1]


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


_TP_PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
# torchtitan's: the embedding vocabulary-parallel, the head's logits kept sharded for loss_parallel
_TP_ENDS = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
FIRST_BUCKET_BYTES, BUCKET_BYTES = 1 << 20, 25 << 20  # DDP's bucket_cap_mb=25 and its 1 MiB first bucket


class OverlappedGradientSync:
    """DDP's gradient reduction for parameters DDP does not take (DTensors): buckets all-reduced over the
    dp group asynchronously as their gradients complete, in bucket order, averaged and copied back in
    ``finish``. ``accumulations`` is how many backwards add into a gradient per step (the micro-batches
    a pipeline stage runs): a bucket's reduction starts after the last of them. ``accumulations=0`` is the
    weak baseline's sync instead: no hooks, one flat all-reduce of every gradient in ``finish``."""

    def __init__(self, params: list, group, dp: int, accumulations: int):
        self.group, self.dp, self.accumulations = group, dp, accumulations
        self.buckets: list[list] = [[]]
        size = 0
        if accumulations == 0:  # no hooks: one bucket of everything, reduced in finish()
            self.buckets = [list(params)]
            params = []
        for param in reversed(params):  # DDP's order: roughly the order the backward produces gradients
            cap = FIRST_BUCKET_BYTES if len(self.buckets) == 1 else BUCKET_BYTES
            if self.buckets[-1] and size + self._local(param).numel() * 4 > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(param)
            size += self._local(param).numel() * 4
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        for param in params:
            param.register_post_accumulate_grad_hook(self._accumulated)
        self.start_step()

    @staticmethod
    def _local(tensor):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def start_step(self):
        self.seen = {id(p): 0 for bucket in self.buckets for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.works: list = []

    def _accumulated(self, param):
        self.seen[id(param)] += 1
        if self.seen[id(param)] == self.accumulations:
            self.ready[self.bucket_of[id(param)]] += 1
            self._launch_ready()

    def _launch_ready(self, everything: bool = False):
        while len(self.works) < len(self.buckets):  # in bucket order on every rank, as DDP's reducer
            index = len(self.works)
            bucket = self.buckets[index]
            if not everything and self.ready[index] < len(bucket):
                return
            flat = torch.cat([self._local(p.grad).reshape(-1) for p in bucket])
            self.works.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self):
        self._launch_ready(everything=True)
        for (flat, work), bucket in zip(self.works, self.buckets):
            work.wait()
            flat /= self.dp
            offset = 0
            for param in bucket:
                grad = self._local(param.grad)
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self.start_step()


class NativeRun:
    """This rank's native program for mesh (dp, tp, pp): ``step(batch)`` trains one step (forward,
    backward, dp sync, optimizer) and returns the loss of this rank's share, or None where the rank
    does not compute the loss (not the last stage, or tp rank > 0)."""

    def __init__(self, gpt, mesh: tuple, schedule: str, micro_batches: int, make_optimizer, *, strong: bool = True):
        """``strong=False`` is the earlier, weaker baseline, kept to compare with: the layers split evenly
        over the stages, embedding and LM head replicated (full logits on every tp rank) and, where dp > 1
        and tp > 1, one flat all-reduce of every gradient after the backward, overlapping nothing."""
        dp, tp, pp = mesh
        self.strong = strong
        self.device_mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
        self.dp, self.pp, self.tp = dp, pp, tp
        self.dp_rank = self.device_mesh.get_local_rank("dp")
        self.pp_rank = self.device_mesh.get_local_rank("pp")
        self.tp_rank = self.device_mesh.get_local_rank("tp")
        costs, layers = piece_flops(gpt.config), len(gpt.layers)
        if strong:
            self.starts = balanced_split(costs, pp) + [len(costs)]
        elif layers % pp:
            raise XirangError(f"{layers} layers do not split evenly over pp={pp}", where="NativeRun(strong=False)",
                              hint="pick pp dividing the layer count, or the strong baseline's balanced split")
        else:  # the weak baseline's even split of the layers: the embedding on the first stage, the head on the last
            self.starts = [0] + [1 + stage * (layers // pp) for stage in range(1, pp)] + [len(costs)]
        head_dim = gpt.config.hidden // gpt.config.heads
        module = NativeStage(gpt, self.starts[self.pp_rank], self.starts[self.pp_rank + 1], head_dim)
        if tp > 1:
            for block in module.blocks:
                parallelize_module(block, self.device_mesh["tp"], _TP_PLAN)
            ends = {name: style for name, style in _TP_ENDS.items() if hasattr(module, name)}
            if ends and strong:
                parallelize_module(module, self.device_mesh["tp"], ends)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.dp_group = self.device_mesh["dp"].get_group() if dp > 1 else None
        self.grad_sync = None
        if dp > 1 and tp > 1:
            accumulations = micro_batches if pp > 1 else 1
            # the weak baseline's flat all-reduce after the backward: one bucket, started when all is done
            self.grad_sync = OverlappedGradientSync(self.params, self.dp_group, dp, accumulations if strong else 0)
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
        if self.tp > 1 and self.strong:  # the cross-entropy on vocabulary shards, forward and backward
            with loss_parallel():
                return self._step(batch)
        return self._step(batch)

    def _step(self, batch: dict):
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
            loss = torch.stack([_whole(x) for x in losses]).detach().mean() if last else None
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        if self.grad_sync is not None:
            self.grad_sync.finish()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss) if last and self.tp_rank == 0 else None


def _whole(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
