"""docs/benchmarks.md from the benchmarks' recorded results: the page is generated, never edited by hand.

    python benchmarks/make_docs.py                         # write docs/benchmarks.md
    python benchmarks/make_docs.py --check                 # exit 1 when docs/benchmarks.md is not what it writes
    python benchmarks/make_docs.py record [--timeout S] SCRIPT [ARGS]   # run benchmarks/SCRIPT.py ARGS, record it

``record`` runs one benchmark script in a fresh process from the repository root and writes
``benchmarks/results/<SCRIPT>[__<args>].json``: the command, the date (UTC), the machine (CPU model,
cores, memory, OS, Python, torch), the load average before and after, the wall seconds, the exit
status, everything the script printed on stdout and, for scripts that take ``--json OUT``, what they
wrote there. Recording the same command again replaces its file.

The page lists every benchmark script (its docstring's first line and its command) with each of its
recorded runs, the output as the script printed it; a script with no recorded run is listed as not yet
recorded. Nothing else goes on the page: no figure without a result file behind it.

Other pages (README.md, docs/) show a recorded output where they hold a region

    <!-- recorded: NAME -->
    <!-- end recorded -->

which this script fills from ``benchmarks/results/NAME.json``: the command that records it, the date,
machine and load, then the output in a ``text`` block. ``--check`` covers those regions too.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
NOT_BENCHMARKS = {"make_docs", "native_3d"}  # this generator; the baseline race_native.py imports
RECORDED = re.compile(r"^<!-- recorded: ([\w.,=-]+) -->$")  # a result file's name, without .json
END_RECORDED = "<!-- end recorded -->"


def benchmark_scripts() -> dict[str, Path]:
    """Every benchmark script by name (its file name without .py), in name order."""
    return {path.stem: path for path in sorted(BENCHMARKS.glob("*.py")) if path.stem not in NOT_BENCHMARKS}


def script_summary(path: Path) -> tuple[str, list[str]]:
    """The docstring's first paragraph (one line) and its usage lines (``python benchmarks/...``)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
    first = re.sub(r"\s*\(issues? \d+[^)]*\)", "", first)  # where a benchmark came from is history, not a figure
    usage, lines = [], doc.splitlines()
    for index, line in enumerate(lines):
        if line.strip().startswith("python benchmarks/"):
            text = line.strip()
            while text.endswith("\\") and index + 1 < len(lines):  # a usage line continued
                index += 1
                text = text[:-1].rstrip() + " " + lines[index].strip()
            usage.append(re.sub(r"\s+#.*$", "", text) if "  #" in text else text)
    return first, usage or [f"python benchmarks/{path.name}"]


def machine() -> dict:
    """What the run ran on: enough to compare two runs, nothing that names the host."""
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    memory = None
    try:
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
        memory = f"{kib / 2**20:.0f} GiB"
    except (OSError, StopIteration):
        pass
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory": memory, "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "torch": torch_version}


def load_average() -> str | None:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


def result_path(script: str, args: list[str]) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", "_".join(a.lstrip("-") for a in args)).strip("_")
    return RESULTS / (f"{script}__{slug}.json" if slug else f"{script}.json")


def record(script: str, args: list[str], timeout_s: float | None = None) -> Path:
    """Run ``benchmarks/<script>.py args`` and write its result file (see the module docstring)."""
    scripts = benchmark_scripts()
    if script not in scripts:
        raise SystemExit(f"make_docs: no benchmark {script!r}; one of: {', '.join(scripts)}")
    path = scripts[script]
    takes_json = '"--json"' in path.read_text() and "--json" not in args
    json_out = RESULTS / f".{script}.{os.getpid()}.json"
    command = [sys.executable, str(path.relative_to(ROOT)), *args]
    RESULTS.mkdir(exist_ok=True)
    before, began = load_average(), time.time()
    try:
        done = subprocess.run(command + (["--json", str(json_out)] if takes_json else []), cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        json_out.unlink(missing_ok=True)
        raise SystemExit(f"make_docs: {' '.join(command[1:])} ran past {timeout_s:.0f} s; nothing recorded") from None
    seconds = time.time() - began
    data = None
    if json_out.exists():
        data = json.loads(json_out.read_text())
        json_out.unlink()
    result = {"script": path.name, "command": " ".join(["python", *command[1:]]),
              "date": datetime.datetime.fromtimestamp(began, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": machine(), "load_average_before": before, "load_average_after": load_average(),
              "seconds": round(seconds, 1), "exit_status": done.returncode, "stdout": done.stdout, "data": data}
    out = result_path(script, args)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{out.relative_to(ROOT)}: exit {done.returncode}, {seconds:.1f} s")
    return out


def recorded_runs() -> dict[str, list[dict]]:
    """The result files by script name, each script's runs in command order."""
    runs: dict[str, list[dict]] = {}
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        result["file"] = path.relative_to(ROOT).as_posix()
        runs.setdefault(Path(result["script"]).stem, []).append(result)
    return runs


def describe_machine(m: dict) -> str:
    return (f"{m['cpu']}, {m['cores']} cores, {m['memory']} memory; {m['os']}; Python {m['python']}, "
            f"torch {m['torch']}")


def _plan_speed(run: dict):
    """Each model's end-to-end planning time (its 'total' line)."""
    setup = None
    for line in run["stdout"].splitlines():
        heading = re.match(r"^(\w+): seq (\d+), global batch (\d+), world (\S+) ([\w-]+);", line)
        if heading:
            setup = heading.groups()
        total = re.match(r"^\s+total\s+([\d.]+)\s+([\d.]+)\s*$", line)
        if total and setup:
            name, seq, _, world, device = setup
            yield (f"plan {name} (seq {seq}) for {world} {device}, end to end",
                   f"{total.group(1)} s wall, {total.group(2)} s CPU")


def _published_runs(run: dict):
    """How far the cost model's step is from each published run's, by device."""
    rows = run.get("data") or []
    for device in sorted({row["device"] for row in rows}):
        errors = [abs(row["error"]) for row in rows if row["device"] == device]
        within = sum(error <= 0.15 for error in errors)
        yield (f"published runs priced on {device} (nothing fitted to them): |predicted / published - 1|",
               f"{within} of {len(errors)} within 15%; worst {max(errors):.1%}, mean {sum(errors) / len(errors):.1%}")


def _published_configs(run: dict):
    """The configurations the efficiency terms were fitted to: priced error, and Xirang's own plan's speed-up."""
    rows = run.get("data") or []
    if rows:
        errors = [abs(row["error"]) for row in rows]
        speedups = [row["published_step_s"] / row["chosen_step_s"] for row in rows]
        yield ("published Megatron-LM configurations priced: |predicted / published - 1|",
               f"worst {max(errors):.1%} over {len(rows)} rows")
        yield ("Xirang's own plan against the published configuration, predicted step ratio",
               f"{min(speedups):.2f}x to {max(speedups):.2f}x faster")


def _published_moe_runs(run: dict):
    """Published MoE runs: how many could be priced as published, and their predicted / published step."""
    rows = run.get("data") or []
    priced = [row for row in rows if row.get("priced")]
    if rows:
        ratios = ", ".join(f"{row['id']} {row['priced']['ratio']:.2f}" for row in priced) or "none"
        within = sum(abs(row["priced"]["ratio"] - 1) <= 0.15 for row in priced)
        yield ("published MoE runs priced with their configuration pinned: predicted / published step",
               f"{len(priced)} of {len(rows)} rows priceable as published, {within} within 15%: {ratios}")


def _activation_memory(run: dict):
    """Saved activations measured on CPU ranks against the plan's prediction, over every mode and rank."""
    ratios = [rank["ratio"] for mode in run.get("data") or [] for rank in mode["memory"] if rank.get("ratio")]
    if ratios:
        modes = ", ".join(f"{m['recompute']}/{m['offload']}" for m in run["data"])
        yield (f"saved activations measured / predicted per rank (recompute/offload {modes})",
               f"{min(ratios):.3f} to {max(ratios):.3f}")


def _race_native(run: dict):
    """Xirang's step against the native baseline's on 8 CPU ranks, per mesh: wall and CPU-seconds ratios."""
    rows = []
    for line in run["stdout"].splitlines():
        row = re.match(r"^(\(\d+, \d+, \d+\)\s+\S+)\s+\d+\s+(strong|weak)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+(\S+)"
                       r"\s+\S+\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s*$", line)
        if row:
            rows.append(row.groups())
    for kind in ("strong", "weak"):
        mine = [r for r in rows if r[1] == kind]
        if mine:
            walls, cpus = [float(r[2]) for r in mine], [float(r[4]) for r in mine]
            worst = max(float(r[3]) for r in mine)
            yield (f"Xirang's step / the {kind} PyTorch-native baseline's, 8 CPU gloo ranks, {len(mine)} meshes",
                   f"wall {min(walls):.2f} to {max(walls):.2f}, CPU seconds {min(cpus):.2f} to {max(cpus):.2f}; "
                   f"losses equal within {worst:.1e}")
    meshes = {r[0] for r in rows}
    if meshes and {r[1] for r in rows} == {"strong", "weak"}:  # against the faster native at each mesh
        walls = [max(float(r[2]) for r in rows if r[0] == mesh) for mesh in meshes]
        cpus = [max(float(r[4]) for r in rows if r[0] == mesh) for mesh in meshes]
        yield (f"Xirang's step / the faster native baseline's at each mesh, 8 CPU gloo ranks, {len(meshes)} meshes",
               f"wall {min(walls):.2f} to {max(walls):.2f}, CPU seconds {min(cpus):.2f} to {max(cpus):.2f}")


SUMMARIES = {"plan_speed": _plan_speed, "activation_memory": _activation_memory, "published_runs": _published_runs,
             "published_configs": _published_configs, "published_moe_runs": _published_moe_runs,
             "race_native": _race_native}


def summary_lines(runs: dict[str, list[dict]]) -> list[str]:
    """A table of the headline figures, each with its command, date and machine (details below)."""
    rows = []
    for name, summarise in SUMMARIES.items():
        for run in runs.get(name, []):
            if run["exit_status"] != 0:
                continue
            m = run["machine"]
            for figure, value in summarise(run):
                figure, value = (text.replace("|", "\\|") for text in (figure, value))
                rows.append(f"| {figure} | {value} | `{run['command']}` | {run['date']} | "
                            f"{m['cpu']}, {m['cores']} cores, load {(run['load_average_before'] or '?').split()[0]} |")
    if not rows:
        return []
    return ["## Summary", "", "| figure | value | command | date | machine |", "|---|---|---|---|---|", *rows, ""]


def render() -> str:
    """The page's text: every benchmark, its command, and each recorded run or 'not yet recorded'."""
    runs = recorded_runs()
    scripts = benchmark_scripts()
    lines = ["# Benchmarks", "",
             "<!-- generated by benchmarks/make_docs.py from benchmarks/results/*.json: do not edit -->", "",
             "This page is generated by `python benchmarks/make_docs.py` from the result files in "
             "`benchmarks/results/`, which `python benchmarks/make_docs.py record SCRIPT [ARGS]` writes: each "
             "benchmark run in a fresh process with its command, date, machine, load average and output. A test "
             "(`tests/docs/test_benchmarks_page.py`) keeps this page equal to the generator's output.", "",
             "Planning and pricing figures (step times of GPU clusters, TFLOP/s) are the cost model's "
             "predictions, not measurements on GPUs. Timings on a shared machine move with its load; each run "
             "says what the load was.", "", *summary_lines(runs),
             "## All benchmarks", "", "| benchmark | what it measures | recorded runs |", "|---|---|---|"]
    for name, path in scripts.items():
        first, _ = script_summary(path)
        count = len(runs.get(name, []))
        lines.append(f"| [`{path.name}`](#{name}) | {first.replace('|', '/')} | "
                     f"{count if count else 'not yet recorded'} |")
    for name, path in scripts.items():
        first, usage = script_summary(path)
        lines += ["", f"## {name}", "", first, "", "```text", *usage, "```", ""]
        if name not in runs:
            lines += ["Not yet recorded: no result file in `benchmarks/results/`."]
            continue
        for run in runs[name]:
            status = "" if run["exit_status"] == 0 else f", **exit status {run['exit_status']}**"
            lines += [f"**`{run['command']}`**", "",
                      f"- date: {run['date']}; wall time {run['seconds']} s{status}",
                      f"- machine: {describe_machine(run['machine'])}",
                      f"- load average (1, 5, 15 min) before {run['load_average_before']}, "
                      f"after {run['load_average_after']}",
                      f"- result file: `{run['file']}`" + (" (with the script's `--json` figures)"
                                                            if run.get("data") is not None else ""),
                      "", "```text", *run["stdout"].rstrip("\n").splitlines(), "```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def pages_with_recorded_output() -> list[Path]:
    """README.md and the docs/ pages (the benchmarks page aside) that hold a ``recorded`` region."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if p != PAGE and p.is_file() and "<!-- recorded: " in p.read_text()]


def fill_recorded(page: Path, text: str, results: Path | None = None) -> str:
    """``text`` (of ``page``) with every ``recorded`` region written from its result file (module docstring)."""
    results = RESULTS if results is None else results
    lines, out, index = text.splitlines(), [], 0
    where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    while index < len(lines):
        line = lines[index]
        out.append(line)
        index += 1
        match = RECORDED.match(line.strip())
        if not match:
            continue
        end = next((j for j in range(index, len(lines)) if lines[j].strip() == END_RECORDED), None)
        if end is None:
            raise SystemExit(f"make_docs: {where}: '{line.strip()}' has no '{END_RECORDED}' after it")
        path = results / f"{match.group(1)}.json"
        if not path.is_file():
            raise SystemExit(f"make_docs: {where} shows {path.name}, which is not recorded: run "
                             f"python benchmarks/make_docs.py record SCRIPT [ARGS] (the name is SCRIPT__ARGS)")
        run = json.loads(path.read_text())
        if run["exit_status"] != 0:
            raise SystemExit(f"make_docs: {where} shows {path.name}, a run that failed (exit {run['exit_status']})")
        name, args = Path(run["script"]).stem, run["command"].split()[2:]
        link = os.path.relpath(PAGE, page.parent).replace(os.sep, "/")
        m, load = run["machine"], (run["load_average_before"] or "?").split()[0]
        out += ["", f"Recorded by `{' '.join(['python benchmarks/make_docs.py record', name, *args])}` on "
                f"{run['date']} ({m['cpu']}, {m['cores']} cores, load {load}; "
                f"torch {m['torch']}); the run is also on [the benchmarks page]({link}#{name}).", "",
                "```text", *run["stdout"].rstrip("\n").splitlines(), "```", ""]
        out.append(lines[end])
        index = end + 1
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        timeout_s = None
        if argv[1:2] == ["--timeout"] and len(argv) > 2:
            timeout_s, argv = float(argv[2]), argv[:1] + argv[3:]
        if len(argv) < 2:
            raise SystemExit("usage: python benchmarks/make_docs.py record [--timeout S] SCRIPT [ARGS]")
        record(argv[1], argv[2:], timeout_s)
        argv = []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/benchmarks.md or a page's recorded output differs")
    args = parser.parse_args(argv)
    texts = {PAGE: render()}
    for page in pages_with_recorded_output():
        texts[page] = fill_recorded(page, page.read_text())
    if args.check:
        stale = [page for page, text in texts.items() if not page.exists() or page.read_text() != text]
        for page in stale:
            print(f"{page.relative_to(ROOT)} is not what benchmarks/make_docs.py writes: "
                  "run python benchmarks/make_docs.py")
        return 1 if stale else 0
    for page, text in texts.items():
        if not page.exists() or page.read_text() != text:
            page.write_text(text)
            print(f"wrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
