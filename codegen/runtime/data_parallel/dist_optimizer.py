"""ZeRO-1, the distributed optimizer: each dp rank steps only its 1/dp slice of every gradient bucket.

    compiled = xirang.compile(model, ..., zero_stage=1)
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)  # the shard parameters, below
    loss = compiled.train_step(**batch); optimizer.step(); optimizer.zero_grad()

Megatron-LM's DistributedOptimizer and DeepSpeed's stage 1 (Rajbhandari et al. 2020, P_os): a
bucket's flat gradient buffer, padded with zeros to a multiple of dp, is reduce-scattered over the
dp group instead of all-reduced (codegen/runtime/data_parallel/grad_sync.py ``shard_gradients``), so dp rank r
receives the average of the r-th contiguous 1/dp slice. Per bucket this rank holds one flat
tensor with the values of its slice of the bucket's parameters (``BucketShard.param``), cut where the
slice crosses from one parameter to the next into "shard pieces": leaf parameters that alias the
flat slice (``torch.nn.Parameter`` of a view shares its storage and version counter), one per model
parameter the slice touches, whose ``.grad`` are the pieces of the reduce-scattered slice.
``compiled.parameters()`` yields the pieces and ``compiled.named_parameters()`` each with its model
parameter's name, so any element-wise torch optimizer (SGD, Adam, AdamW) keeps state for 1/dp of the
elements and steps exactly what one device steps on them -- groups chosen by name too (weight decay
off for biases and norms, per-parameter learning rates), which one flat tensor per bucket could not
carry. A parameter this rank's slices do not touch has no piece here (another dp rank steps it).
The model's parameters stay whole (ZeRO-1 does not shard them) and are refreshed by
one all-gather per bucket of the updated slices (in the parameters' dtype: Xirang stores parameters
in fp32 and casts in the graph, so the shard is the fp32 master).

When the all-gather runs: lazily, at the start of the next ``train_step`` (and before anything reads
the parameters: ``full_state_dict``, a checkpoint), once any shard changed since the last gather
(its autograd version counter moved: the optimizer writes in place). Chosen over an optimizer step
hook because the user builds the optimizer and the compiled model never sees it; and the start of
the next step is where a later version can overlap the gather with the forward. Today the gathers
run back to back before the forward (exposed, as the planner prices them).

Checkpoints save the state under the single-device names, as without ZeRO: ``per_parameter_view``
all-gathers each shard's state over dp and cuts it per parameter (transiently the whole local state,
as zero 0 holds it), and ``load_per_parameter`` takes each shard's slice of the loaded state.

A bucket that holds a weight tied across pipeline ranks (a tied embedding and LM head) is still
all-reduced: its copies' gradients are summed over the tied group after the dp average, and the
slices of two pipeline ranks' buckets do not line up. After that sum ``collect_whole_buckets`` cuts
this rank's slice out of the full gradients and drops them.

ZeRO-3 (codegen/runtime/data_parallel/param_shards.py ``ZeroThreeShards``) is this class with the parameters freed at
rest; ``param_shards.zero_shards`` builds whichever the plan's stage asks for.
"""
from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from xirang.codegen.ops.collectives import all_gather_flat
from xirang.codegen.ops.comm_counter import record_call
from xirang.codegen.runtime.data_parallel.grad_norm import CLIP_EPS, LOG, UNCLIPPED, global_grad_norm, owned_mask
from xirang.ir.errors import XirangError


@dataclass(eq=False)
class BucketShard:
    """This dp rank's slice of one gradient bucket: the bucket's parameters (launch order) as one flat
    buffer of ``padded`` elements (a multiple of dp), of which ``param`` holds ``[start, start + size)``."""

    buckets: object  # the GradientBuckets it belongs to
    index: int       # the bucket's index in it
    label: str
    params: list
    padded: int
    start: int
    size: int
    param: torch.Tensor  # the slice's values, flat (the pieces alias it; gathered from, refreshed into)
    scatter: bool        # reduce-scattered (False: all-reduced, holds a tied weight)
    owned: torch.Tensor  # bool over the slice: elements that count in the global gradient norm
    version: int = 0     # param._version after the last gather or refresh
    pieces: list = None  # ShardPiece per model parameter the slice touches, in bucket order

    def flat(self, tensors) -> torch.Tensor:
        """``tensors`` (one per parameter) as the bucket's padded flat buffer."""
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(self.padded - flat.numel())])

    def mine(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start:self.start + self.size]

    def cut(self, names: list) -> None:
        """The pieces: for each parameter overlapping ``[start, start + size)``, a leaf aliasing its part."""
        self.pieces, offset = [], 0
        for name, p in zip(names, self.params):
            lo, hi = max(offset, self.start), min(offset + p.numel(), self.start + self.size)
            if lo < hi:
                piece = torch.nn.Parameter(self.param[lo - self.start:hi - self.start])
                self.pieces.append(ShardPiece(name, piece, lo - self.start, hi - self.start))
            offset += p.numel()

    def grad(self):
        """The slice's gradient, flat (None: no piece has one; a piece without one, and the padding, as 0)."""
        if all(piece.param.grad is None for piece in self.pieces):
            return None
        flat = self.param.new_zeros(self.size)
        for piece in self.pieces:
            if piece.param.grad is not None:
                flat[piece.lo:piece.hi] = piece.param.grad.detach()
        return flat


@dataclass(eq=False)
class ShardPiece:
    """The part ``[lo, hi)`` of a bucket slice that belongs to model parameter ``name``: the tensor an
    optimizer steps for it on this dp rank."""

    name: str
    param: torch.nn.Parameter
    lo: int
    hi: int


class ZeroOneShards:
    """The shard parameters of every dp bucket of this rank's local stages (see the module docstring).

    ``grad_buckets``: local stage -> its ``GradientBuckets``; ``fqn_of``: id(parameter) -> FQN;
    ``tied``: (FQN, group) of the weights tied across pipeline ranks; ``shards`` the program's tp
    shards and ``groups`` the mesh's groups (for the norm's ownership); ``counter`` the CommCounter."""

    def __init__(self, grad_buckets: dict, fqn_of: dict, *, tied: list, shards: dict, groups, counter=None):
        self.groups, self.counter = groups, counter
        self.dp, dp_rank = groups.axis_size("dp"), groups.axis_index("dp")
        tied_names = {fqn for fqn, _ in tied}
        self.shards: list[BucketShard] = []
        for stage in sorted(grad_buckets):
            buckets = grad_buckets[stage]
            scattered = []
            for index, params in enumerate(buckets.bucket_params):
                names = [fqn_of[id(p)] for p in params]
                total = sum(p.numel() for p in params)
                padded = -(-total // self.dp) * self.dp
                size = padded // self.dp
                scatter = not tied_names.intersection(names)
                masks = [owned_mask(name, p, shards=shards, tied=tied, groups=groups) for name, p in zip(names, params)]
                shard = BucketShard(buckets, index, buckets.buckets[index].label, list(params), padded,
                                    dp_rank * size, size, None, scatter, None)
                shard.param = shard.mine(shard.flat(params)).clone()
                shard.cut(names)
                shard.owned = shard.mine(shard.flat(masks)).clone()  # not a view holding the whole bucket's mask
                shard.version = shard.param._version
                self.shards.append(shard)
                if scatter:
                    scattered.append(index)
            by_index = {s.index: s for s in self.shards if s.buckets is buckets}
            buckets.shard_gradients(scattered,
                                    lambda index, grad, by_index=by_index: _accumulate(by_index[index], grad))

    def parameters(self) -> list:
        """The shard pieces, for the optimizer (one per model parameter this rank's slices touch)."""
        return [piece.param for _, piece in self.named_pieces()]

    def named_parameters(self) -> list:
        """(model parameter's FQN, its shard piece) for the optimizer: groups by name work as on one device."""
        return [(piece.name, piece.param) for _, piece in self.named_pieces()]

    def named_pieces(self) -> list:
        """(BucketShard, ShardPiece) of every piece, in bucket order."""
        return [(shard, piece) for shard in self.shards for piece in shard.pieces]

    def collect_whole_buckets(self) -> None:
        """After the tied sums: this rank's slice of each all-reduced bucket's gradients goes to its shard,
        and the full gradients are dropped (every parameter's gradient then lives only in a shard)."""
        for shard in self.shards:
            if shard.scatter or any(p.grad is None for p in shard.params):
                continue
            _accumulate(shard, shard.mine(shard.flat([p.grad for p in shard.params])).clone())
            for p in shard.params:
                p.grad = None

    def gather_parameters(self, force: bool = False) -> None:
        """All-gather every bucket's updated slices into the model's parameters, if any shard changed
        since the last gather (``force``: always). Collective over dp: every dp rank steps alike."""
        if not force and all(shard.param._version == shard.version for shard in self.shards):
            return
        with torch.no_grad():
            for shard in self.shards:
                full = shard.param.new_empty(shard.padded)
                record_call(self.counter, "all_gather", full.nbytes, self.dp, shard.label)
                all_gather_flat(full, shard.param.detach(), self.groups.dp)
                offset = 0
                for p in shard.params:
                    p.copy_(full[offset:offset + p.numel()].view(p.shape))
                    offset += p.numel()
                shard.version = shard.param._version

    def before_step(self) -> None:
        """The last optimizer step's slices, into every replica (lazily: only if a shard changed)."""
        self.gather_parameters()

    def after_step(self) -> None:
        """The step's gradients are final (tied sums done): the whole buckets' slices go to the shards."""
        self.collect_whole_buckets()

    @contextmanager
    def parameters_resident(self):
        """The model's parameters current for what reads them between steps (a state dict, a checkpoint)."""
        self.gather_parameters()
        yield

    def refresh_from_parameters(self) -> None:
        """The model's parameters were loaded: take each shard's slice of them (no communication)."""
        with torch.no_grad():
            for shard in self.shards:
                shard.param.copy_(shard.mine(shard.flat(shard.params)))
                shard.version = shard.param._version

    def full_gradients(self) -> dict:
        """id(parameter) -> its averaged gradient, all-gathered from the shards (collective over dp);
        parameters whose shard has no gradient are left out."""
        found = {}
        for shard in self.shards:
            grad = shard.grad()
            # a slice of padding alone has no piece: it joins any rank that has a gradient
            has = torch.tensor([grad is not None or not shard.pieces], dtype=torch.int32, device=shard.param.device)
            dist.all_reduce(has, op=dist.ReduceOp.MIN, group=self.groups.dp)
            if not has.item():
                continue
            full = shard.param.new_empty(shard.padded)
            all_gather_flat(full, (grad if grad is not None else shard.param.new_zeros(shard.size)).contiguous(),
                            self.groups.dp)
            offset = 0
            for p in shard.params:
                found[id(p)] = full[offset:offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        return found

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the shards: each element of the whole model once (the
        owned elements of this rank's slices, summed over dp, tp and pp), every shard gradient scaled."""
        for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise XirangError(f"{name} must be a positive number, got {value!r}",
                                  where="CompiledModel.clip_grad_norm_ (ZeRO-1)",
                                  hint="pass e.g. clip_grad_norm_(1.0) or norm_type=float('inf')")
        owned = [piece.param.grad.detach()[shard.owned[piece.lo:piece.hi]] for shard, piece in self.named_pieces()
                 if piece.param.grad is not None]
        device = self.shards[0].param.device if self.shards else "cpu"
        total = global_grad_norm(owned, float(norm_type), self.groups, device, axes=("dp", "tp", "pp"))
        if not torch.isfinite(total):
            if not math.isinf(max_norm):  # the norm alone was asked for: the caller's guard reports it
                LOG.warning(UNCLIPPED, self.groups.rank, total.item())
            return total
        if math.isinf(max_norm):  # the norm only: scaling by 1 would be a pass over every gradient for nothing
            return total
        coefficient = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
        for _, piece in self.named_pieces():
            if piece.param.grad is not None:
                piece.param.grad.detach().mul_(coefficient.to(piece.param.grad.dtype))
        return total

    def per_parameter_view(self, optimizer) -> "PerParameterState":
        """``optimizer``'s state as one device's optimizer holds it: per model parameter, each element-wise
        tensor all-gathered over dp and cut to the parameter's shape (collective over dp). Each slice's state
        is its pieces' put back end to end (0 where a piece has none, and in the padding)."""
        state = defaultdict(dict)
        slices = [_slice_state(shard, optimizer) for shard in self.shards]
        everyone = [None] * self.dp  # a slice of padding alone has no piece, hence no keys: take a peer's
        dist.all_gather_object(everyone, [{key: kind for key, (kind, _) in found.items()} for found in slices],
                               group=self.groups.dp)
        for index, shard in enumerate(self.shards):
            kinds = {}
            for peer in everyone:
                kinds.update(peer[index])
            for key in sorted(kinds):  # the same keys on every dp rank: one optimizer, stepped alike
                kind, value = slices[index].get(key, (kinds[key], None))
                if kind == "whole":  # a pieceless slice's: 0, as a tensor never stepped
                    for p in shard.params:
                        state[p][key] = value if value is not None else torch.tensor(0.0)
                    continue
                value = value if value is not None else shard.param.new_zeros(shard.size)
                full = value.new_empty(shard.padded)
                all_gather_flat(full, value.detach().contiguous(), self.groups.dp)
                offset = 0
                for p in shard.params:
                    state[p][key] = full[offset:offset + p.numel()].view(p.shape).clone()
                    offset += p.numel()
        return PerParameterState(state, optimizer.param_groups)

    def load_per_parameter(self, optimizer, view: "PerParameterState") -> None:
        """Give ``optimizer`` each shard's slice of the per-parameter state in ``view`` (no communication)."""
        optimizer.state.clear()
        for shard in self.shards:
            per = [view.state.get(p, {}) for p in shard.params]
            if not per[0]:
                continue
            entry = {}
            for key, first in per[0].items():
                whole = isinstance(first, torch.Tensor) and first.dim() > 0 and first.shape == shard.params[0].shape
                entry[key] = shard.mine(shard.flat([s[key] for s in per])).clone() if whole else first
            for piece in shard.pieces:  # each piece its own tensors: AdamW counts its step in place
                optimizer.state[piece.param] = {key: value[piece.lo:piece.hi].clone() if _elementwise(
                    per[0][key], shard.params[0]) else _own(value) for key, value in entry.items()}

    def optimizer_state_elements(self, optimizer) -> int:
        """Elements of ``optimizer``'s tensor state held for this rank's shards (a direct count)."""
        mine = {id(piece.param) for _, piece in self.named_pieces()}
        return sum(value.numel() for param, state in optimizer.state.items() if id(param) in mine
                   for value in state.values() if isinstance(value, torch.Tensor) and value.dim() > 0)


@dataclass
class PerParameterState:
    """What checkpoint/save_load.py reads of an optimizer: ``state`` per model parameter and the ``param_groups``
    (the real optimizer's, so loading updates its hyperparameters)."""

    state: dict
    param_groups: list


def _accumulate(shard: BucketShard, grad: torch.Tensor) -> None:
    """Add a step's averaged slice to the pieces' gradients, as autograd accumulates into ``.grad``."""
    for piece in shard.pieces:
        part = grad[piece.lo:piece.hi]
        if piece.param.grad is None:
            piece.param.grad = part
        else:
            piece.param.grad.add_(part)


def _own(value):
    """A copy of a tensor (Adam's ``step``, which ``optimizer.step`` increments in place), other values as they are."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _elementwise(value, like: torch.Tensor) -> bool:
    """A state tensor of its tensor's shape: pieced like it (Adam's moments), else whole (Adam's step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == like.shape


def _slice_state(shard: BucketShard, optimizer) -> dict:
    """key -> ("slice", this rank's flat slice of an element-wise state) or ("whole", the value) for one
    bucket slice, from its pieces' optimizer state."""
    found = {}
    for piece in shard.pieces:
        for key, value in optimizer.state.get(piece.param, {}).items():
            if _elementwise(value, piece.param):
                flat = found.get(key, ("slice", None))[1]
                if flat is None:
                    flat = value.new_zeros(shard.size)
                    found[key] = ("slice", flat)
                flat[piece.lo:piece.hi] = value.detach()
            else:
                found.setdefault(key, ("whole", value))
    return found

