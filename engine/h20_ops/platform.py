"""What the ops need to know about the platform they run on: Triton's interpreter, the CUDA device's
SM count and compute capability, programmatic dependent launch, the interpreter's numpy bound."""

import functools

import torch


def triton_interprets() -> bool:
    """Whether Triton runs its kernels under the CPU interpreter, as Triton itself reads
    TRITON_INTERPRET (1, true, yes or on, any case): the launch code must agree with how the
    kernels were built."""
    import triton  # here, not at the top: engine.ops imports this package and works without Triton

    return bool(triton.knobs.runtime.interpret)


DEFAULT_SM_COUNT = 132  # H100/H200: what grids and splits are sized for without a CUDA device


@functools.cache
def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (persistent grids and decode splits are sized by it); DEFAULT_SM_COUNT
    for any other device (the Triton interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SM_COUNT


@functools.cache
def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for any other device (asked before every launch: cached)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on this device use programmatic dependent launch (SM90+): a kernel launched with
    it may start while the previous kernel of its stream finishes, and waits for that kernel
    (griddepcontrol.wait) before its first global memory access."""
    capability = cuda_capability(device)
    return capability is not None and capability[0] >= 9


def require_interpretable_numpy(kernel: str) -> None:
    """Before a kernel with a runtime-bounded loop runs under Triton's interpreter: triton 3.6's
    interpreter turns such a bound into int() of a 1-element array, which numpy >= 2.4 rejects deep
    inside it ("only 0-dimensional arrays can be converted"); pyproject's `interpreter` extra pins
    numpy < 2.4. Raises RuntimeError naming the kernel and the installed numpy."""
    import numpy

    if numpy.lib.NumpyVersion(numpy.__version__) >= "2.4.0":
        raise RuntimeError(f"{kernel}: Triton's interpreter (TRITON_INTERPRET=1, triton 3.6) needs numpy < 2.4 for "
                           f"this kernel's runtime-bounded loop, found numpy {numpy.__version__} "
                           f"(pip install 'numpy<2.4', or the project's `interpreter` extra)")
