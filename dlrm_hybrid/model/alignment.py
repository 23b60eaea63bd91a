"""The widths the dense matmuls read, padded with zero columns to a multiple of ALIGN elements.

A bf16/fp16 row of a multiple of 8 elements is 16-byte aligned, which cuBLAS's tensor-core GEMMs
need for their fast kernels; NVIDIA's DLRM pads its interaction output for the same reason (479
-> 480 on the Criteo 1TB model). Torch-free, so the planner's dense memory model reads it too.
"""

ALIGN = 8


def aligned(width: int) -> int:
    """`width` rounded up to a multiple of ALIGN."""
    return -(-width // ALIGN) * ALIGN
