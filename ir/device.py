"""What one accelerator can do: peak FLOP/s per dtype, memory size, memory bandwidth.

The cost model prices a node as FLOPs / (peak x efficiency), or bytes / memory bandwidth where that
is larger (a roofline). The figures below are datasheet peaks; the efficiency terms, and the real
figures of the machine at hand, come from the calibration step, which measures short trial runs.

Peak FLOP/s are dense (no 2:4 structured sparsity): training matmuls are dense.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional, Union
from xirang.ir.errors import InvalidValue

GiB = 1024**3

# Spellings seen in the wild -> the short names the presets use. TensorInfo.dtype holds torch's
# names ("float32", "bfloat16"), so those must resolve too.
DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16",
    "float64": "fp64", "double": "fp64",
    "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8",
}


def canonical_dtype(dtype: str) -> str:
    """Short dtype name: 'torch.bfloat16', 'bfloat16' and 'bf16' all give 'bf16'."""
    name = str(dtype).lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet peaks a device's kernels reach at training sizes (the roofline's
    derating, ``passes/planning/cost_model.compute_time``). They belong to a device generation *and* the
    software of its era: the presets below give each its own, with the reason beside it; a calibration
    measures the machine at hand.

    - ``matmul``: tensor-core matmuls (and fused attention, unless ``attention`` is given) at training
      sizes, of the dtype's peak.
    - ``attention``: fused attention kernels (``scaled_dot_product_attention``) of the dtype's peak,
      where they run at another rate than matmuls (a CPU's flash-attention kernel, for one, runs below
      its matmul rate, which ``xirang calibrate`` measures); ``None``: the matmul figure (the presets'
      choice).
    - ``other``: FLOPs of non-matmul ops, which run on CUDA cores at 1/8-1/16 of the tensor-core rate
      (A100: 39 vs 312 TFLOP/s bf16); these ops are nearly always memory-bound anyway.
    - ``memory``: of the HBM datasheet bandwidth for memory-bound ops. Below what one streaming kernel
      reaches (80-90%): it lumps what the roofline leaves out of unfused elementwise work (kernel
      launches, several passes where the graph shows one, the optimizer step).

    The defaults are the A100 preset's (see ``DEVICE_PRESETS``).
    """

    matmul: float = 0.7
    other: float = 0.1
    memory: float = 0.35
    attention: Optional[float] = None

    def __post_init__(self):
        for name in ("matmul", "other", "memory", "attention"):
            value = getattr(self, name)
            if name == "attention" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise InvalidValue(f"Efficiency.{name} must be a fraction in (0, 1], got {value!r}")
            object.__setattr__(self, name, float(value))

    def to_json(self) -> dict:
        data = {"matmul": self.matmul, "other": self.other, "memory": self.memory}
        if self.attention is not None:
            data["attention"] = self.attention
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Efficiency":
        if not isinstance(data, dict) or not {"matmul", "other", "memory"} <= set(data) \
                or not set(data) <= {"matmul", "other", "memory", "attention"}:
            raise InvalidValue(f"bad efficiency {data!r}: expected an object with the keys matmul, other, "
                               f"memory and optionally attention (fractions in (0, 1])")
        return cls(**data)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: ``peak_flops`` maps dtype -> FLOP/s; memory in bytes and bytes/s.

    ``peak_flops`` is stored read-only (keys in canonical form) so a spec can be hashed and shared.
    "tf32" is the rate of fp32 matmuls when TF32 tensor cores are allowed; "fp32" is the plain
    (CUDA-core) rate. Which one applies is the cost model's decision, not the device's.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth: float
    # bytes/s one way between device memory and host memory (the link activation offload copies
    # over; PCIe is full duplex, so a copy out and a copy back can run at once); None: unknown, and
    # the planner does not offer offload on this device
    host_link_bytes_per_s: Optional[float] = None
    # fixed seconds each op costs whatever its size: eager dispatch on a CPU, a kernel launch on a
    # GPU (`xirang calibrate` measures it); 0: not known, the roofline alone prices an op
    op_overhead_s: float = 0.0
    # fractions of the peaks above its kernels reach (Efficiency); the presets set their generation's
    efficiency: Efficiency = Efficiency()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise InvalidValue(f"DeviceSpec name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise InvalidValue(f"DeviceSpec {self.name!r}: peak_flops must be a non-empty "
                             f"dict dtype -> FLOP/s, got {self.peak_flops!r}")
        table = {}
        for dtype, flops in self.peak_flops.items():
            if not _positive_number(flops):
                raise InvalidValue(f"DeviceSpec {self.name!r}: peak_flops[{dtype!r}] must be a "
                                 f"positive number of FLOP/s, got {flops!r}")
            table[canonical_dtype(dtype)] = float(flops)
        object.__setattr__(self, "peak_flops", MappingProxyType(table))
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) \
                or self.memory_bytes < 1:
            raise InvalidValue(f"DeviceSpec {self.name!r}: memory_bytes must be a positive int, "
                             f"got {self.memory_bytes!r}")
        if not _positive_number(self.memory_bandwidth):
            raise InvalidValue(f"DeviceSpec {self.name!r}: memory_bandwidth must be a positive "
                             f"number of bytes/s, got {self.memory_bandwidth!r}")
        object.__setattr__(self, "memory_bandwidth", float(self.memory_bandwidth))
        if self.host_link_bytes_per_s is not None:
            if not _positive_number(self.host_link_bytes_per_s):
                raise InvalidValue(f"DeviceSpec {self.name!r}: host_link_bytes_per_s must be a positive "
                                 f"number of bytes/s or None, got {self.host_link_bytes_per_s!r}")
            object.__setattr__(self, "host_link_bytes_per_s", float(self.host_link_bytes_per_s))
        if isinstance(self.op_overhead_s, bool) or not isinstance(self.op_overhead_s, (int, float)) \
                or not self.op_overhead_s >= 0:
            raise InvalidValue(f"DeviceSpec {self.name!r}: op_overhead_s must be a non-negative number of "
                             f"seconds, got {self.op_overhead_s!r}")
        object.__setattr__(self, "op_overhead_s", float(self.op_overhead_s))
        if not isinstance(self.efficiency, Efficiency):
            raise InvalidValue(f"DeviceSpec {self.name!r}: efficiency must be an Efficiency, "
                               f"got {self.efficiency!r}")

    # A read-only mapping is neither hashable nor picklable; these two restore both.
    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory_bytes,
                     self.memory_bandwidth, self.host_link_bytes_per_s, self.op_overhead_s,
                     self.efficiency))

    def __reduce__(self):
        return (DeviceSpec, (self.name, dict(self.peak_flops), self.memory_bytes,
                             self.memory_bandwidth, self.host_link_bytes_per_s, self.op_overhead_s,
                             self.efficiency))

    @property
    def is_cpu(self) -> bool:
        """Whether this is a CPU (a preset or calibration named "cpu..."), not an accelerator."""
        return self.name.lower().startswith("cpu")

    @property
    def offload_frees_memory(self) -> bool:
        """Whether offloading activations to the host frees memory of this device: it has a host link,
        and its host memory is not its own (a CPU's "host" is the same memory, so there an offload
        only copies; it can still be pinned, to run the mechanism)."""
        return self.host_link_bytes_per_s is not None and not self.is_cpu

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (any spelling ``canonical_dtype`` accepts)."""
        key = canonical_dtype(dtype)
        if key not in self.peak_flops:
            raise InvalidValue(f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}; "
                             f"known dtypes: {', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[key]

    def to_json(self) -> dict:
        data = {"name": self.name, "peak_flops": dict(self.peak_flops),
                "memory_bytes": self.memory_bytes, "memory_bandwidth": self.memory_bandwidth}
        if self.host_link_bytes_per_s is not None:
            data["host_link_bytes_per_s"] = self.host_link_bytes_per_s
        if self.op_overhead_s:  # written only when measured, so older files read the same
            data["op_overhead_s"] = self.op_overhead_s
        data["efficiency"] = self.efficiency.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict) -> "DeviceSpec":
        """The spec ``to_json`` wrote. ``host_link_bytes_per_s`` and ``efficiency`` came later and are
        optional: a file without them gets the preset's when the rest describes that preset exactly (so
        a plan saved before them still matches the preset's World), else no host link and the default
        ``Efficiency()`` (what every device was priced with before)."""
        fields = ("name", "peak_flops", "memory_bytes", "memory_bandwidth")
        if not isinstance(data, dict) or not set(fields) <= set(data) \
                or not set(data) <= {*fields, "host_link_bytes_per_s", "op_overhead_s", "efficiency"}:
            raise InvalidValue(f"bad device spec {data!r}: expected an object with the keys "
                             f"{', '.join(fields)} (and optionally host_link_bytes_per_s, op_overhead_s, "
                             f"efficiency)")
        data = dict(data)
        if "efficiency" in data:
            data["efficiency"] = Efficiency.from_json(data["efficiency"])
        spec = cls(**data)
        preset = DEVICE_PRESETS.get(spec.name)
        later = {"host_link_bytes_per_s", "efficiency"} - set(data)  # fields an older file lacks
        if later and preset is not None \
                and preset == cls(**data, **{name: getattr(preset, name) for name in later}):
            return preset
        return spec


def _positive_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet, SXM4 80GB column: BF16/FP16 tensor 312 TFLOPS,
    # TF32 156 TFLOPS, FP32 19.5 TFLOPS, FP64 tensor 19.5 TFLOPS, HBM2e 2,039 GB/s.
    # Memory as 80 GiB: nvidia-smi reports 81920 MiB for this part.
    "a100-80g": DeviceSpec(
        name="a100-80g",
        peak_flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12,
                    "fp64": 19.5e12},
        memory_bytes=80 * GiB,
        memory_bandwidth=2.039e12,
        # host link: PCIe Gen4 x16 (A100 datasheet, "PCIe Gen4: 64 GB/s", both directions together),
        # 32 GB/s each way
        host_link_bytes_per_s=32e9,
        # 2020-21 software (Megatron-LM with apex kernels, attention unfused: its seq x seq scores
        # written, masked, softmaxed and dropped out in HBM): the pair fitted by
        # benchmarks/fit_efficiency.py to the five Megatron-LM runs of
        # benchmarks/published_configs.json (its errors, fitted and left-one-out, are its recorded run on
        # docs/benchmarks.md).
        # matmul 0.7 = 218 of 312 TFLOP/s; memory 0.35 lumps the unfused elementwise passes.
        efficiency=Efficiency(matmul=0.7, other=0.1, memory=0.35),
    ),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column, dense figures (the datasheet's
    # headline numbers are with sparsity, twice these): BF16/FP16 989 TFLOPS, FP8 1,979 TFLOPS,
    # TF32 494 TFLOPS, FP32 67 TFLOPS, FP64 tensor 67 TFLOPS, HBM3 3.35 TB/s.
    # Memory as 80 GiB, the same convention as the A100 (nvidia-smi shows slightly less, 81559 MiB).
    "h100-80g": DeviceSpec(
        name="h100-80g",
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494e12, "fp32": 67e12,
                    "fp64": 67e12},
        memory_bytes=80 * GiB,
        memory_bandwidth=3.35e12,
        # host link: PCIe Gen5 x16 (H100 datasheet, "PCIe Gen5: 128 GB/s", both directions together),
        # 64 GB/s each way
        host_link_bytes_per_s=64e9,
        # 2023-24 software (Megatron-Core / Transformer Engine, flash attention, fused norm, activation
        # and rotary kernels), the era of the published H100 runs. matmul 0.7: the A100's fraction kept
        # (no measured H100 GEMM figure is assumed; a calibration replaces it). memory 0.8: memory-bound
        # work runs as fused streaming kernels, which reach 80-90% of HBM peak (the low end taken);
        # 0.35 on the A100 lumped the unfused passes of 2021 software. Not fitted to the H100 rows of
        # benchmarks/published_runs.json; `--efficiency 0.7,0.1,0.35` there prices them with the A100's.
        efficiency=Efficiency(matmul=0.7, other=0.1, memory=0.8),
    ),
    # NVIDIA H200 datasheet, H200 SXM column: the H100 SXM's compute (same GH100 die and clocks),
    # 141 GB HBM3e at 4.8 TB/s. Memory as 140 GiB, what nvidia-smi reports (143771 MiB, about
    # 140.4 GiB), rather than 141 GiB, which would overstate it.
    "h200": DeviceSpec(
        name="h200",
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494e12, "fp32": 67e12,
                    "fp64": 67e12},
        memory_bytes=140 * GiB,
        memory_bandwidth=4.8e12,
        # host link: PCIe Gen5 x16 (H200 datasheet, "PCIe Gen5: 128GB/s"), 64 GB/s each way
        host_link_bytes_per_s=64e9,
        # the H100's kernels and software (same die): see there
        efficiency=Efficiency(matmul=0.7, other=0.1, memory=0.8),
    ),
    # NVIDIA B200 (Blackwell) as it ships in DGX B200 / HGX B200 (1,000 W), dense figures (the
    # datasheets' headline numbers are with 2:4 sparsity, twice these). HGX B200 platform page, 8-GPU
    # totals: BF16/FP16 36 PFLOPS, FP8 72 PFLOPS, TF32 18 PFLOPS (sparse), FP64 / FP64 tensor 296 TFLOPS,
    # FP32 600 TFLOPS; per GPU and dense: BF16 2,250, FP8 4,500, TF32 1,125, FP32 75, FP64 37 TFLOPS.
    # DGX B200 datasheet: 1,440 GB of HBM3e in all at 64 TB/s, i.e. 180 GB and 8 TB/s a GPU. Memory as
    # 179 GiB: nvidia-smi reports 183359 MiB for this part (not checked on a machine here).
    "b200": DeviceSpec(
        name="b200",
        peak_flops={"bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12, "tf32": 1125e12, "fp32": 75e12,
                    "fp64": 37e12},
        memory_bytes=179 * GiB,
        memory_bandwidth=8.0e12,
        # host link: PCIe Gen5 x16 to the DGX B200's Xeon hosts, 64 GB/s each way (as the H100's)
        host_link_bytes_per_s=64e9,
        # 2025 software (Megatron-Core / Transformer Engine on Blackwell): the H100's fractions kept, not
        # fitted to any B200 run (no bf16 dense B200 run with its configuration was found to fit them to)
        efficiency=Efficiency(matmul=0.7, other=0.1, memory=0.8),
    ),
    # A modest generic CPU, deliberately conservative: 0.5 TFLOP/s is roughly a 16-core AVX-512
    # server at sustained clocks; bf16 is given the same rate because most CPUs without AMX gain
    # nothing from it. 64 GiB of RAM, 100 GB/s (a few DDR4/DDR5 channels). Used for development
    # runs with gloo; the calibration step measures the real machine.
    "cpu": DeviceSpec(
        name="cpu",
        peak_flops={"fp32": 0.5e12, "bf16": 0.5e12, "fp16": 0.5e12, "fp64": 0.25e12},
        memory_bytes=64 * GiB,
        memory_bandwidth=100e9,
        # a CPU's "host" is its own memory: an offloaded activation is a copy within it, at its
        # bandwidth (read and written: half of it each way), and frees nothing (see plan_costs)
        host_link_bytes_per_s=50e9,
    ),
}

DEVICE_ALIASES = {"a100": "a100-80g", "h100": "h100-80g"}


def device_spec(name_or_spec: Union[str, DeviceSpec]) -> DeviceSpec:
    """A DeviceSpec as is, or the preset of that name (case-insensitive; 'a100', 'h100' accepted)."""
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if isinstance(name_or_spec, str):
        key = name_or_spec.strip().lower()
        key = DEVICE_ALIASES.get(key, key)
        if key in DEVICE_PRESETS:
            return DEVICE_PRESETS[key]
    raise InvalidValue(f"unknown device {name_or_spec!r}; presets are "
                     f"{', '.join(DEVICE_PRESETS)} (aliases: "
                     f"{', '.join(f'{a} -> {p}' for a, p in DEVICE_ALIASES.items())}), "
                     f"or pass a DeviceSpec")
