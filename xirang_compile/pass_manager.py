"""Runs a declared pass list: checks the order up front, then runs each pass inside instruments that
check what it provides, lint the graph, time it and (optionally) dump it.

Checks are instruments around passes, not code inside them (TVM's pass infrastructure), so a new
pass gets all of them by being declared.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from xirang.ir.errors import PassFailure, PassOrderError, XirangError
from xirang.ir.meta_keys import KEYS_BY_NAME, MetaKey
from xirang.ir.pass_spec import Pass


@dataclass
class PassTiming:
    name: str
    seconds: float


@dataclass
class PassRun:
    """What running a pass list produced: the graph and how long each pass took."""

    gm: object
    timings: list[PassTiming] = field(default_factory=list)

    def timing_table(self) -> str:
        width = max((len(t.name) for t in self.timings), default=4)
        rows = [f"{t.name:<{width}}  {t.seconds * 1000:9.1f} ms" for t in self.timings]
        total = sum(t.seconds for t in self.timings)
        return "\n".join(rows + [f"{'total':<{width}}  {total * 1000:9.1f} ms"])


class PassManager:
    """A validated, ordered list of passes.

    Construction fails with PassOrderError if any pass requires a meta key that no earlier pass (nor
    ``available``, the keys present before the first pass) provides.
    """

    def __init__(self, passes: list[Pass], *, available: tuple[MetaKey, ...] = (),
                 lint: bool = True, dump_dir: str | Path | None = None):
        self.passes = list(passes)
        self.lint = lint
        self.dump_dir = Path(dump_dir) if dump_dir else None
        check_pass_order(self.passes, available)

    def run(self, gm, ctx) -> PassRun:
        result = PassRun(gm=gm)
        for position, compiler_pass in enumerate(self.passes):
            done = [p.name for p in self.passes[:position]]
            start = time.perf_counter()
            try:
                result.gm = compiler_pass(result.gm, ctx)
            except XirangError:
                raise  # already says what, where and what to do
            except Exception as exc:
                raise PassFailure(f"pass '{compiler_pass.name}' failed: {type(exc).__name__}: {exc}",
                                  where=_ran_text(done),
                                  hint="this is a bug in Xirang or an op it does not know; run with "
                                       "dump_dir=... to see the graph each pass produced") from exc
            result.timings.append(PassTiming(compiler_pass.name, time.perf_counter() - start))
            if result.gm is None:
                raise PassFailure(f"pass '{compiler_pass.name}' returned no graph", where=_ran_text(done),
                                  hint="a pass must return the GraphModule it was given or a new one")
            check_provided(result.gm, compiler_pass, done)
            if self.lint:
                lint_graph(result.gm, compiler_pass, done)
            if self.dump_dir is not None:
                dump_graph(result.gm, self.dump_dir / f"{position:02d}_{compiler_pass.name}.txt")
        return result


def check_pass_order(passes: list[Pass], available: tuple[MetaKey, ...] = ()) -> None:
    provider = {key.name: "<before the first pass>" for key in available}
    for compiler_pass in passes:
        for key in compiler_pass.requires:
            if key.name in provider:
                continue
            later = next((p.name for p in passes if key in p.provides and p is not compiler_pass), None)
            if later:
                raise PassOrderError(
                    f"pass '{compiler_pass.name}' requires meta key '{key.name}', which pass '{later}' "
                    f"provides, but '{later}' runs after '{compiler_pass.name}'",
                    where="the pass list given to PassManager",
                    hint=f"move '{later}' before '{compiler_pass.name}'")
            raise PassOrderError(
                f"pass '{compiler_pass.name}' requires meta key '{key.name}', which no pass in the list "
                "provides", where="the pass list given to PassManager",
                hint=f"add the pass that provides '{key.name}' before '{compiler_pass.name}'")
        for key in compiler_pass.provides:
            provider.setdefault(key.name, compiler_pass.name)


def check_provided(gm, compiler_pass: Pass, done: list[str]) -> None:
    """Every graph key a pass provides is set; every node key is set on at least one node."""
    for key in compiler_pass.provides:
        if key.sparse:
            continue
        present = key.has(gm) if key.scope == "graph" else any(key.has(n) for n in gm.graph.nodes)
        if not present:
            raise PassFailure(f"pass '{compiler_pass.name}' declares it provides '{key.name}' but set it "
                              "nowhere", where=_ran_text(done + [compiler_pass.name]),
                              hint="set the key in the pass or remove it from provides=")


def lint_graph(gm, compiler_pass: Pass, done: list[str]) -> None:
    """torch.fx's structural lint, plus: every Xirang meta key is declared and holds its type."""
    try:
        gm.graph.lint()
    except Exception as exc:
        raise PassFailure(f"pass '{compiler_pass.name}' left a malformed graph: {exc}",
                          where=_ran_text(done + [compiler_pass.name])) from exc
    tables = [("graph", gm.meta)] + [(f"node '{n.name}'", n.meta) for n in gm.graph.nodes]
    for owner, table in tables:
        for name, value in table.items():
            if not name.startswith("xr_"):
                continue
            key = KEYS_BY_NAME.get(name)
            if key is None:
                raise PassFailure(f"{owner} carries undeclared meta key '{name}'",
                                  where=_ran_text(done + [compiler_pass.name]),
                                  hint="declare the key in xirang/ir/meta_keys.py")
            if value is not None and not key.check(value):
                raise PassFailure(f"{owner}: meta key '{name}' holds {type(value).__name__}, declared "
                                  f"{key.value_type}", where=_ran_text(done + [compiler_pass.name]))


def dump_graph(gm, path: Path) -> None:
    """Write the graph as code plus each node's Xirang facts, for reading diffs between passes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [gm.code, "", "# node facts"]
    for node in gm.graph.nodes:
        facts = {k: v for k, v in node.meta.items() if k.startswith("xr_")}
        lines.append(f"{node.name}: {facts}")
    path.write_text("\n".join(lines))


def _ran_text(done: list[str]) -> str:
    return "passes already run: " + (", ".join(done) if done else "none")
