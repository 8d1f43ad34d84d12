"""The default schedule rules of the HLA kernels, one per module: `cpu` (llvm targets) and
`cuda` (NVIDIA GPUs); `hla_tvm.schedule.default_rules` picks them by the target's kind."""
