"""pytest plugin (-p benchmarks.gpu.gpu_only_tests): keep only the tests that skip without a
GPU, i.e. those with a skipif marker whose reason names a GPU or CUDA ("needs a CUDA GPU",
"flash-attn needs a GPU ..."), so a GPU machine runs exactly what CPU CI cannot. New GPU
tests join by saying so in their skip reason."""
import re

GPU = re.compile(r"\b(GPUs?|CUDA)\b", re.IGNORECASE)


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        reasons = [m.kwargs.get("reason", "") for m in item.iter_markers("skipif")]
        (keep if any(GPU.search(str(r)) for r in reasons) else drop).append(item)
    items[:] = keep
    if drop:
        config.hook.pytest_deselected(items=drop)
