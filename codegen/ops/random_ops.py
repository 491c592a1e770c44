"""What an emitted program calls where the model draws random numbers: counter-based draws on
streams the runtime owns (the lowering pass: passes/lowering/random_streams.py).

Every random op of a rank's program (dropout, attention dropout, ``torch.rand`` ...) calls one of
``dropout``, ``native_dropout``, ``attention`` or ``draw`` with the program's ``rng`` (an
``RngContext``, a module attribute the runtime attaches like the tp group) and the op's
``RandomSite`` (its index in the graph, its stream and its full shape). Each call draws from a
generator made for that call alone, seeded from

    streams (default):  (compile seed, step, micro-batch, dp rank, op index, tp rank or "shared")
    exact:              (compile seed, step, op index)

so there is no RNG state to carry or restore: a re-run of a forward (activation recompute,
``torch.utils.checkpoint``) draws exactly the same numbers, and whatever the user seeded with
``torch.manual_seed`` does not matter. Streams: an op whose draw is replicated over tp
("tp-shared") draws the same on every tp rank, so replicated activations and parameters stay
identical; a tp-sharded one ("tp-rank") draws independently per tp rank; dp ranks and
micro-batches always draw independently; each op runs in one pipeline stage, so stages differ by
the op index. Megatron-LM's model-parallel RNG tracker has these semantics with two stateful
generators forked around module calls; here the stream follows from the op's layout in the graph.

Exact mode (``rng="exact"``, for verification): each op draws the whole tensor one device would
draw for the global batch (full tp shape, every sample) and keeps this rank's piece (its dp
share's micro-batch rows, its tp shard). It costs a full-size draw per micro-batch on every rank;
in exchange a plan with dropout > 0 equals one device exactly, where "one device" is the eager
model under ``ExactReference`` (below), which routes the same ops through the same draws.

Attention with dropout runs torch's fused kernel in streams mode (its own mask, drawn from the
device's default generator forked and seeded for the call: ``seeded_default_generator``) and
written-out attention with an explicit mask in exact mode. Ops without a rule of their own run
under a forked, seeded default generator too; exact mode replays those whose draw does not
depend on their input values (``RandomSite.kind``), and refuses the others when the batch or tp
splits them (``exact_refusals``).

The state a checkpoint needs is ``RngContext.state()``: the seed and the next step.
"""
from __future__ import annotations

import hashlib
import inspect
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from xirang.codegen.ops.collectives import Unattached
from xirang.ir.errors import XirangError
from xirang.ir.facts import RandomSite

MODES = ("streams", "exact")
_SEED_MASK = (1 << 63) - 1


def derive_seed(*parts) -> int:
    """A 63-bit seed from ``parts`` (ints and strings), the same in every process (not ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def exact_seed(seed: int, step: int, index: int) -> int:
    """Seed of op ``index``'s draw at ``step`` in exact mode: one draw per step, as one device's."""
    return derive_seed("exact", seed, step, index)


class RngContext:
    """The runtime's randomness: the compile seed, the mode, this rank's dp index and the step and
    micro-batch being run (set by the runtime before every forward and backward, so a recompute in
    the backward sees the micro-batch it recomputes)."""

    def __init__(self, seed: int, mode: str = "streams", *, dp_rank: int = 0, micro_batches: int = 1,
                 micro_batch_size: int = 1):
        if mode not in MODES:
            raise XirangError(f"unknown rng mode {mode!r}", where="xirang.compile(rng=...)",
                              hint=f"use one of {', '.join(MODES)}")
        self.seed, self.mode = int(seed), mode
        self.dp_rank, self.micro_batches, self.micro_batch_size = dp_rank, micro_batches, micro_batch_size
        # where this dp rank's share starts in the global batch (moved by uneven or rebalanced dp shares)
        self.share_start = dp_rank * micro_batches * micro_batch_size
        self.step, self.micro_batch = 0, 0

    def __repr__(self) -> str:
        return (f"RngContext(seed={self.seed}, mode={self.mode!r}, step={self.step}, "
                f"micro_batch={self.micro_batch}, dp_rank={self.dp_rank})")

    def state(self) -> dict:
        """What a checkpoint saves: with counter-based draws, the seed and the next step."""
        return {"seed": self.seed, "step": self.step, "mode": self.mode}

    def load_state(self, state: dict) -> None:
        self.seed, self.step = int(state["seed"]), int(state["step"])

    @property
    def first_sample(self) -> int:
        """Position in the global batch of the current micro-batch's first sample."""
        return self.share_start + self.micro_batch * self.micro_batch_size

    def seed_of(self, site: RandomSite) -> int:
        if self.mode == "exact":
            return exact_seed(self.seed, self.step, site.index)
        tp_rank = site.shard[2] if site.stream == "tp-rank" and site.shard else -1
        return derive_seed("streams", self.seed, self.step, self.micro_batch, self.dp_rank, site.index, tp_rank)


def _live(rng) -> RngContext:
    if isinstance(rng, Unattached) or rng is None:
        raise XirangError("a lowered program drew random numbers before the runtime attached its RNG streams",
                          where="the program's rng attribute",
                          hint="run programs through CompiledModel (xirang.compile), or call "
                               "xirang.codegen.emit.attach(program, rng=RngContext(seed)) first")
    return rng


def generator(seed: int, device) -> torch.Generator:
    """A fresh generator on ``device`` seeded with ``seed``, one per draw (meta, valueless, draws on the CPU's)."""
    return torch.Generator(device="cpu" if torch.device(device).type == "meta" else device).manual_seed(seed)


@contextmanager
def seeded_default_generator(device, seed: int):
    """Run the block with ``device``'s default generator seeded with ``seed``, restored after (for
    kernels that take no generator: fused attention, ops without a rule of their own)."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):  # a meta tensor has no generator of its own (``generator``)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
        return
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        module.default_generators[index].manual_seed(seed)
        yield


def keep_mask(shape, keep: float, gen: torch.Generator, device) -> torch.Tensor:
    """Booleans of ``shape``, each True with probability ``keep``."""
    return torch.empty(tuple(shape), dtype=torch.bool, device=device).bernoulli_(keep, generator=gen)


class _KeepScaled(torch.autograd.Function):
    """x * keep * scale, keeping the boolean mask (one byte per element) for the backward."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep * scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None, None


def apply_keep(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout of ``x`` with the mask ``keep`` (survivors scaled by 1 / (1 - p))."""
    return _KeepScaled.apply(x, keep, 0.0 if p >= 1 else 1.0 / (1.0 - p))


# --- this rank's piece of a full draw ----------------------------------------------------------------

def _tp_slice(full: torch.Tensor, dim: int, chunks: int, rank: int, tp: int) -> torch.Tensor:
    n = full.shape[dim]
    if chunks > 1:  # a rank's slice of every piece (ir/placement.Shard), concatenated
        view = full.shape[:dim] + (chunks, tp, n // (chunks * tp)) + full.shape[dim + 1:]
        piece = full.reshape(view).select(dim + 1, rank)
        return piece.reshape(full.shape[:dim] + (n // tp,) + full.shape[dim + 1:])
    local = -(-n // tp)  # ceil, as ir/placement.local_shape: the end is padded
    start = min(rank * local, n)
    piece = full.narrow(dim, start, min(local, n - start))
    if piece.shape[dim] < local:
        pad = list(piece.shape)
        pad[dim] = local - piece.shape[dim]
        piece = torch.cat([piece, torch.zeros(pad, dtype=piece.dtype, device=piece.device)], dim=dim)
    return piece


def piece_of(full: torch.Tensor, rng: RngContext, site: RandomSite) -> torch.Tensor:
    """This rank's part of a full draw: the current micro-batch's rows, then its tp shard."""
    if site.batch_dim >= 0:
        rows = site.rows_per_sample
        full = full.narrow(site.batch_dim, rng.first_sample * rows, rng.micro_batch_size * rows)
    if site.shard:
        dim, chunks, rank, tp = site.shard
        full = _tp_slice(full, dim, chunks, rank, tp)
    return full


def _exact_only(site: RandomSite) -> None:
    if site.exact:
        raise XirangError(f"rng='exact' cannot replay {site.node} ({site.op}) as one device draws it: {site.exact}",
                          where=f"node {site.node}", hint="verify this model with rng='streams', or draw outside "
                          "the split dims")


def _mask(rng: RngContext, site: RandomSite, local_shape, keep: float, device) -> torch.Tensor:
    gen = generator(rng.seed_of(site), device)
    if rng.mode == "exact":
        _exact_only(site)
        return piece_of(keep_mask(site.shape, keep, gen, device), rng, site)
    return keep_mask(local_shape, keep, gen, device)


# --- the functions emitted programs call ----------------------------------------------------------

def dropout(rng, site: RandomSite, input: torch.Tensor, p: float, train: Optional[bool] = True) -> torch.Tensor:  # noqa: A002
    """``aten.dropout(input, p, train)`` drawing on the site's stream."""
    if train is False or p == 0:
        return input
    rng = _live(rng)
    return apply_keep(input, _mask(rng, site, input.shape, 1.0 - p, input.device), p)


def native_dropout(rng, site: RandomSite, input: torch.Tensor, p: float,  # noqa: A002
                   train: Optional[bool] = True) -> tuple:
    """``aten.native_dropout``: (output, boolean keep mask)."""
    if train is False:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = _mask(_live(rng), site, input.shape, 1.0 - p, input.device)
    return apply_keep(input, keep, p), keep


def attention(rng, site: RandomSite, query, key, value, attn_mask=None, dropout_p: float = 0.0,
              is_causal: bool = False, *, scale=None, enable_gqa: bool = False) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` with dropout: the fused kernel under the site's seed
    (streams), or attention written out with this rank's piece of the full mask (exact)."""
    rng = _live(rng)
    if rng.mode != "exact" or dropout_p == 0:
        with seeded_default_generator(query.device, rng.seed_of(site)):
            return torch.ops.aten.scaled_dot_product_attention.default(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    keep = _mask(rng, site, None, 1.0 - dropout_p, query.device)
    return attention_math(query, key, value, attn_mask, keep, dropout_p, is_causal, scale, enable_gqa)


def attention_math(query, key, value, attn_mask, keep, p: float, is_causal: bool, scale, enable_gqa: bool):
    """softmax(q kᵀ * scale + mask) with dropout by ``keep``, times v (torch's math attention)."""
    length, source = query.shape[-2], key.shape[-2]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        future = torch.ones(length, source, dtype=torch.bool, device=query.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return apply_keep(torch.softmax(scores, dim=-1), keep, p) @ value


def _device_of(args, kwargs) -> torch.device:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _with_size(op, args: tuple, kwargs: dict, size: list) -> tuple:
    names = [a.name for a in op._schema.arguments]
    position = names.index("size")
    if position < len(args):
        return args[:position] + (size,) + args[position + 1:], kwargs
    return args, {**kwargs, "size": size}


def draw(rng, site: RandomSite, op, *args, **kwargs):
    """Any other random op ``op(*args, **kwargs)``: run under the device's default generator
    seeded for the site (streams); in exact mode drawn at full size and sliced where its values
    depend on shapes only (``site.kind`` "factory" or "shaped")."""
    rng = _live(rng)
    device = _device_of(args, kwargs)
    seed = rng.seed_of(site)
    if rng.mode != "exact":
        with seeded_default_generator(device, seed):
            return op(*args, **kwargs)
    _exact_only(site)
    if site.kind == "factory":
        args, kwargs = _with_size(op, args, kwargs, list(site.shape))
        with seeded_default_generator(device, seed):
            return piece_of(op(*args, **kwargs), rng, site).contiguous()
    if site.kind == "shaped":
        target = args[0]
        whole = torch.empty(site.shape, dtype=target.dtype, device=target.device)
        with seeded_default_generator(device, seed):
            piece = piece_of(op(whole, *args[1:], **kwargs), rng, site)
        if op._schema.is_mutable:  # uniform_, bernoulli_: the draw lands in the op's input
            return target.copy_(piece)
        return piece.contiguous()
    with seeded_default_generator(device, seed):  # "valued": its local draw is the whole draw
        return op(*args, **kwargs)


def exact_refusals(sites) -> list:
    """The sites exact mode cannot replay, each as 'node (op): why'."""
    return [f"{site.node} ({site.op}): {site.exact}" for site in sites if site.exact]


# --- the one-device reference of exact mode ---------------------------------------------------------

_DRAWS = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
          torch.bernoulli, torch.normal, torch.poisson, torch.multinomial, torch.randperm,
          torch.Tensor.bernoulli, torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
          torch.Tensor.exponential_, torch.Tensor.random_, torch.Tensor.cauchy_, torch.Tensor.log_normal_,
          torch.Tensor.geometric_, torch.Tensor.multinomial}
_TRAINING_DRAWS = {F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.rrelu}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _bound(func, args, kwargs) -> dict:
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


class ExactReference(TorchFunctionMode):
    """The single-device model drawing as ``rng="exact"`` programs do: every random call of the
    eager forward (``F.dropout``, attention dropout, ``torch.rand`` ...) is numbered in call order,
    which is the traced graph's order, and drawn from ``exact_seed(seed, step, index)`` at its full
    (eager) shape.

        reference = ExactReference(seed)
        with reference.forward(step):
            loss = model(**global_batch)

    ``seen`` lists (index, kind, shape) of the last forward's draws: ``check_replay`` compares them
    with a compiled program's sites. Random calls that torch's own Python functions make inside
    another call (``nn.MultiheadAttention``'s dropout) are not seen here; ``check_replay`` then
    reports a different count.
    """

    def __init__(self, seed: int):
        super().__init__()
        self.seed, self.step, self.seen = int(seed), 0, []

    @contextmanager
    def forward(self, step: int):
        """One forward (and its backward) of the model at optimizer step ``step``."""
        self.step, self.seen = step, []
        with self:
            yield self

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            arguments = _bound(func, args, kwargs)
            x, p = arguments["input"], arguments["p"]
            if not arguments["training"] or p == 0:
                return func(*args, **kwargs)
            gen = generator(self._next("dropout", tuple(x.shape)), x.device)
            return apply_keep(x, keep_mask(x.shape, 1.0 - p, gen, x.device), p)
        if func is F.scaled_dot_product_attention:
            arguments = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args)), **kwargs}
            p = arguments["dropout_p"]
            if p == 0:
                return func(*args, **kwargs)
            q, k = arguments["query"], arguments["key"]
            shape = tuple(q.shape[:-1]) + (k.shape[-2],)
            gen = generator(self._next("attention", shape), q.device)
            return attention_math(q, k, arguments["value"], arguments["attn_mask"],
                                  keep_mask(shape, 1.0 - p, gen, q.device), p, arguments["is_causal"],
                                  arguments["scale"], arguments["enable_gqa"])
        if kwargs.get("generator") is not None:  # the caller's own generator: not the model's randomness
            return func(*args, **kwargs)
        if func in _DRAWS or (func in _TRAINING_DRAWS and _draws_in_training(func, args, kwargs)):
            index = len(self.seen)
            with seeded_default_generator(_device_of(args, kwargs), exact_seed(self.seed, self.step, index)):
                out = func(*args, **kwargs)
            self.seen.append((index, "draw", tuple(out.shape) if isinstance(out, torch.Tensor) else ()))
            return out
        return func(*args, **kwargs)

    def _next(self, kind: str, shape: tuple) -> int:
        index = len(self.seen)
        self.seen.append((index, kind, shape))
        return exact_seed(self.seed, self.step, index)


def _draws_in_training(func, args, kwargs) -> bool:
    arguments = _bound(func, args, kwargs)
    return bool(arguments.get("training", True)) and arguments.get("p", 1) != 0


def check_replay(seen: list, sites) -> None:
    """Raise unless the eager draws ``seen`` (``ExactReference.seen``) are the compiled ``sites``:
    the same count, and each index of the same kind and full shape."""
    sites = sorted({site.index: site for site in sites}.values(), key=lambda site: site.index)
    want = [(site.index, site.kind if site.kind in ("dropout", "attention") else "draw", tuple(site.shape))
            for site in sites]
    if list(seen) != want:
        mismatch = next((f"#{i}: eager {a}, compiled {b}" for i, (a, b) in enumerate(zip(seen, want)) if a != b),
                        f"eager made {len(seen)} draws, the compiled program {len(want)}")
        raise XirangError(f"the eager reference did not draw as the compiled program does ({mismatch})",
                          where="ExactReference", hint="a random call torch makes inside another call is not "
                          "seen by the eager reference; compare with the model compiled at world 1 instead")
