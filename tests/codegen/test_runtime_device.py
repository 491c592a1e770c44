"""Where a rank's tensors live (issue 33, GPU-ready by construction), checked without a GPU: the choice
itself (codegen/runtime/launch/devices.py: NCCL -> cuda:LOCAL_RANK, gloo or no process group -> cpu, an
explicit device wins, mismatches refused naming backend and device), that ``xirang.compile`` hands the
resolved device to what it builds, and that a program lowered for a GPU rank names no other device."""
from __future__ import annotations

import pytest
import torch

import xirang
import xirang.compile_api as compile_api
from examples.gpt import GPTConfig, build_gpt
from xirang.codegen.runtime.launch import devices
from xirang.codegen.runtime.launch.devices import backend_names, runtime_device_for
from xirang.ir.errors import XirangError
from xirang.lower import rank_source

CONFIG = GPTConfig(vocab_size=128, seq_len=16, hidden=32, heads=4, layers=2)
BATCH = 4


def _batch() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len), generator=generator),
            "labels": torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len), generator=generator)}


def _gpt():
    torch.manual_seed(0)
    return build_gpt(CONFIG, device="cpu")


# --- the choice ------------------------------------------------------------------------------------------


def test_nccl_follows_local_rank():
    assert runtime_device_for("nccl", {"LOCAL_RANK": "3", "RANK": "11"}, cuda_devices=8) == torch.device("cuda:3")
    # torch's per-device backend string (init_process_group() with no backend on a GPU machine)
    assert runtime_device_for("cpu:gloo,cuda:nccl", {"LOCAL_RANK": "1"}, cuda_devices=2) == torch.device("cuda:1")


def test_gloo_and_no_process_group_run_on_the_cpu():
    for backend in ("gloo", "cpu:gloo", None):
        # LOCAL_RANK and GPUs do not matter: gloo ranks run on the CPU
        assert runtime_device_for(backend, {"LOCAL_RANK": "3"}, cuda_devices=8) == torch.device("cpu")
        assert runtime_device_for(backend, {}, cuda_devices=0) == torch.device("cpu")


def test_an_explicit_device_wins():
    assert runtime_device_for("nccl", {"LOCAL_RANK": "3"}, cuda_devices=8, requested="cuda:5") == torch.device("cuda:5")
    assert runtime_device_for("gloo", {}, cuda_devices=0, requested="cpu") == torch.device("cpu")
    assert runtime_device_for("gloo", {}, cuda_devices=2, requested=torch.device("cuda", 1)) == torch.device("cuda:1")
    assert runtime_device_for(None, {}, cuda_devices=1, requested="cuda") == torch.device("cuda")
    # gloo serves the CPU half of a per-device backend
    assert runtime_device_for("cpu:gloo,cuda:nccl", {"LOCAL_RANK": "0"}, cuda_devices=1,
                              requested="cpu") == torch.device("cpu")
    # a backend xirang does not place for: the user's device is taken as given
    assert runtime_device_for("mpi", {}, cuda_devices=0, requested="cpu") == torch.device("cpu")


def _refusal(backend, environ, cuda_devices, requested=None) -> XirangError:
    with pytest.raises(XirangError) as caught:
        runtime_device_for(backend, environ, cuda_devices=cuda_devices, requested=requested)
    error = caught.value
    assert error.where and error.hint, str(error)
    return error


def test_nccl_with_a_cpu_device_is_refused_naming_both():
    message = str(_refusal("nccl", {"LOCAL_RANK": "0"}, 8, requested="cpu"))
    assert "'nccl'" in message and "'cpu'" in message and "NCCL moves only CUDA tensors" in message


def test_a_cuda_device_without_cuda_is_refused_naming_both():
    message = str(_refusal("gloo", {}, 0, requested="cuda:0"))
    assert "'gloo'" in message and "'cuda:0'" in message and "torch.cuda is unavailable" in message
    message = str(_refusal(None, {}, 0, requested="cuda"))
    assert "no process group" in message and "'cuda'" in message
    message = str(_refusal("gloo", {}, 2, requested="cuda:2"))  # cuda:0 and cuda:1 only
    assert "'cuda:2'" in message and "sees 2 CUDA device(s)" in message


def test_nccl_without_local_rank_is_refused_not_guessed():
    error = _refusal("nccl", {"RANK": "5"}, 8)
    assert "LOCAL_RANK is not set" in error.what and "'nccl'" in error.what
    assert "torchrun" in error.hint and "device='cuda:N'" in error.hint
    assert "LOCAL_RANK='x'" in str(_refusal("nccl", {"LOCAL_RANK": "x"}, 8))
    assert "LOCAL_RANK='-1'" in str(_refusal("nccl", {"LOCAL_RANK": "-1"}, 8))


def test_local_rank_past_the_visible_gpus_is_refused():
    # Slurm's --gpus-per-task: each process sees only its GPU, as cuda:0
    error = _refusal("nccl", {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 1)
    assert "LOCAL_RANK=3" in error.what and "CUDA_VISIBLE_DEVICES=3" in error.what
    assert "device='cuda:0'" in error.hint
    assert "torch.cuda is unavailable" in str(_refusal("nccl", {"LOCAL_RANK": "0"}, 0))


def test_other_backends_need_an_explicit_device():
    error = _refusal("mpi", {"LOCAL_RANK": "0"}, 0)
    assert "'mpi'" in error.what and "device=" in error.hint


def test_a_bad_device_is_refused():
    assert "'gpu0'" in _refusal("gloo", {}, 0, requested="gpu0").what


def test_backend_names():
    assert backend_names(None) == frozenset()
    assert backend_names("NCCL") == {"nccl"}
    assert backend_names("cpu:gloo,cuda:nccl") == {"gloo", "nccl"}


def test_this_process_has_no_process_group():
    assert devices.process_group_backend() is None
    assert devices.resolve_runtime_device() == torch.device("cpu")


# --- xirang.compile hands the resolved device on ----------------------------------------------------------


@pytest.fixture
def one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_compile_at_world_one_runs_on_the_cpu_by_default(one_process):
    compiled = xirang.compile(_gpt(), world=1, hardware="cpu", example_kwargs=_batch(), global_batch=BATCH,
                              micro_batch=BATCH)
    assert compiled.device == torch.device("cpu")
    assert {p.device for p in compiled.parameters()} == {torch.device("cpu")}
    assert compiled.executor.device == torch.device("cpu")
    assert torch.isfinite(compiled.train_step(**_batch()))


class _Built(Exception):
    """Raised where compile first builds for its device: what it was handed is recorded."""


def _stop_at_build(monkeypatch) -> list:
    handed = []

    def check_plan_fits(plan, rank, device, available=None):
        handed.append(device)
        raise _Built

    monkeypatch.setattr(compile_api, "check_plan_fits", check_plan_fits)
    return handed


def test_compile_passes_cuda_local_rank_under_nccl(one_process):
    one_process.setenv("LOCAL_RANK", "3")
    one_process.setattr(devices, "process_group_backend", lambda: "nccl")
    one_process.setattr(devices, "visible_cuda_devices", lambda: 8)
    handed = _stop_at_build(one_process)
    with pytest.raises(_Built):
        xirang.compile(_gpt(), world=1, hardware="cpu", example_kwargs=_batch(), global_batch=BATCH,
                       micro_batch=BATCH)
    assert handed == [torch.device("cuda:3")]


def test_compile_passes_an_explicit_device(one_process):
    one_process.setattr(devices, "process_group_backend", lambda: "gloo")
    one_process.setattr(devices, "visible_cuda_devices", lambda: 2)
    handed = _stop_at_build(one_process)
    with pytest.raises(_Built):
        xirang.compile(_gpt(), world=1, hardware="cpu", example_kwargs=_batch(), global_batch=BATCH,
                       micro_batch=BATCH, device="cuda:1")
    assert handed == [torch.device("cuda:1")]


def test_compile_refuses_nccl_with_a_cpu_device_before_planning(one_process):
    one_process.setenv("LOCAL_RANK", "0")
    one_process.setattr(devices, "process_group_backend", lambda: "nccl")
    one_process.setattr(devices, "visible_cuda_devices", lambda: 8)

    def plan(*args, **kwargs):
        raise AssertionError("planned before the device was checked")

    one_process.setattr(compile_api, "make_plan", plan)
    with pytest.raises(XirangError, match="'cpu' under backend 'nccl'") as caught:
        xirang.compile(_gpt(), world=1, hardware="cpu", example_kwargs=_batch(), global_batch=BATCH,
                       device="cpu")
    assert caught.value.where == "xirang.compile(device=...)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without CUDA")
def test_compile_refuses_cuda_on_a_machine_without_it(one_process):
    with pytest.raises(XirangError, match="torch.cuda is unavailable"):
        xirang.compile(_gpt(), world=1, hardware="cpu", example_kwargs=_batch(), global_batch=BATCH,
                       device="cuda")


# --- the program itself names only the rank's device ------------------------------------------------------


def test_a_cpu_traced_program_lowered_for_a_gpu_rank_names_only_that_gpu():
    """The GPT makes its positions with ``torch.arange(..., device=input_ids.device)``: traced on the CPU,
    the trace says ``device=cpu``; the rank's program must make them on its own device
    (passes/lowering/trace_device.py), at tp = 1 and tp = 2."""
    model = _gpt()
    gm = xirang.analyze(model, example_kwargs=_batch()).graph_module
    for tp in (1, 2):
        plan = xirang.plan(model, world=tp, example_kwargs=_batch(), global_batch=BATCH, seq=4096,
                           hardware="a100-80g", precision="fp32", tp=tp)
        for rank in range(tp):
            source = rank_source(gm, plan, rank, "cuda:3")
            named = [line.strip() for line in source.splitlines() if "device(" in line]
            assert named, "the GPT's arange should name a device"
            assert all("device(type='cuda', index=3)" in line for line in named), named
            assert "'cpu'" not in source and "'meta'" not in source
