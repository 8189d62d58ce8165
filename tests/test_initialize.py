"""Process start-up choices that do not need a GPU to check."""

import torch

from megalite.initialize import allow_tf32


def test_tf32_only_for_cuda_devices():
    """fp32 matmuls go to TF32 on CUDA (as in NVIDIA's containers), never on the CPU."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        allow_tf32(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"
        allow_tf32(torch.device("cuda", 0))  # a device object needs no GPU
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
