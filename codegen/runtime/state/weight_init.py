"""Initial weights tensor by tensor, each from its own stream: a model built on ``meta`` is never whole.

    with torch.device("meta"):
        model = GPT(config)                                   # no memory
    compiled = xirang.compile(model, world=8, ..., seed=0)    # each rank makes only its shards
    # the same numbers, on one device:
    model = GPT(config); xirang.init_weights(model, seed=0)

``TensorInit(model, seed).value(fqn)`` is one tensor's initial value, made alone: its owning module's
own tensors (``recurse=False``) are swapped for fresh empty CPU tensors, every other tensor of the model
stays meta (a real model is given meta twins for the while), and the model's own initialisation runs
on the module and its ancestors, innermost first, with torch's CPU generator seeded from
``stream_seed(seed, fqn)``:

1. each one's ``reset_parameters()`` (or ``_reset_parameters()``): torch's defaults, as its
   constructor ran them;
2. then, for each one, ``_init_weights(module)`` of its nearest ancestor-or-self that has one (what
   GPT-2 style models and every Hugging Face ``PreTrainedModel`` apply after construction, composite
   models included), or ``init(module)`` when an ``init`` function is given.

On meta tensors those calls draw nothing (meta kernels run no generator), so a value depends only on
(seed, FQN, the shapes): the same in any order, on any rank, whatever else exists, on one device or
cut into shards (``bind_state`` takes this rank's tp shard of each value and drops the full tensor;
the peak is one module's tensors). A tied tensor has one stream, under its first name in
``named_parameters(remove_duplicate=False)`` order. Values are always drawn on the CPU (one device's
numbers, whatever the runtime device), the caller's generator state is kept.

Honest about what cannot be had: a tensor the initialisation does not wholly write (a parameter made
by ``torch.randn`` in ``__init__``; a buffer computed in ``__init__``, such as a rotary table, where no
``_init_weights`` recomputes it) keeps its model value when the model has one (a real tensor), and a
meta one is refused naming it and the fix. Written-ness is checked, not assumed: a float tensor is
filled with NaN before and must hold none after; another dtype is initialised twice, from 0 and from
1, and must come out the same.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Optional

import torch

from xirang.ir.errors import XirangError

INIT_DEVICE = torch.device("cpu")  # where values are drawn: one device's numbers on any runtime device


def stream_seed(seed: int, fqn: str) -> int:
    """The seed of tensor ``fqn``'s stream: a stable 63-bit hash of (seed, fqn) (blake2b, the same in
    every process; Python's ``hash()`` is salted per process)."""
    digest = hashlib.blake2b(f"{int(seed)}\x00{fqn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def has_meta_tensors(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (its values must be made)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


class TensorInit:
    """Initial values of ``model``'s tensors, one at a time (module docstring). ``init``: a function
    ``init(module)`` run on the owning module and each ancestor instead of the ``_init_weights`` found
    on the model; ``reset_parameters()`` runs either way."""

    def __init__(self, model: torch.nn.Module, seed: int, init: Optional[Callable] = None):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise XirangError(f"the initialisation seed must be an int, got {seed!r}", where="xirang.init_weights",
                              hint="pass seed=<int>, the same as xirang.compile(seed=...)")
        self.model, self.seed, self.init = model, seed, init
        self._twinned = False  # inside twinned(): the model's real tensors are meta already
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.canonical, self.tensors = {}, {}  # FQN -> the tensor's first name; first name -> tensor
        first_of = {}
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        for fqn, tensor in named:
            first = first_of.setdefault(id(tensor), fqn)
            self.canonical[fqn] = first
            self.tensors.setdefault(first, tensor)

    def names(self) -> list:
        """Every tensor's first name, parameters first, in the model's order."""
        return list(self.tensors)

    def value(self, fqn: str) -> torch.Tensor:
        """Tensor ``fqn``'s initial value (a CPU tensor of its shape and dtype): the model's
        initialisation on its own stream, or, where that does not write it wholly, the model's value
        when the model holds a real one (a buffer computed in ``__init__``); else refused."""
        if fqn not in self.canonical:
            raise XirangError(f"the model has no parameter or buffer {fqn!r}", where="xirang.init_weights",
                              hint="name a tensor of model.named_parameters() or model.named_buffers()")
        name = self.canonical[fqn]
        held = self.tensors[name]
        with self.twinned():
            made = self._drawn(name, held)
        if made is not None:
            return made
        if not held.is_meta:
            return held.detach().to(INIT_DEVICE, copy=True)
        kind = "parameter" if isinstance(held, torch.nn.Parameter) else "buffer"
        raise XirangError(
            f"the model was built on meta and its {kind} {name!r} {tuple(held.shape)} is not wholly written by "
            f"its initialisation ({self._describe(name)}): its value was made in __init__, which ran on meta",
            where=f"xirang initial weights, {name}",
            hint="build the model under xirang.parameters_on_meta() instead of torch.device('meta') (parameters "
                 "on meta, buffers real), or give its module a reset_parameters() (or the model an "
                 "_init_weights(module)) that writes it")

    @contextlib.contextmanager
    def twinned(self):
        """The model's real tensors swapped for meta twins while the block runs (``_meta_twins``), so every
        value is drawn as on the meta model; ``value`` enters it itself, a loop over many may enter it once."""
        if self._twinned:
            yield
            return
        with _meta_twins(self.model):
            self._twinned = True
            try:
                yield
            finally:
                self._twinned = False

    def _describe(self, name: str) -> str:
        chain = self._chain(name)
        resets = [type(m).__name__ for m in chain if _reset_of(m) is not None]
        found = "init=" if self.init is not None else (
            f"{type(self._init_owner(chain, 0)).__name__}._init_weights" if self._init_owner(chain, 0) else "none")
        return f"reset_parameters of {resets or 'no module'}, per-module init {found}"

    def _chain(self, name: str) -> list:
        """The owning module, then each ancestor up to the model."""
        path = name.rsplit(".", 1)[0] if "." in name else ""
        parts = path.split(".") if path else []
        return [self.modules[".".join(parts[:i])] for i in range(len(parts), -1, -1)]

    def _init_owner(self, chain: list, index: int):
        """The nearest module at or above ``chain[index]`` with an ``_init_weights``."""
        return next((m for m in chain[index:] if callable(getattr(m, "_init_weights", None))), None)

    def _drawn(self, name: str, held: torch.Tensor) -> Optional[torch.Tensor]:
        fills = (float("nan"),) if held.is_floating_point() or held.is_complex() else (0, 1)
        made = [self._run(name, held, fill) for fill in fills]
        if len(made) == 1:
            return None if made[0].isnan().any() else made[0]
        return made[0] if torch.equal(made[0], made[1]) else None

    def _run(self, name: str, held: torch.Tensor, fill) -> torch.Tensor:
        chain = self._chain(name)
        attr = name.rsplit(".", 1)[-1]
        owner = chain[0]
        with torch.random.fork_rng(devices=[]), torch.no_grad(), _fresh_tensors(owner, fill):
            torch.default_generator.manual_seed(stream_seed(self.seed, name))
            try:
                for module in chain:
                    reset = _reset_of(module)
                    if reset is not None:
                        reset()
                for index, module in enumerate(chain):
                    if self.init is not None:
                        self.init(module)
                    elif (init_owner := self._init_owner(chain, index)) is not None:
                        init_owner._init_weights(module)
            except XirangError:
                raise
            except Exception as error:  # noqa: BLE001 - the user's init code: say which tensor it failed on
                raise XirangError(f"initialising {name!r} alone failed in its module's initialisation: "
                                  f"{type(error).__name__}: {error}", where=f"xirang initial weights, {name}",
                                  hint="an init function must work on one module at a time, the others on meta "
                                       "(no .item() of another module's tensor); pass init= to replace it") from error
            found = owner._parameters.get(attr) if attr in owner._parameters else owner._buffers.get(attr)
            if found is None or tuple(found.shape) != tuple(held.shape) or found.is_meta:
                raise XirangError(f"{name!r} is not a {tuple(held.shape)} tensor of its module after its "
                                  f"initialisation", where=f"xirang initial weights, {name}",
                                  hint="an init function should write the module's tensors in place")
            return found.detach().to(INIT_DEVICE, held.dtype)


def _reset_of(module):
    for attr in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, attr, None)
        if callable(reset):
            return reset
    return None


@contextlib.contextmanager
def _fresh_tensors(module: torch.nn.Module, fill):
    """``module``'s own parameters and buffers swapped for new CPU tensors filled with ``fill``; the
    originals are put back after (so a meta model stays meta, and ties stay one object)."""
    params, buffers = dict(module._parameters), dict(module._buffers)
    try:
        for name, param in params.items():
            if param is not None:
                fresh = torch.full(param.shape, fill, dtype=param.dtype, device=INIT_DEVICE)
                module._parameters[name] = torch.nn.Parameter(fresh, requires_grad=param.requires_grad)
        for name, buffer in buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.full(buffer.shape, fill, dtype=buffer.dtype, device=INIT_DEVICE)
        yield
    finally:
        module._parameters.clear()
        module._parameters.update(params)
        module._buffers.clear()
        module._buffers.update(buffers)


@contextlib.contextmanager
def _meta_twins(model: torch.nn.Module):
    """Every real parameter and buffer of ``model`` swapped for a meta tensor of its shape (one per
    tensor, so ties stay ties) while the block runs, so an initialisation of a real model draws exactly
    as on the meta model; the originals are put back after."""
    saved, twins = [], {}
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in list(table.items()):
                    if tensor is None or tensor.is_meta:
                        continue
                    if id(tensor) not in twins:
                        meta = torch.empty_like(tensor, device="meta")
                        twins[id(tensor)] = (torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
                                             if isinstance(tensor, torch.nn.Parameter) else meta)
                    saved.append((table, name, tensor))
                    table[name] = twins[id(tensor)]
        yield
    finally:
        for table, name, tensor in saved:
            table[name] = tensor


@contextlib.contextmanager
def parameters_on_meta():
    """Build a model inside: each parameter goes to the meta device as it is registered (made real for a
    moment, one at a time), buffers stay real, so values computed in ``__init__`` (rotary tables, causal
    masks) survive while the model costs no parameter memory."""
    register = torch.nn.Module.register_parameter

    def to_meta(module, name, param):
        if param is not None and not param.is_meta:  # a meta one is already moved (or tied: keep it one object)
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def init_weights(model: torch.nn.Module, seed: int, *, init: Optional[Callable] = None) -> torch.nn.Module:
    """Initialise ``model`` in place, every parameter (and every buffer its initialisation writes) from
    its own stream: the numbers a from-scratch ``xirang.compile`` of the same model built on meta, with
    the same ``seed``, gives its shards (module docstring). A meta model gets real CPU tensors. Returns
    ``model``."""
    values = TensorInit(model, seed, init)
    made = {}  # id of a meta tensor -> its new real one (one object per tensor: ties stay ties)
    with values.twinned(), torch.no_grad():
        for name in values.names():
            held, value = values.tensors[name], values.value(name)
            if not held.is_meta:
                held.copy_(value)  # one tensor at a time: the peak is the model and one value
            elif isinstance(held, torch.nn.Parameter):
                made[id(held)] = torch.nn.Parameter(value, requires_grad=held.requires_grad)
            else:
                made[id(held)] = value
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is not None and id(tensor) in made:
                    table[name] = made[id(tensor)]
    return model
