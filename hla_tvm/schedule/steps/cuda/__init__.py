"""CUDA steps of `rules.cuda.hla_kernels.HLAKernels` (docs/cuda.md has their table): scan_lanes,
shared_scratch (and its hoist), inline_scratch, block_per_outer, thread_stages, stage_syncs."""
