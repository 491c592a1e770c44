"""Count parameter elements per placeholder and per module (tied weights once, under their first name)."""
from __future__ import annotations

from xirang.ir.meta_keys import MODULE_PARAMS, PARAM_COUNT, PARAM_NAME, ROLE, TENSOR
from xirang.ir.facts import TensorInfo
from xirang.ir.pass_spec import compiler_pass


@compiler_pass(requires=(ROLE, PARAM_NAME, TENSOR), provides=(PARAM_COUNT, MODULE_PARAMS))
def count_parameters(gm, ctx):
    """Set each parameter placeholder's element count and sum them for every enclosing module."""
    per_module: dict[str, int] = {"": 0}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or ROLE.get(node) != "parameter":
            continue
        info = TENSOR.get(node)
        assert isinstance(info, TensorInfo) and info.numel.is_Integer, f"{node.name}: parameter size must be static"
        count = int(info.numel)
        PARAM_COUNT.set(node, count)
        # A tied tensor is one placeholder (see trace_model); it is counted under its first name only.
        for prefix in _module_prefixes(PARAM_NAME.get(node)):
            per_module[prefix] = per_module.get(prefix, 0) + count
    MODULE_PARAMS.set(gm, per_module)
    return gm


def _module_prefixes(param_name: str) -> list[str]:
    """'a.b.weight' -> ['', 'a', 'a.b']: every module the parameter lives under."""
    parts = param_name.split(".")[:-1]
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]
