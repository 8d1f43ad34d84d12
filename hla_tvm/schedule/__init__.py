"""Schedules of the HLA kernels and of the other functions of a compiled model.

    rules/cpu, rules/cuda    the default rules per target kind, dlight ScheduleRules (one
                             interface: apply(func, target, tunable)), one rule class a module
    steps/cpu, steps/cuda    the steps of the HLA kernels' rules, one per module
    gpu_limits               what fits a GPU: scheduled kernels checked against its limits
    tuning/                  tuned records (`records`), the tuner (`tune`), a compiled model's
                             tunable functions (`model`)
    shapes                   the shapes kernels are specialized to (tuning, records, GPU limits)
    common                   what the rules share

`default_rules(target)` gives a kernel's default schedule for the target's kind;
`schedule_module` applies it to every kernel not scheduled from a tuned record (`TUNED`);
`register_intrinsics` registers the tensor intrinsics that the rules (and so the records'
traces) name."""
from __future__ import annotations

TUNED = "hla_tvm.tuned"   # attribute of a function already scheduled from a tuned record


def default_rules(target):
    """The default schedule of an HLA kernel for the target's kind, (func, target) -> func:
    `rules.cpu.scheduled` for llvm, `rules.cuda.scheduled` for cuda (each applies its
    `HLAKernels` rule, remembered per process)."""
    # the rules and TVM are imported where used: build (and so backend, which runs with the TVM
    # runtime alone) imports this package
    from .rules import cpu, cuda

    rules = {"llvm": cpu.scheduled, "cuda": cuda.scheduled}.get(target.kind.name)
    if rules is None:
        raise NotImplementedError(f"no default schedule for target kind {target.kind.name!r} yet")
    return rules


def register_intrinsics():
    """Register the project's TVM tensor intrinsics (`steps.cpu.bf16_dot`), once a process.
    meta_schedule parses every trace of a records database when it opens one, and a trace that
    tensorizes with an intrinsic not registered yet fails the whole database, so whatever opens
    records calls this first."""
    from .steps.cpu import bf16_dot

    bf16_dot.register()


def schedule_module(mod, target):
    """Apply `default_rules(target)` to every function of `mod` that is not scheduled from a
    tuned record already."""
    import tvm

    rules = default_rules(target)
    return tvm.IRModule({gv: mod[gv] if mod[gv].attrs and TUNED in mod[gv].attrs
                         else rules(mod[gv], target) for gv in mod.get_global_vars()})
