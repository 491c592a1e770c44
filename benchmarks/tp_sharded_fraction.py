"""How much of each model tensor parallelism really splits: the fraction of parameters the planner's
split shards at tp = 2, for every Hugging Face family the project tests (issue 39's table).

    python benchmarks/tp_sharded_fraction.py [--families falcon phi3] [--seq 4096] [--hardware a100-80g]

Each family's small model (examples/hf_families.py, examples/hf_moe.py, examples/hf_fused.py) is built on
``meta`` and planned on 2 devices (A100-80GB unless ``--hardware`` names another preset) at (dp, tp, pp) =
(1, 2, 1), fp32, micro-batch 1, at seq 4096 (the vision transformer at its own 1024 patches, Mamba at the 64
tokens its sequential scan is traced and unrolled over), as the family matrix plans them (a long sequence,
so splitting pays even for tiny widths). A parameter counts as sharded when the plan holds it as a tp shard
(``PlanShard``); the fraction is of elements, tied weights counted once. The last columns name the two
largest parameters held whole on every tp rank, and count the ops with no sharding rule at all
(``plan.fallbacks``: they run replicated). Every figure is the planner's choice, not a measurement of a run.

    python benchmarks/tp_sharded_fraction.py --before d3a6c00

adds a column: the fraction the planner of commit ``d3a6c00`` (before issue 39: no pieces, no Mamba rules, no
padded splits) shards of the same models. That commit's code is unpacked (``git archive``) into a temporary
folder, importable as ``xirang``, beside this script and today's example factories (the same models), and
the table is made there in a fresh process.
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples/ is a folder of the repository
PACKAGES = {"ir": "ir", "passes": "passes", "codegen": "codegen"}  # xirang.<name> -> folder (pyproject package-dir)

SEQ, GLOBAL_BATCH = 4096, 8
OWN_SEQ = {"vit": 1024, "mamba": 64, "jamba": 64}  # fixed by the model: ViT's image size; Mamba's scan, unrolled
# over the traced tokens (Jamba's Mamba layers too)


def families() -> dict:
    """name -> (factory, source file) over the project's family lists; the MoE list wins a shared name."""
    from examples import hf_families, hf_fused, hf_moe
    found = {}
    for module, tag in ((hf_families, "hf_families"), (hf_moe, "hf_moe"), (hf_fused, "hf_fused")):
        for name, (factory, _) in module.FAMILIES.items():
            found[name if name not in found else f"{name} ({tag})"] = (factory, tag)
    return found


def sharded_fraction(name: str, factory, seq: int = SEQ, hardware: str = "a100-80g") -> dict:
    """The plan's tp split of ``name`` at tp 2: parameters sharded (elements and count) and what stays whole."""
    import xirang
    from xirang.ir.meta_keys import ROLE
    from xirang.ir.placement import PlanShard
    model, inputs = factory(2, OWN_SEQ.get(name, 16), "meta")
    report = xirang.analyze(model, example_kwargs=inputs)
    plan = xirang.plan(model, world=2, example_kwargs=inputs, global_batch=GLOBAL_BATCH,
                       seq=None if name in OWN_SEQ else seq, hardware=hardware, precision="fp32", dp=1, tp=2, pp=1,
                       micro_batch=1, schedule="1f1b", analysed=report)
    sizes = {n.name: n.meta["val"].numel() for n in report.graph_module.graph.nodes
             if n.op == "placeholder" and ROLE.get(n, None) == "parameter"}
    sharded = {n for n in sizes if isinstance(plan.placements[n].outputs[0].tp, PlanShard)}
    whole = sorted((n for n in sizes if n not in sharded), key=lambda n: -sizes[n])
    return {"elements": sum(sizes.values()), "sharded_elements": sum(sizes[n] for n in sharded),
            "parameters": len(sizes), "sharded_parameters": len(sharded),
            "whole": [f"{n[2:]} ({sizes[n]})" for n in whole], "fallbacks": list(plan.fallbacks)}


def fractions_at(revision: str, args: list[str]) -> dict[str, str]:
    """family -> sharded-elements cell of the table this script prints under the code of ``revision``."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        for name, folder in PACKAGES.items():  # the package layout pyproject's package-dir gives, by links
            (tree / "xirang_compile" / name).symlink_to(tree / folder)
        (tree / "site").mkdir()
        (tree / "site" / "xirang").symlink_to(tree / "xirang_compile")
        for source in [Path(__file__), *sorted((ROOT / "examples").glob("hf_*.py"))]:  # today's script and models
            shutil.copy(source, tree / source.relative_to(ROOT))
        env = {**os.environ, "PYTHONPATH": f"{tree / 'site'}{os.pathsep}{tree}"}
        done = subprocess.run([sys.executable, str(tree / "benchmarks" / Path(__file__).name), *args], cwd=tree,
                              env=env, capture_output=True, text=True, check=True)
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0].strip(): cells[2].strip() for cells in rows[1:]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", help="names to measure (default: every family)")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--hardware", default="a100-80g", help="the device preset the plans are priced for")
    parser.add_argument("--before", metavar="REV", help="also the fractions under the code of commit REV")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    chosen = families()
    unknown = sorted(set(args.families or ()) - set(chosen))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(chosen)}")
    before = {}
    if args.before:
        same = [*(["--families", *args.families] if args.families else []), "--seq", str(args.seq),
                "--hardware", args.hardware]
        before = fractions_at(args.before, same)
    print(f"Fraction of parameters sharded by the plan at tp=2 (dp 1, pp 1, seq {args.seq}, {args.hardware}, fp32)\n")
    first = f"| family | source | sharded elements at {args.before} " if args.before else "| family | source "
    print(first + "| sharded elements | sharded parameters | largest parameters held whole (elements) | "
          "ops without a rule |")
    print("|---|---|---|---|---|---|" + ("---|" if args.before else ""))
    for name in args.families or chosen:
        factory, tag = chosen[name]
        start = time.perf_counter()
        try:
            found = sharded_fraction(name.split(" ")[0], factory, args.seq, args.hardware)
        except Exception as error:  # a family the planner refuses is a row of the table, not the end of it
            was = f" {before.get(name, 'not built')} |" if args.before else ""
            print(f"| {name} | {tag} |{was} error: {type(error).__name__}: {str(error).splitlines()[0][:120]} | | "
                  f"| |", flush=True)
            continue
        fraction = found["sharded_elements"] / found["elements"]
        was = f" {before.get(name, 'not built')} |" if args.before else ""
        print(f"| {name} | {tag} |{was} {fraction:.1%} | {found['sharded_parameters']}/{found['parameters']} | "
              f"{', '.join(found['whole'][:2])} | {len(found['fallbacks'])} |", flush=True)
        print(f"planned {name} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
