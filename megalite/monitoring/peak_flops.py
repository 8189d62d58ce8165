"""Dense peak FLOP/s per device and compute dtype, for model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per device / the device's dense peak for the dtype the
matmuls run in (Chowdhery et al. 2022, PaLM appendix B). NVIDIA's datasheets list tensor
core rates "with sparsity" (2:4 structured), twice the dense rate; dividing by those
(the 1,979 TFLOP/s of an H100 instead of 989) halves the MFU a run reports. Every entry
below is the dense rate, in TFLOP/s: half the datasheet's "with sparsity" figure where the
datasheet prints only that, its source beside it.

`--peak-tflops` (megalite's own flag) overrides the table, for a device not in it or a
clock that differs from the datasheet's.
"""

import re

import torch

from megalite.config import DTYPE_NAMES

# (pattern in torch.cuda.get_device_name, table key), searched in order: the first match wins,
# so a variant ("H200 NVL", "GB200") comes before the family name it contains.
DEVICE_PATTERNS = [
    (r"H100 NVL", "H100 NVL"), (r"H100.*PCIe", "H100 PCIe"), (r"H100", "H100 SXM"),
    (r"\bH200 NVL", "H200 NVL"), (r"H200", "H200"),
    (r"A100", "A100"), (r"L40S", "L40S"), (r"\bL4\b", "L4"), (r"\bA10\b", "A10"),
    (r"V100S", "V100S PCIe"), (r"V100-PCIE", "V100 PCIe"), (r"V100", "V100"),
    (r"GB200", "GB200"), (r"B200", "B200"),
    (r"MI300X", "MI300X"),
]

# Dense TFLOP/s: bf16 and fp16 tensor cores, TF32 tensor cores, plain FP32.
PEAK_TFLOPS = {
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): SXM 1,979 / 989 sparse.
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): the H100 SXM's compute.
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    # The same datasheet, H200 NVL column: 1,671 / 835 sparse, FP32 60 (the H100 NVL's).
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): dense figures printed;
    # the same for 40 and 80 GB, SXM and PCIe.
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    # NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): 733 / 366 sparse.
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    # NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4): 242 / 120 sparse.
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    # NVIDIA A10 datasheet (nvidia.com/en-us/data-center/products/a10-gpu): 250 / 125 sparse.
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    # NVIDIA V100 datasheet (SXM2): no bf16 or TF32 tensor cores.
    "V100": {"fp16": 125.0, "fp32": 15.7},
    # The same datasheet's PCIe columns.
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
    "V100S PCIe": {"fp16": 130.0, "fp32": 16.4},
    # NVIDIA HGX B200 (nvidia.com/en-us/data-center/hgx), per GPU: 4.5 PF / 2.2 PF sparse.
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    # NVIDIA GB200 NVL72 (nvidia.com/en-us/data-center/gb200-nvl72), per GPU (a superchip
    # holds 2): 10 PF / 5 PF sparse, FP32 160 TF per superchip.
    "GB200": {"bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0, "fp32": 80.0},
    # AMD Instinct MI300X data sheet (amd.com): 2,614.9 / 1,307.4 sparse.
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
}


def compute_dtype(dtype: torch.dtype) -> str:
    """The table's name of the dtype the matmuls run in, `dtype`: fp32 ones use TF32 tensor
    cores unless PyTorch's float32 matmul precision is "highest" (megalite sets "high" on
    CUDA: initialize.py)."""
    if dtype != torch.float32:
        return DTYPE_NAMES[dtype]
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def device_key(device_name: str) -> str | None:
    return next((key for pattern, key in DEVICE_PATTERNS if re.search(pattern, device_name)),
                None)


def device_name(device: torch.device) -> str | None:
    """The GPU's marketing name ("NVIDIA H100 80GB HBM3"); None on a CPU."""
    # gpu_check: mfu_table
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def peak_tflops(device: torch.device, dtype: str, override: float | None = None) -> float | None:
    """The dense peak TFLOP/s to divide by: `override` (--peak-tflops) if given, else the
    table's entry for the device; None on a CPU or a device or dtype the table does not
    list (no MFU then)."""
    if override is not None:
        return override
    name = device_name(device)
    key = device_key(name) if name else None
    return PEAK_TFLOPS[key].get(dtype) if key else None


def mfu_percent(tflops_per_gpu: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation in percent: achieved TFLOP/s per device over its dense peak."""
    return 100.0 * tflops_per_gpu / peak_tflops
