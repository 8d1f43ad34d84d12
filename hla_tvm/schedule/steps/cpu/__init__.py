"""CPU steps of `rules.cpu.hla_kernels.HLAKernels`, in the order it runs them:

    parallel_outer     the independent outer loops fused and run in parallel
    chunk_gemm         register-tiled micro-kernels for the GEMM-shaped blocks (bf16_dot: the
                       vdpbf16ps tensor intrinsic of pair products)
    vectorize_inner    the innermost data-parallel loop of the rest vectorized"""
