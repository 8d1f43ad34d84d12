"""Fast PyTorch forms of the operators (batched, in-place where the state is updated): the
baseline the compiled kernels are measured against, checked like them against the float64
references in `hla_tvm.reference`, which stay written to be read."""
