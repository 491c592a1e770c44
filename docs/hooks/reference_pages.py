"""MkDocs hook: pages generated from the code, so they cannot drift from it.

A page holds a marker line that ``on_page_markdown`` replaces while the site is built:

- ``<!-- generated: cli -->``: every ``xirang`` subcommand, walked from the argparse parser
  ``xirang.cli.build_parser()`` builds (usage, description, each argument with its default and help);
- ``<!-- generated: families -->``: the Hugging Face families of ``examples/hf_families.py`` (``FAMILIES``);
- ``<!-- generated: moe-families -->``: the Mixture-of-Experts families of ``examples/hf_moe.py``;
- ``<!-- generated: catalog -->``: the model factories of ``examples/catalog.py``.

And ``::: xirang.NAME`` lines (mkdocstrings) become ``::: <folder>.<module>.NAME``, where the object
is defined in the repository (``xirang`` is the import root of several folders, which mkdocstrings'
static loader cannot follow, and importing the package to inspect it would run ``xirang/__main__``).

tests/docs/test_reference_pages.py checks the generated text against the parser and the modules.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
USAGE_WIDTH = 100


def _subcommands(parser: argparse.ArgumentParser):
    """(name, help, parser) of each subcommand of ``parser``, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name) or "", sub


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue  # hidden as in --help: a renamed flag kept only to refuse it (xirang_compile/cli/args.py)
        if action.option_strings:
            value = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
            names = ", ".join(f"`{o}{value}`" for o in action.option_strings)
        else:
            names = f"`{action.metavar or action.dest}`"
        if action.choices and not isinstance(action.choices, dict):
            names += " (" + ", ".join(f"`{c}`" for c in action.choices) + ")"
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == argparse.REMAINDER \
            else f"`{default}`"
        required = "required" if action.required else ""
        rows.append(f"| {names} | {' '.join(x for x in (required, shown) if x)} | {_cell(action.help or '')} |")
    return rows


def _command_section(path: list[str], text: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=USAGE_WIDTH)
    usage = parser.format_usage().strip()
    lines = [f"{'#' * level} xirang {' '.join(path)}", ""]
    if text:
        lines += [_cell(text)[0].upper() + _cell(text)[1:] + ".", ""]
    lines += ["```text", usage, "```", ""]
    rows = _argument_rows(parser)
    if rows:
        lines += ["| argument | required / default | description |", "|---|---|---|", *rows, ""]
    for name, sub_text, sub in _subcommands(parser):
        lines += _command_section([*path, name], sub_text, sub, level + 1)
    return lines


def cli_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The CLI reference: a section per subcommand of ``xirang`` (nested ones beneath)."""
    if parser is None:
        from xirang.cli import build_parser
        parser = build_parser()
    commands = list(_subcommands(parser))
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=USAGE_WIDTH)
    lines = ["```text", parser.format_usage().strip(), "```", ""]
    options = _argument_rows(parser)
    if options:
        lines += ["Options of `xirang` itself, given before the command:", "",
                  "| argument | required / default | description |", "|---|---|---|", *options, ""]
    lines += ["| command | what it does |", "|---|---|"]
    lines += [f"| [`{name}`](#xirang-{name}) | {_cell(text)} |" for name, text, _ in commands]
    lines.append("")
    for name, text, sub in commands:
        lines += _command_section([name], text, sub, 2)
    return "\n".join(lines).rstrip() + "\n"


def _examples_module(name: str):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"examples.{name}")


def families_markdown(module: str = "hf_families") -> str:
    """A row per family of examples/<module>.py: name, what the factory builds, features covered."""
    families = _examples_module(module).FAMILIES
    lines = ["| family | model | features covered | try it |", "|---|---|---|---|"]
    for name, (factory, features) in families.items():
        doc = " ".join((inspect.getdoc(factory) or "").split("\n\n")[0].split())
        lines.append(f"| {name} | {_cell(doc.split(':')[0])} | {_cell(features)} | "
                     f"`xirang verify examples/{module}.py:{name} --world 8` |")
    return "\n".join(lines) + "\n"


def catalog_markdown() -> str:
    """A row per public factory of examples/catalog.py with its docstring."""
    catalog = _examples_module("catalog")
    lines = ["| factory | model |", "|---|---|"]
    for name, function in inspect.getmembers(catalog, inspect.isfunction):
        if name.startswith("_") or function.__module__ != catalog.__name__:
            continue
        doc = " ".join((inspect.getdoc(function) or "").split())
        lines.append(f"| `examples/catalog.py:{name}` | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


def source_identifier(public: str) -> str:
    """``xirang.plan`` -> ``xirang_compile.plan_api.plan``: where the public object is defined, as a
    dotted path from the repository root (pyproject.toml maps ``xirang`` to ``xirang_compile``)."""
    import xirang
    obj = xirang
    for part in public.split(".")[1:]:
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(f"{obj.__name__}.{part}")
    module = obj.__name__ if inspect.ismodule(obj) else obj.__module__
    inner = module.split(".", 1)[1] if "." in module else ""
    folder = inner.split(".")[0]
    path = inner if folder in ("ir", "passes", "codegen") else ".".join(x for x in ("xirang_compile", inner) if x)
    return path if inspect.ismodule(obj) else f"{path}.{obj.__qualname__}"


def _api_identifiers(markdown: str) -> str:
    return re.sub(r"^::: (xirang\.\S+)$", lambda m: f"::: {source_identifier(m.group(1))}", markdown, flags=re.M)


GENERATORS = {"<!-- generated: cli -->": cli_markdown, "<!-- generated: families -->": families_markdown,
              "<!-- generated: moe-families -->": lambda: families_markdown("hf_moe"),
              "<!-- generated: catalog -->": catalog_markdown}


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 -- MkDocs' hook signature
    for marker, generate in GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return _api_identifiers(markdown) if "\n::: xirang." in markdown else markdown
