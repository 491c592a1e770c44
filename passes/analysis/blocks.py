"""Find repeated blocks (the layers of a transformer) and group identical ones into kinds.

A block is a module that is an indexed child of a container (``model.layers.17``), the outermost
such module on a node's module stack. Its kind is a hash of its ops in order: the op, the module path
relative to the block, the output shapes and dtypes, and how each input is wired (inside the block by
position, a parameter by relative name and shape, a constant, or from outside). Eighty identical
decoder layers are one kind with eighty instances, and the planner solves one of them. Shapes are
printed once per ``TensorInfo`` object (stamped layers share their template's).
"""
from __future__ import annotations

import hashlib

import torch

from xirang.ir.facts import BlockInfo
from xirang.ir.meta_keys import (BLOCK, BLOCK_KINDS, NN_MODULE_STACK, PARAM_NAME, ROLE, TENSOR)
from xirang.ir.pass_spec import compiler_pass


@compiler_pass(requires=(NN_MODULE_STACK, ROLE, PARAM_NAME, TENSOR), provides=(BLOCK, BLOCK_KINDS))
def find_blocks(gm, ctx):
    """Tag each node with its repeated block and the block's structural kind."""
    members: dict[str, list[torch.fx.Node]] = {}
    path_of = {node: _block_path(node) for node in gm.graph.nodes}
    for node, path in path_of.items():
        if path is not None:
            members.setdefault(path, []).append(node)
    shapes: dict = {}
    kind_of = {path: _structural_hash(path, nodes, shapes) for path, nodes in members.items()}
    order = {path: index for index, path in enumerate(members)}  # first appearance = execution order
    kinds: dict[str, list[str]] = {}
    for path, kind in kind_of.items():
        kinds.setdefault(kind, []).append(path)
    for node, path in path_of.items():
        BLOCK.set(node, BlockInfo(path=path, index=order[path], kind=kind_of[path]) if path is not None
                  else None)
    BLOCK_KINDS.set(gm, kinds)
    return gm


def _block_path(node) -> str | None:
    if node.op == "placeholder":
        name = PARAM_NAME.get(node, None)
        return _outermost_indexed(name.rsplit(".", 1)[0]) if name and "." in name else None
    for fqn, _cls in (NN_MODULE_STACK.get(node, None) or {}).values():
        if isinstance(fqn, str):
            found = _outermost_indexed(fqn)
            if found is not None:
                return found
    return None


def _outermost_indexed(fqn: str) -> str | None:
    """'model.layers.3.mlp' -> 'model.layers.3'; a path with no numeric part -> None."""
    parts = fqn.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            return ".".join(parts[: i + 1])
    return None


def _structural_hash(path: str, nodes: list[torch.fx.Node], shapes: dict) -> str:
    position = {n: i for i, n in enumerate(nodes)}
    digest = hashlib.sha256()
    for node in nodes:
        if node.op == "placeholder":
            entry = ("param", _relative(PARAM_NAME.get(node), path), _shape_text(node, shapes))
        else:
            entry = (node.op, str(node.target), _relative_stack(node, path), _shape_text(node, shapes),
                     _wiring((node.args, node.kwargs), position, path, shapes))
        digest.update(repr(entry).encode())
    return digest.hexdigest()[:12]


def _relative(name: str, path: str) -> str:
    return name[len(path):] if name.startswith(path) else name


def _relative_stack(node, path: str) -> tuple:
    return tuple((_relative(fqn, path), str(cls).rsplit(".", 1)[-1])
                 for fqn, cls in (NN_MODULE_STACK.get(node, None) or {}).values()
                 if isinstance(fqn, str) and fqn.startswith(path))


def _shape_text(node, shapes: dict) -> str:
    """repr of the node's TensorInfo, printed once per object (``shapes``: id -> (object, text))."""
    info = TENSOR.get(node, None)
    if id(info) not in shapes:
        shapes[id(info)] = (info, repr(info))  # the object is kept so its id is not reused
    return shapes[id(info)][1]


def _wiring(args, position: dict, path: str, shapes: dict):
    def describe(arg):
        if isinstance(arg, torch.fx.Node):
            if arg in position:
                return ("in", position[arg])
            if arg.op == "placeholder" and PARAM_NAME.get(arg, None):
                return ("param", _relative(PARAM_NAME.get(arg), path))
            return ("outside", _shape_text(arg, shapes))
        if isinstance(arg, (list, tuple)):
            return tuple(describe(a) for a in arg)
        if isinstance(arg, dict):
            return tuple((k, describe(v)) for k, v in arg.items())
        return repr(arg)
    return describe(args)
