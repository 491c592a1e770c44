"""Meta kernels' answers remembered: a GPU program's dry run repeats the same ops on the same shapes.

A GPU plan's step runs on plain meta tensors (rank_step.py). Many aten ops' meta kernels are Python
(torch._refs and torch._prims: broadcasting, type promotion, stride propagation), a millisecond or so
each, and one class's step runs each layer's ops once per micro-batch and layer: the same op on the same
shapes tens of thousands of times.

Formulation. A meta tensor has no data, so what a meta kernel returns is a function of the op and of its
arguments' metadata alone. For an ``aten`` op that mutates no argument, returns no alias of one (its schema
has no alias annotation), draws no random numbers (not tagged ``nondeterministic_seeded``) and has outputs
whose shapes do not depend on data (not tagged ``dynamic_output_shape`` or ``data_dependent_output``), and
all of whose returns are tensors, the outputs (None where an output mask asks for none) are new storages
whose (dtype, shape, stride, storage offset, storage bytes, which outputs share a storage) are that
function of
    key = (op, for each argument: (dtype, shape, stride, storage offset, device) of a tensor, the value of
           anything else, lists and tuples element by element).
``MetaCache.run`` computes the outputs with the kernel the first time a key is met and remembers that
metadata; later it makes fresh meta tensors with exactly it. An argument of another kind (a generator, a
process group, a symbolic size) makes the call uncacheable: it runs the kernel. The recorder sees the
same new storages of the same sizes as the kernel would make, so memory and every call are unchanged.
The kernel's first answer for a key is checked to be new storages; one sharing an argument's storage (an
alias the schema does not declare, as ``_unsafe_view``'s) makes the key uncacheable: it always runs.
"""
from __future__ import annotations

import torch

_EXCLUDED_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape,
                  torch.Tag.data_dependent_output)
_PLAIN = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format))
_UNCACHEABLE = object()
_Tensor, _strided = torch.Tensor, torch.strided


def cacheable(func) -> bool:
    """Whether ``func``'s meta outputs are a function of its arguments' metadata (module docstring)."""
    schema = func._schema
    return (func.namespace == "aten" and not schema.is_mutable and bool(schema.returns)
            and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)
            and all(a.alias_info is None for a in schema.arguments)
            and not any(tag in func.tags for tag in _EXCLUDED_TAGS))


def _key(value):
    """The part of the key one argument gives, or _UNCACHEABLE. Run on every argument of every op of a step
    (hundreds of thousands): a tensor's shape is kept as its ``torch.Size`` (a tuple, hashed as one) and a
    sequence's items are keyed by ``map``, with no generator frame per item."""
    if isinstance(value, _Tensor):
        if not value.is_meta or value.layout is not _strided:
            return _UNCACHEABLE
        return (value.dtype, value.shape, value.stride(), value.storage_offset())
    kind = type(value)
    if kind is tuple or kind is list:
        items = tuple(map(_key, value))
        return _UNCACHEABLE if _UNCACHEABLE in items else (kind, items)
    if kind in _PLAIN:
        return (kind, value)
    return _UNCACHEABLE


class MetaCache:
    """Remembered meta outputs per key (module docstring). Ops are keyed by ``id``: an ``OpOverload`` hashes in
    Python, a microsecond on every lookup; each op is held in ``_ops``, so its id is not reused."""

    def __init__(self):
        self._ops: dict = {}  # id(op) -> (op, cacheable(op), whether it returns a tuple)
        self._outputs: dict = {}  # key -> a remembered answer (``_describe``)
        self.hits = self.misses = 0

    def run(self, func, args, kwargs):
        known = self._ops.get(id(func))
        if known is None:
            known = self._ops[id(func)] = (func, cacheable(func), len(func._schema.returns) > 1)
        if not known[1]:
            return func(*args, **kwargs)
        arguments = _key(args)
        options = _key(tuple(sorted(kwargs.items()))) if kwargs else ()
        if arguments is _UNCACHEABLE or options is _UNCACHEABLE:
            return func(*args, **kwargs)
        key = (id(func), arguments, options)
        found = self._outputs.get(key)
        if found is None:
            out = func(*args, **kwargs)
            self._outputs[key] = _describe(out, args, kwargs)
            self.misses += 1
            return out
        if found is _UNCACHEABLE:
            return func(*args, **kwargs)
        self.hits += 1
        return _make(found, known[2])


def _describe(out, args, kwargs):
    """How to make the outputs again: ``(per output: None, or (dtype, shape, stride) of an output that is a
    whole storage of its own as ``empty_strided`` makes it), None)`` where every output is so (the common case:
    one call per output), else ``(per output: storage slot, dtype, shape, stride, offset), (bytes per slot)``;
    _UNCACHEABLE where an output is not a meta tensor or shares an argument's storage (``_unsafe_view`` aliases
    its input without saying so in its schema): the kernel, a function of the key, does so for every call with
    this key."""
    outputs = out if isinstance(out, tuple) else (out,)
    # an output may be None where an output mask asks for none (native_layer_norm_backward under a split backward)
    if not all(t is None or isinstance(t, torch.Tensor) and t.device.type == "meta" for t in outputs) \
            or outputs[0] is None and len(outputs) == 1:
        return _UNCACHEABLE
    inputs = {id(t.untyped_storage()) for t in _tensors((args, tuple(kwargs.values())))}
    if any(t is not None and id(t.untyped_storage()) in inputs for t in outputs):
        return _UNCACHEABLE
    slots: dict = {}
    described = []
    for tensor in outputs:
        if tensor is None:
            described.append(None)
            continue
        storage = tensor.untyped_storage()
        slot = slots.setdefault(id(storage), (len(slots), storage.nbytes()))[0]
        described.append((slot, tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset()))
    slot_bytes = tuple(nbytes for _, nbytes in sorted(slots.values()))
    if len(slots) == sum(output is not None for output in described) and all(
            output is None or output[4] == 0 and _strided_bytes(output) == slot_bytes[output[0]]
            for output in described):
        return tuple(None if output is None else output[1:4] for output in described), None
    return tuple(described), slot_bytes


def _strided_bytes(output) -> int:
    """The storage ``empty_strided`` makes for an output's (dtype, shape, stride), in bytes."""
    _, dtype, shape, stride, _ = output
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta").untyped_storage().nbytes()


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _make(found, tuple_out: bool):
    """Fresh meta tensors with exactly the remembered metadata, each storage a new one (``_describe``)."""
    described, slot_bytes = found
    if slot_bytes is None:  # each output a whole storage of its own
        made = tuple(None if output is None else
                     torch.empty_strided(output[1], output[2], dtype=output[0], device="meta")
                     for output in described)
        return made if tuple_out else made[0]
    storages = [torch.empty((nbytes,), dtype=torch.uint8, device="meta").untyped_storage() for nbytes in slot_bytes]
    made = tuple(None if output is None else
                 torch.empty((0,), dtype=output[1], device="meta").set_(storages[output[0]], output[4], output[2],
                                                                         output[3])
                 for output in described)
    return made if tuple_out else made[0]
