"""The Relax passes of the compile pipeline (`compiler.pipeline.prepare` runs them in order), one
per module: safe_take, int_clip, fused_rms_norm, int_power, scale_epilogue, parallel_products,
pack_weights, inbound_slices, prefill_rows (after legalizing), and fast_sigmoid (the
legalization of a float32 sigmoid); flat_matmul and shape_bounds run inside the importer
(`compiler.torch_export`); call_rewrite is what several of them share."""
