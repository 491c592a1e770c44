"""``xirang calibrate``: measure this machine's devices and links on N local ranks and write the World
JSON that ``xirang plan --world-file``, ``xirang.plan(world=World.load(F))`` and
``xirang.compile(..., world=...)`` read (the microbenchmarks: ``codegen/runtime/calibration/calibrate.py``).

Each calibration is also kept in the user's cache folder (``$XDG_CACHE_HOME/xirang``, else
``~/.cache/xirang``), keyed by host name, torch version, device and rank count
(``calibration_cache_path``), so that ``xirang train`` on this machine prices its plan with it
(``cached_calibration``) without being told where it is; a ``--quick`` one is kept under its own key
and used only where no full one exists.
"""
from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

from xirang.cli.args import positive_float, world_arg
from xirang.ir.errors import XirangError


def add_calibrate_parser(commands) -> None:
    """The ``calibrate`` subcommand and its options."""
    calibrate = commands.add_parser("calibrate", help="measure compute, per-op overhead and collectives on N local "
                                                      "ranks; write a World JSON the planner reads")
    calibrate.add_argument("--world", type=world_arg, default=world_arg("8"),
                           help="local ranks measured at once: N, or NxM (N * M ranks; default 8)")
    calibrate.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the ranks compute")
    calibrate.add_argument("--backend", default=None, help="torch.distributed backend (default gloo on cpu, nccl "
                                                           "on cuda)")
    calibrate.add_argument("--out", default="world.json", help="where to write the World JSON (default world.json)")
    calibrate.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: seconds, for tests "
                                                                "(figures too rough to plan with)")
    calibrate.add_argument("--timeout", type=positive_float, default=None,
                           help="seconds the whole run may take (default: no limit)")
    calibrate.set_defaults(run=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from xirang.codegen.runtime.calibration.calibrate import calibrate
    if args.world < 1:
        raise XirangError(f"--world must be a positive number of ranks, got {args.world}",
                          where="xirang calibrate --world", hint="pass the rank count training will use, e.g. 8")
    start = time.perf_counter()
    world = calibrate(int(args.world), device=args.device, backend=args.backend, quick=args.quick,
                      timeout_s=args.timeout)
    world.save(args.out)
    print(describe_calibration(world))
    print(f"\nmeasured in {time.perf_counter() - start:.1f} s; world written to {args.out}")
    print(cache_calibration(world, args.device, args.quick))
    return 0


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/xirang``, else ``~/.cache/xirang`` (the XDG base directory default)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "xirang"


def calibration_cache_path(ranks: int, device: str = "cpu", quick: bool = False) -> Path:
    """Where this host's calibration of ``ranks`` local ranks on ``device`` is kept: one file per host
    name, torch version (kernels change between releases), device and rank count (ranks sharing a
    host's cores run at a speed that depends on how many there are)."""
    import torch
    safe = lambda text: re.sub(r"[^A-Za-z0-9._-]+", "_", text)  # noqa: E731
    name = f"{safe(socket.gethostname())}-torch{safe(torch.__version__)}-{device}-{ranks}ranks"
    return cache_folder() / "calibrations" / f"{name}{'-quick' if quick else ''}.json"


def cache_calibration(world, device: str, quick: bool) -> str:
    """Keep ``world`` in the user's cache for ``xirang train``; returns the line saying where (or why not:
    a cache that cannot be written does not fail the calibration, whose World is already written)."""
    path = calibration_cache_path(world.size, device, quick)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        world.save(partial)
        partial.replace(path)
    except OSError as error:
        return f"not kept in the cache ({error}): pass --world-file to xirang train to price with it"
    rough = " (--quick: rough figures, used only until a full calibration replaces them)" if quick else ""
    return f"kept for xirang train --world {world.size} on this host: {path}{rough}"


def cached_calibration(ranks: int, device: str = "cpu") -> tuple:
    """(path, quick) of this host's cached calibration of ``ranks`` ranks on ``device``, the full one
    before a --quick one; (None, False) when there is none."""
    for quick in (False, True):
        path = calibration_cache_path(ranks, device, quick)
        if path.is_file():
            return path, quick
    return None, False


def describe_calibration(world) -> str:
    """A table of the measured figures (the file keeps every raw sample too)."""
    device, calibration = world.nodes[0].device, world.calibration
    lines = [world.describe(),
             f"  matmul  fp32 {device.peak('fp32') / 1e9:9.2f} GFLOP/s per rank, bf16 "
             f"{device.peak('bf16') / 1e9:9.2f} GFLOP/s",
             f"  memory  {device.memory_bandwidth / 1e9:9.2f} GB/s per rank (elementwise add, inputs out of cache"
             + (f"; fit residual {calibration.raw['elementwise']['residual']:.2f}"
                if "elementwise" in calibration.raw else "") + ")",
             f"  other   {device.peak('fp32') * device.efficiency.other / 1e9:9.2f} GFLOP/s per rank "
             f"(the class: gelu, layer norm, log-softmax, cross-entropy together), fused attention "
             f"{device.peak('fp32') * (device.efficiency.attention or device.efficiency.matmul) / 1e9:9.2f} GFLOP/s",
             *(["  kinds   " + ", ".join(f"{kind} {device.peak('fp32') * fraction / 1e9:.2f}"
                                         for kind, fraction in calibration.other_kind_efficiency.items())
                + " GFLOP/s per rank (each priced at its own)"] if calibration.other_kind_efficiency else []),
             *(["  by size " + ", ".join(
                 f"{kind} {device.peak('fp32') * bands[0][1] / 1e9:.2f}-{device.peak('fp32') * bands[-1][1] / 1e9:.2f}"
                 for kind, bands in calibration.other_kind_bands.items())
                + " GFLOP/s per rank, the rate of the smallest sizes' band and of the largest's (each band a"
                " line with its own fixed cost; each node at its size's)"]
               if calibration.other_kind_bands else []),
             *(["  attention by seq " + ", ".join(
                 f"{seq}: {device.peak('fp32') * rate / 1e9:.2f} GFLOP/s + {fixed * 1e3:.2f} ms a call"
                 for seq, (rate, fixed) in calibration.attention_by_seq.items())
                + " per rank (each node at the nearest sequence length's)"] if calibration.attention_by_seq else []),
             f"  ranks   {calibration.parallel_ranks or calibration.ranks:.2f} of {calibration.ranks} run at full "
             f"speed at once while training; a waiting rank costs {calibration.waiting_share:.2f} of a busy one"
             + (f"; training ranks beside each other take {calibration.raw['training_slowdown']:.2f}x the CPU "
                f"for FLOPs and {calibration.raw.get('fixed_cost_slowdown', calibration.raw['training_slowdown']):.2f}"
                f"x for per-op fixed costs"
                if calibration.raw.get("training_slowdown") else ""),
             f"  per op  forward {device.op_overhead_s * 1e6:7.1f} us, backward "
             f"{calibration.backward_op_overhead_s * 1e6:7.1f} us"]
    if calibration.split_backward_extra:
        lines.append(f"  split   a zero-bubble schedule's backward, input and weight gradients apart, costs "
                     f"{calibration.split_backward_extra:.2f} of the fused backward more")
    if calibration.pipeline_message_s is not None:
        per_message, per_byte = calibration.pipeline_message_s
        lines.append(f"  message {per_message * 1e6:7.1f} us + {per_byte * 1e9:.3f} ns a byte of CPU per pipeline "
                     f"message, both sides, at every rank busy")
    lines += [f"  {'collective':15s} {'group':>5s} {'alpha us':>10s} {'GB/s':>9s} {'residual':>9s}"]
    for fit in calibration.collectives:
        bandwidth = f"{1 / fit.beta / 1e9:9.3f}" if fit.beta else f"{'-':>9s}"
        lines.append(f"  {fit.kind:15s} {fit.group_size:5d} {fit.alpha * 1e6:10.1f} {bandwidth} "
                     f"{fit.residual:9.3f}")
    return "\n".join(lines)
