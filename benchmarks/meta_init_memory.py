"""Host memory per rank: compiling a model built on the CPU against one built on ``meta`` (from scratch, each
rank making only its shards: codegen/runtime/state/weight_init.py).

Each of ``world`` local CPU ranks builds the model (on the CPU, or on meta), compiles it under one plan made on
meta in the parent, then drops its own reference to the model. At each point it reports:

- ``rss``: resident set size (/proc/self/status VmRSS) after ``gc.collect()`` and ``malloc_trim(0)``, with
  glibc's mmap threshold pinned at 1 MiB (``mallopt``) so a freed tensor's pages go back to the system instead
  of staying in the heap (glibc raises the threshold after each large free; RSS would then overstate);
- ``peak``: the high-water mark of RSS since the rank started measuring (VmHWM, reset by writing 5 to
  /proc/self/clear_refs after imports), the number that says whether the rank ever held the whole model;
- ``tensor_bytes``: the bytes of every distinct real storage reachable from a Python tensor
  (``gc.get_objects()``; fake and meta tensors hold none);
- ``model_bytes`` (the whole model's parameters) and ``shard_bytes`` (what the compiled program binds).

    python benchmarks/meta_init_memory.py                     # GPT-2 medium shapes, (dp, tp, pp) = (1, 2, 2)
    python benchmarks/meta_init_memory.py --model gpt-small --world 4 --tp 2 --pp 2
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # examples/

import xirang  # noqa: E402
from examples.gpt import GPTConfig, build_gpt  # noqa: E402
from xirang.codegen.runtime.launch.launcher import launch  # noqa: E402
from xirang.ir.placement import PlanShard  # noqa: E402

MODELS = {"gpt2-medium": GPTConfig(vocab_size=50257, seq_len=1024, hidden=1024, heads=16, layers=24),
          "gpt-small": GPTConfig(vocab_size=50257, seq_len=1024, hidden=768, heads=12, layers=12),
          # GPT-2 small's blocks with a small vocabulary: no one tensor is a large share of the model
          "gpt-small-vocab8k": GPTConfig(vocab_size=8192, seq_len=1024, hidden=768, heads=12, layers=12)}
PLAN_SEQ, RUN_SEQ, GLOBAL_BATCH, SEED, MiB = 512, 16, 4, 0, 2**20
_M_MMAP_THRESHOLD = -3  # glibc malloc.h


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: RSS is then what the allocator keeps
        return None


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _tensor_bytes() -> int:
    seen, total = set(), 0
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: it reads __class__, which deprecated torch objects warn on
        if not issubclass(kind, torch.Tensor) or issubclass(kind, torch._subclasses.FakeTensor) or obj.is_meta:
            continue
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen and storage.data_ptr() != 0:
            seen.add(key)
            total += storage.nbytes()
    return total


def _snapshot() -> dict:
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    return {"rss": _status("VmRSS"), "peak": _status("VmHWM"), "tensor_bytes": _tensor_bytes()}


def _batch(size: int, seq: int, device) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randint(0, 1000, (size, seq), generator=generator).to(device)
            for name in ("input_ids", "labels")}


def _rank_main(rank, world, name, plan, from_meta):
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MiB)
    with open("/proc/self/clear_refs", "w") as refs:  # VmHWM from here on
        refs.write("5")
    found = {"start": _snapshot()}
    device = "meta" if from_meta else "cpu"
    model = build_gpt(MODELS[name], device=device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    found["built"] = _snapshot()
    compiled = xirang.compile(model, world=world, example_kwargs=_batch(2, RUN_SEQ, device), plan=plan,
                              runtime=xirang.RuntimeOptions(seed=SEED), hardware="a100-80g")
    found["compiled"] = _snapshot()
    del model
    found["dropped"] = _snapshot()
    shard_bytes = sum(t.untyped_storage().nbytes() for t in compiled._state.values())
    loss = compiled.train_step(**_batch(GLOBAL_BATCH, RUN_SEQ, "cpu")).item()  # it trains
    flat = {f"{key}_after_{point}": value for point, snap in found.items() for key, value in snap.items()}
    flat.update(model_bytes=model_bytes, shard_bytes=shard_bytes, loss=loss,
                tensor_bytes_after_drop=found["dropped"]["tensor_bytes"], rss_after_drop=found["dropped"]["rss"])
    return flat


def make_plan(name: str, world: int, dp: int, tp: int, pp: int):
    plan = xirang.plan(build_gpt(MODELS[name], device="meta"), world=world,
                       example_kwargs=_batch(2, RUN_SEQ, "meta"), global_batch=GLOBAL_BATCH, seq=PLAN_SEQ,
                       hardware="a100-80g", precision="fp32", dp=dp, tp=tp, pp=pp, micro_batch=1)
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (dp, tp, pp), plan.mesh
    if tp > 1:
        assert any(n.startswith("p_") and isinstance(s.outputs[0].tp, PlanShard) for n, s in plan.placements.items()), \
            "the plan shards no parameter"
    return plan


def measure(name: str, *, world: int, dp: int, tp: int, pp: int, from_meta: bool, plan=None) -> list:
    """Every rank's figures (module docstring), in rank order."""
    plan = plan or make_plan(name, world, dp, tp, pp)
    return launch(_rank_main, world, (name, plan, from_meta), timeout_s=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-medium", choices=sorted(MODELS))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()
    plan = make_plan(args.model, args.world, args.dp, args.tp, args.pp)
    print(f"{args.model} at (dp, tp, pp) = ({args.dp}, {args.tp}, {args.pp}), {args.world} CPU ranks; MiB per rank")
    for from_meta in (False, True):
        results = measure(args.model, world=args.world, dp=args.dp, tp=args.tp, pp=args.pp, from_meta=from_meta,
                          plan=plan)
        print(f"\nmodel built on {'meta' if from_meta else 'the CPU'} "
              f"(whole model {results[0]['model_bytes'] / MiB:.0f} MiB of parameters)")
        print("rank  rss: start  built  compiled  dropped | peak | tensors: compiled dropped | shards | loss")
        for rank, r in enumerate(results):
            print(f"{rank:>4}  {r['rss_after_start'] / MiB:11.0f} {r['rss_after_built'] / MiB:6.0f} "
                  f"{r['rss_after_compiled'] / MiB:9.0f} {r['rss_after_dropped'] / MiB:8.0f} | "
                  f"{r['peak_after_dropped'] / MiB:4.0f} | {r['tensor_bytes_after_compiled'] / MiB:17.0f} "
                  f"{r['tensor_bytes_after_dropped'] / MiB:7.0f} | {r['shard_bytes'] / MiB:6.0f} | {r['loss']:.4f}")


if __name__ == "__main__":
    main()
