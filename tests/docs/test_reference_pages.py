"""The site's generated pages (docs/hooks/reference_pages.py) cover the code they are generated from, and the
site's navigation lists every page."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re

from tests.docs.doc_blocks import REPO


def _hook():
    spec = importlib.util.spec_from_file_location("reference_pages", REPO / "docs" / "hooks" / "reference_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _walk(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _walk(sub, (*path, name))


def test_cli_reference_has_every_subcommand_and_option():
    from xirang.cli import build_parser
    text = _hook().cli_markdown(build_parser())
    commands = list(_walk(build_parser()))
    assert {"analyze", "plan", "explain", "check", "inspect", "run", "verify", "demo", "launch", "calibrate",
            "checkpoint", "train"} <= {path[0] for path, _ in commands}
    for path, sub in [((), build_parser()), *commands]:
        assert not path or f"xirang {' '.join(path)}\n" in text, path
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if action.help == argparse.SUPPRESS:  # a renamed flag, kept only to refuse it: hidden as in --help
                continue
            for option in action.option_strings:
                assert re.search(rf"`{re.escape(option)}[` ]", text), (path, option)
    assert "SUPPRESS" not in text and "RENAMED_" not in text and "--nprocs" not in text


def test_api_reference_names_resolve_to_the_files_that_define_them():
    hook = _hook()
    names = re.findall(r"^::: (xirang\.\S+)$", (REPO / "docs" / "reference" / "api.md").read_text(), re.M)
    import xirang
    exported = set(xirang.__all__)
    assert {"compile", "plan", "analyze", "check", "save_checkpoint", "load_checkpoint"} <= \
        {name.split(".")[1] for name in names}
    for name in names:
        path = hook.source_identifier(name)
        module, _, attribute = path.rpartition(".")
        assert (REPO / (module.replace(".", "/") + ".py")).is_file(), (name, path)
        assert attribute in (REPO / (module.replace(".", "/") + ".py")).read_text(), (name, path)
        assert name.split(".")[1] in exported or name.count(".") > 1, f"{name} is not in xirang.__all__"


def test_generated_model_tables_list_every_family_and_factory():
    hook = _hook()
    families = importlib.import_module("examples.hf_families").FAMILIES
    table = hook.families_markdown()
    assert all(f"| {name} |" in table for name in families)
    moe = importlib.import_module("examples.hf_moe").FAMILIES
    assert all(f"| {name} |" in hook.families_markdown("hf_moe") for name in moe)
    assert "`examples/catalog.py:gpt_tiny`" in hook.catalog_markdown()


def test_navigation_lists_every_page():
    config = (REPO / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", config, re.M))
    assert pages == listed, f"not in mkdocs.yml nav: {pages - listed}; listed but missing: {listed - pages}"
