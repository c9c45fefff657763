import pytest
import torch

import engine.h20_ops  # noqa: F401  (sets TRITON_INTERPRET=1 before any kernel module on CPU-only machines)

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
