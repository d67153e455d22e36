"""GPU kernels of specserve (Triton); each subpackage owns one kernel, its reference and configs."""
