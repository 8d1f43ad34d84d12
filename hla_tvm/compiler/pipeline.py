"""The compile pipeline in order, one place: `prepare` (the Relax passes of `passes/`, then
`legalize` and the prefill marks), the HLA kernels' schedules (`schedule.tuning.model`), then
`lowering_pipeline` (default schedules for the rest, TVM's lowering); `cpu_pipeline` is
all of it for a CPU with default schedules."""
from __future__ import annotations


def prepare(mod, target, quantize=None):
    """The Relax module of `to_relax` (or the ONNX importer) in the form whose functions are
    scheduled: embedding lookups clamped (`safe_take`), one-sided integer clamps bounded
    (`int_clip`), RMSNorms as one operator each (`fused_rms_norm`), the other small whole
    powers as products (`int_power`, after the norms it would hide), projection scales next to
    their products (`scale_epilogue`), the products of one input with several weights one
    product (`parallel_products`), the weights stored as the kernels read them
    (`pack_weights`: packed under `quantize`, a `quant.Scheme`, and in panels on CPUs), slices
    that provably lie within their input marked so (`inbound_slices`), then `legalize`d, the
    functions only a prefill runs marked (`prefill_rows`). Returns the module, or (module, the
    packing's report) when `quantize` is given."""
    # the passes, TVM and the schedule rules are imported where used: the package (which imports
    # without TVM) imports this module
    from .passes.fused_rms_norm import fused_rms_norm
    from .passes.inbound_slices import inbound_slices
    from .passes.int_clip import int_clip
    from .passes.int_power import int_power
    from .passes.pack_weights import pack_weights
    from .passes.parallel_products import parallel_products
    from .passes.prefill_rows import mark_prefill_kernels
    from .passes.safe_take import safe_take
    from .passes.scale_epilogue import scale_epilogue

    mod = scale_epilogue(int_power(fused_rms_norm(int_clip(safe_take(mod)))))
    mod = parallel_products(mod)
    mod, report = pack_weights(mod, quantize, target)
    mod = mark_prefill_kernels(legalize(inbound_slices(mod), target))
    return mod if quantize is None else (mod, report)


def legalize(mod, target):
    """`mod` with its Relax operators lowered to TensorIR functions and fused (TVM's generic
    library-dispatch and legalization passes; on CPUs a float32 sigmoid through `fast_exp`,
    `compiler.passes.fast_sigmoid`), the form whose functions are scheduled. (TVM's
    CUDA legalization is the same plus dlight's schedules, which `lowering_pipeline` applies
    after the HLA kernels are scheduled.)"""
    import tvm
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from .passes.fast_sigmoid import LEGALIZE

    # (on CPUs; TVM's own LegalizeOps after it finds nothing left)
    fast = [relax.transform.LegalizeOps(LEGALIZE)] if target.kind.name == "llvm" else []
    with target:
        return tvm.transform.Sequential(cpu.library_dispatch_passes(target) + fast
                                        + cpu.legalize_passes(target))(mod)


def lowering_pipeline(target):
    """The Relax pipeline after `legalize` and `schedule.tuning.model.schedule_model`: default
    schedules for the functions not scheduled yet, then TVM's lowering and finalization passes
    for the target's kind. CPU: `GroupMatvec` for a decode step's int8 / int4 products,
    `MatmulTiles` for x @ W[K, N] with its epilogue, `SerialSmall` for small static functions,
    dlight's CPU GEMV and reduction rules, then `ParallelFallback`; CUDA: dlight's GPU rules
    (Matmul, GEMV, Reduction, GeneralReduction, Fallback)."""
    import tvm
    from tvm.s_tir import dlight as dl

    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as passes

        return tvm.transform.Sequential(
            [cuda_default_schedules()]
            + passes.dataflow_lower_passes(target) + passes.finalize_passes(target))
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from ..schedule.rules.cpu import GroupMatvec, MatmulTiles, ParallelFallback, SerialSmall

    return tvm.transform.Sequential(
        [dl.ApplyDefaultSchedule(GroupMatvec(), MatmulTiles(), SerialSmall(), dl.cpu.GEMV(),
                                 dl.cpu.Reduction(),
                                 ParallelFallback())]
        + cpu.dataflow_lower_passes(target) + cpu.finalize_passes(target))


def cuda_default_schedules():
    """The pass giving a CUDA module's functions not scheduled yet (its projections, quantized
    or not, norms, element-wise work) dlight's GPU rules: Matmul, GEMV, Reduction,
    GeneralReduction, Fallback (inside `with target`)."""
    from tvm.s_tir import dlight as dl

    return dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                   dl.gpu.GeneralReduction(), dl.gpu.Fallback())


def cpu_pipeline(target):
    """The whole CPU Relax pipeline with default schedules: `legalize`, the HLA kernels'
    default rules (`schedule.tuning.model.schedule_model`), then `lowering_pipeline`."""
    import tvm

    from ..schedule.tuning.model import schedule_model

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod, _ctx):
        mod = schedule_model(legalize(mod, target), target)[0]
        with target:
            return lowering_pipeline(target)(mod)

    return _pipeline
