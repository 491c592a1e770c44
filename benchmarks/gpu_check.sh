#!/usr/bin/env bash
# The prepared GPU check (run it whenever a session has a GPU; under 5 minutes on one device):
#   1. compile and train the in-repo GPT on one GPU at world 1 (fp32): loss equal to eager. One process has
#      no process group, so xirang.compile's runtime device would default to the CPU: runtime_device="cuda"
#      is passed (an explicit device wins);
#   2. a bf16 plan's step time against the eager fp32 and autocast-bf16 steps, and the loss close to fp32;
#   3. the default runtime device (codegen/runtime/launch/devices.py) on a one-rank NCCL process group with
#      LOCAL_RANK=0 as torchrun sets it: a GPT built and traced on the CPU compiles to cuda:0 without
#      runtime_device= and its loss equals the same model's eager loss on the GPU;
#   4. `xirang calibrate --world 1 --device cuda --quick` runs (figures too rough to plan with).
# Usage (from the repository root, after the README's install): bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import time

import torch

import xirang
from examples.gpt import GPTConfig, build_gpt

assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
config = GPTConfig(vocab_size=8192, seq_len=512, hidden=1024, heads=16, layers=8)


def model():
    torch.manual_seed(0)
    return build_gpt(config, device="cuda")


def batch(step=0, size=8):
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, config.vocab_size, (size, config.seq_len), generator=generator)
    return {"input_ids": ids.cuda(), "labels": torch.roll(ids, -1, 1).cuda()}


def timed(step, repeats=10):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


results = {}
for precision in ("fp32", "bf16"):
    compiled = xirang.compile(model(), world=1, example_kwargs=batch(), global_batch=8, device="h100-80g",
                              precision=precision, runtime_device="cuda")  # world 1: no process group
    loss = compiled.train_step(**batch()).item()
    results[precision] = (loss, timed(lambda: compiled.train_step(**batch())))
eager = model()
reference = eager(**batch())
eager_loss = (reference if torch.is_tensor(reference) else reference[0]).item()


def eager_step():
    eager.zero_grad()
    out = eager(**batch())
    (out if torch.is_tensor(out) else out[0]).backward()


def autocast_step():
    eager.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = eager(**batch())
    (out if torch.is_tensor(out) else out[0]).backward()


eager_s, autocast_s = timed(eager_step), timed(autocast_step)
print(f"fp32: compiled loss {results['fp32'][0]:.6f} vs eager {eager_loss:.6f} "
      f"(|diff| {abs(results['fp32'][0] - eager_loss):.2e}); step {results['fp32'][1] * 1e3:.1f} ms vs eager "
      f"{eager_s * 1e3:.1f} ms (ratio {results['fp32'][1] / eager_s:.3f})")
print(f"bf16: compiled loss {results['bf16'][0]:.6f} (relative to fp32 {abs(results['bf16'][0] / eager_loss - 1):.2e}); "
      f"step {results['bf16'][1] * 1e3:.1f} ms vs eager autocast {autocast_s * 1e3:.1f} ms "
      f"(ratio {results['bf16'][1] / autocast_s:.3f})")
assert abs(results["fp32"][0] - eager_loss) <= 1e-4 * abs(eager_loss), "fp32 compiled loss differs from eager"
assert abs(results["bf16"][0] / eager_loss - 1) <= 0.02, "bf16 loss not within 2% of fp32"

# 3. the runtime device follows the launcher: NCCL and LOCAL_RANK=0 -> cuda:0, the model and batch on the CPU
import os
import socket

import torch.distributed as dist

with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("nccl", rank=0, world_size=1)
try:
    torch.manual_seed(0)
    on_cpu = build_gpt(config, device="cpu")
    cpu_batch = {name: value.cpu() for name, value in batch().items()}
    followed = xirang.compile(on_cpu, world=1, example_kwargs=cpu_batch, global_batch=8, device="h100-80g",
                              precision="fp32")
    assert followed.device == torch.device("cuda", 0), f"NCCL with LOCAL_RANK=0 ran on {followed.device}"
    followed_loss = followed.train_step(**{name: value.cuda() for name, value in cpu_batch.items()}).item()
    moved = on_cpu.to("cuda")
    out = moved(**batch())
    moved_loss = (out if torch.is_tensor(out) else out[0]).item()
    print(f"default runtime device under NCCL: {followed.device}; loss {followed_loss:.6f} vs eager on the GPU "
          f"{moved_loss:.6f} (|diff| {abs(followed_loss - moved_loss):.2e})")
    assert abs(followed_loss - moved_loss) <= 1e-4 * abs(moved_loss), "default-device loss differs from eager"
finally:
    dist.destroy_process_group()
PY
# 4. calibrate on the GPU (quick sizes: checks it runs, not its figures)
out="$(mktemp -d)"
python -m xirang calibrate --world 1 --device cuda --quick --out "$out/world.json"
rm -rf "$out"
