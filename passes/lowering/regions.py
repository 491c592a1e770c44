"""Outlining the activation regions of one stage (``split_stages``): each region the lowering marked
(``OFFLOAD``: a block whose saved activations go to host memory; ``RECOMPUTE``: a region run again
in the backward) becomes a sub-GraphModule, called from the stage through a small module of
codegen/ops/activations.py:

    recompute_0 = self.recompute_0(layer_norm, p_w, tp_group, comm_counter)
    add_3 = recompute_0[0]

Offload regions are the outer level, recompute regions nest inside them (a selective core inside its
block; under full recompute the block's one recompute region inside its offload region, so what
the checkpoint keeps, the block's inputs, is what goes to host memory).

A region's inputs are the values it reads from outside (tensors, the tp group and counter; sizes
are folded ints already), in graph order; its outputs the values read outside it, in graph order.
Regions are convex (passes/lowering/recompute.py), so contracting each to one call keeps the graph
acyclic; the calls and the nodes outside any region are emitted in a stable topological order that
is the graph order whenever that is already valid. Names are deterministic: ``<kind>_<k>`` per
stage in order of first node, each output keeps its node's name, so the code is byte-identical
across runs. A stage with no marked node is built exactly as before.
"""
from __future__ import annotations

import heapq
import operator

import torch
from torch import fx

from xirang.ir.errors import XirangError
from xirang.ir.meta_keys import OFFLOAD, RECOMPUTE

from xirang.codegen.ops.activations import OffloadedBlock, Recomputed

KINDS = (("offload", OFFLOAD), ("recompute", RECOMPUTE))  # outer level first
WRAPPERS = {"offload": OffloadedBlock, "recompute": Recomputed}
DESCRIPTIONS = {"offload": "saved activations to host memory after the forward, prefetched back before the "
                           "backward (codegen/runtime/memory/offload.py)",
                "recompute": "keeps its inputs only, recomputed in the backward "
                             "(torch.utils.checkpoint, use_reentrant=False)"}


def region_path(node: fx.Node) -> tuple[tuple[str, str], ...]:
    """(kind, region) of each region holding ``node``, outer first."""
    return tuple((kind, key.get(node)) for kind, key in KINDS if key.get(node, None) is not None)


def has_regions(nodes) -> bool:
    return any(region_path(node) for node in nodes)


def copy_with_regions(graph: fx.Graph, nodes: list, env: dict, modules: dict) -> None:
    """Copy ``nodes`` (graph order, one stage) into ``graph``, each marked region outlined into a
    call of a module added to ``modules`` (name -> module: the stage's root must hold them)."""
    outer: dict = {}
    for node in nodes:
        path = region_path(node)
        for depth, key in enumerate(path):
            if outer.setdefault(key, path[:depth]) != path[:depth]:
                raise XirangError(f"the {key[0]} region {key[1]} is not nested in one outer region: node "
                                  f"{node.name} lies in {[k[1] for k in path[:depth]] or 'none'}",
                                  where=f"node {node.name} ({node.target})",
                                  hint="report this model (recompute regions must nest inside offloaded blocks)")
    _copy(graph, nodes, env, modules, depth=0, counter={})


def region_source(module: torch.nn.Module) -> str:
    """The code of every region module under ``module`` (nested ones after their parent), headed by
    what it does; empty for a stage without regions."""
    parts = []
    for name, child in module.named_children():
        kind = next((k for k, wrapper in WRAPPERS.items() if isinstance(child, wrapper)), None)
        if kind is None:
            continue
        label = getattr(child, "block", None) or getattr(child, "region", "")
        parts.append(f"# {name} ({label}): {DESCRIPTIONS[kind]}\n{child.inner.code.strip()}\n\n")
        parts.append(region_source(child.inner))
    return "".join(parts)


def _copy(graph, nodes, env, modules, *, depth: int, counter: dict) -> None:
    items: dict = {}  # item key -> its nodes; a key is a node (outside every region here) or (kind, region)
    item_of: dict = {}
    for node in nodes:
        path = region_path(node)
        key = path[depth] if len(path) > depth else node
        items.setdefault(key, []).append(node)
        item_of[node] = key
    for key in _stable_order(items, item_of):
        if isinstance(key, fx.Node):
            env[key] = graph.node_copy(key, lambda arg: env[arg])
        else:
            _outline(graph, key, items[key], env, modules, depth=depth, counter=counter)


def _stable_order(items: dict, item_of: dict) -> list:
    """Items in a topological order that prefers each item's first node's position."""
    keys = list(items)
    position = {key: index for index, key in enumerate(keys)}  # by first node: dicts keep insertion order
    needs = {key: set() for key in keys}
    for key, members in items.items():
        for node in members:
            for arg in node.all_input_nodes:
                source = item_of.get(arg)
                if source is not None and source != key:
                    needs[key].add(source)
    waiting = {key: len(found) for key, found in needs.items()}
    readers: dict = {key: [] for key in keys}
    for key, found in needs.items():
        for source in found:
            readers[source].append(key)
    ready = [position[key] for key in keys if waiting[key] == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        key = keys[heapq.heappop(ready)]
        ordered.append(key)
        for reader in readers[key]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, position[reader])
    if len(ordered) != len(keys):
        stuck = sorted(str(key[1]) for key in keys if key not in ordered and not isinstance(key, fx.Node))
        raise XirangError(f"the regions {stuck} are not convex: a path leaves one and comes back",
                          where="split_stages", hint="report this model (recompute/offload regions must be convex)")
    return ordered


def _outline(graph, key, members: list, env: dict, modules: dict, *, depth: int, counter: dict) -> None:
    kind, region = key
    inside = set(members)
    inputs = list(dict.fromkeys(arg for node in members for arg in node.all_input_nodes
                                if arg not in inside and isinstance(env[arg], fx.Node)))
    outputs = [node for node in members if any(user not in inside for user in node.users)]
    sub = fx.Graph()
    sub_env = {node: value for node, value in env.items() if not isinstance(value, fx.Node)}  # folded sizes
    for node in inputs:
        placeholder = sub.placeholder(node.name)
        placeholder.meta = dict(node.meta)
        sub_env[node] = placeholder
    sub_modules: dict = {}
    _copy(sub, members, sub_env, sub_modules, depth=depth + 1, counter=counter)
    sub.output(tuple(sub_env[node] for node in outputs))
    sub.lint()
    root = torch.nn.Module()
    for name, module in sub_modules.items():
        root.add_module(name, module)
    inner = fx.GraphModule(root, sub, class_name="Region")
    name = f"{kind}_{counter.get(kind, 0)}"
    counter[kind] = counter.get(kind, 0) + 1
    modules[name] = WRAPPERS[kind](inner, region)
    call = graph.call_module(name, tuple(env[node] for node in inputs))
    for index, node in enumerate(outputs):
        got = graph.create_node("call_function", operator.getitem, (call, index), name=node.name)
        got.meta = dict(node.meta)
        env[node] = got
