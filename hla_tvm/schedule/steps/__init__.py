"""The steps of the HLA kernels' default rules (`schedule.rules.{cpu,cuda}.hla_kernels`), one per
module, per target kind: `cpu` and `cuda`. A step takes an `s_tir.Schedule` and changes it in
place; the rule decides their order."""
