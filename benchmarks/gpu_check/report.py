"""The report's Markdown tables: the checks' errors and the timings."""


def markdown(report):
    lines = [f"GPU: {report['gpu']}; torch {report['torch']}; kernels built for "
             f"{report['arch']} by TVM {report['tvm']}.", "",
             "| kernel chain | worst error (max abs / max ref) | bf16 rounding floor | result |",
             "| --- | --- | --- | --- |"]
    for r in report["checks"]:
        if "error" in r:
            lines.append(f"| {r['entry']} | {r['error'][:200]} | | FAIL |")
        else:
            worst = max(r["errors"], key=r["errors"].get)
            lines.append(f"| {r['entry']} | {r['worst']:.2e} ({worst}) | {r['floor']:.1e} | "
                         f"{'pass' if r['pass'] else 'FAIL'} |")
    lines += ["", "| timing | TVM | PyTorch eager | torch.compile | other |",
              "| --- | --- | --- | --- | --- |"]
    for r in report["timing"]:
        if r["bench"] == "copy":
            lines.append(f"| device copy | | | | {r['GB/s']:.0f} GB/s |")
        elif r["bench"] == "decode":
            lines.append(f"| decode {r['family']} {r['shape']} | {r['tvm_ms']:.3f} ms "
                         f"({r['tvm_GB/s']:.0f} GB/s, {100 * r['share_of_copy_bw']:.0f}% of copy)"
                         f" | {r['eager_ms']:.3f} ms | "
                         f"{r.get('compiled_ms', float('nan')):.3f} ms | "
                         + (f"the CPU's kernel form: {r['cpu_kernel_ms']:.3f} ms "
                            f"({100 * r['cpu_kernel_share_of_copy_bw']:.0f}%)"
                            if "cpu_kernel_ms" in r else "") + " |")
        elif "tvm_ms" not in r:
            lines.append(f"| prefill {r['family']} | {r.get('error', '?')[:300]} | | | |")
        else:
            lines.append(f"| prefill {r['family']} {r['shape']} (chunk {r['chunk']}) | "
                         f"{r['tvm_ms']:.1f} ms | {r.get('torch_fp32_ms', float('nan')):.1f} ms "
                         f"(bf16 work {r.get('torch_bf16_ms', float('nan')):.1f}) | "
                         f"{r.get('torch_compiled_fp32_ms', float('nan')):.1f} ms | SDPA flash "
                         f"{r.get('sdpa_flash_ms', float('nan')):.1f} ms; TVM error "
                         f"{r.get('tvm_rel_err_vs_float64', float('nan')):.1e} |")
            lines.append(f"| (prefill kernels, ms) | {r['tvm_kernels_ms']} | | | |")
            for name, v in r.get("variants", {}).items():
                lines.append(f"| (schedule variant {name}) | "
                             + (f"{v['tvm_ms']:.1f} ms (output differs from the default's by "
                                f"{v.get('rel_diff_vs_default', float('nan')):.1e}) "
                                if "tvm_ms" in v else "") + v.get("error", "")[:200] + " | | | |")
            if "error" in r:
                lines.append(f"| (then failed) | {r['error'][:300]} | | | |")
    return "\n".join(lines) + "\n"
