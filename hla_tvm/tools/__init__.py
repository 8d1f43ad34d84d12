"""Tools for checking the kernels where their target is missing: the CUDA emulator
(`cuda_emulator`, used by `benchmarks/gpu_check emulate` and the tests)."""
