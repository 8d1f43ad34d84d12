"""bfloat16 products in pairs (`ops.common.pairs`, vdpbf16ps through `schedule.steps.cpu.bf16_dot`):
the rounding of the packing against PyTorch's float32 -> bfloat16 conversion, the pair form
of K^T K against float64 on every x86 CPU (vdpbf16ps where the host has AVX512-BF16, plain
vector code elsewhere), and which targets get the option."""
import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")
from tvm.script import tirx as T  # noqa: E402

from hla_tvm.ops import chains  # noqa: E402
from hla_tvm.ops.common import pairs  # noqa: E402
from hla_tvm.ops.hla2 import kernels  # noqa: E402

# the fast subset: all but the records loaded in a fresh process (a child compiles)
FAST = {
    "test_pack_rounds_to_nearest_even",
    "test_ksummary_pairs_against_float64",
    "test_target_options",
    "test_hla_bfloat16_against_float64",
}
from hla_tvm.schedule.rules import cpu  # noqa: E402
from hla_tvm.target import resolve  # noqa: E402


def _host_x86():
    import platform

    return platform.machine() in ("x86_64", "AMD64")


def test_pack_rounds_to_nearest_even():
    """bits() is the bfloat16 nearest a float32, ties to even: PyTorch's conversion."""
    @T.prim_func(s_tir=True)
    def pack(x: T.Buffer((1, 1, 1, 64, 8), "float32"), p: T.Buffer((1, 1, 1, 32, 8), "uint32")):
        for b, h, c in T.grid(1, 1, 1):
            pairs.pack(p, x, b, h, c, 32, 8, "p")

    fn = tvm.compile(tvm.IRModule({"main": pack}), target=resolve(None))["main"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 1, 64, 8, generator=gen) * 10
    # ties: the low 16 bits exactly 0x8000, with even and odd bfloat16 below them
    bits = x.view(torch.int32)
    bits[..., :4, :] = (bits[..., :4, :] & ~0xFFFF) | 0x8000
    p = torch.zeros(1, 1, 1, 32, 8, dtype=torch.int32)
    fn(x, p.view(torch.uint32))
    want = x.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF
    got_lo, got_hi = p & 0xFFFF, (p >> 16) & 0xFFFF
    assert torch.equal(got_lo, want[..., 0::2, :])
    assert torch.equal(got_hi, want[..., 1::2, :])


@pytest.mark.skipif(not _host_x86(), reason="the pair products are an x86 schedule")
@pytest.mark.parametrize("T_len", [64, 45])
@pytest.mark.parametrize("where", ["host", "x86-64"])
def test_ksummary_pairs_against_float64(T_len, where):
    """dS = K^T K per chunk over token pairs equals the float64 product of the same bfloat16
    numbers (a short last chunk is zero past T), on this CPU and as baseline x86-64 code (no
    vdpbf16ps: the pairs' plain vector form)."""
    dk, n = 32, 16
    func = kernels.chunk_ksummary(dk, n, dtype="bfloat16", bf16_products=True)
    target = resolve(None if where == "host" else where)
    mod = tvm.compile(tvm.IRModule({"main": cpu.scheduled(func, target)}), target=target)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(2, 3, T_len, dk, generator=gen).bfloat16()
    nc = -(-T_len // n)
    dS = torch.zeros(2, 3, nc, dk, dk)
    mod["main"](k, dS)
    kp = torch.zeros(2, 3, nc * n, dk, dtype=torch.float64)
    kp[:, :, :T_len] = k.double()
    kc = kp.view(2, 3, nc, n, dk)
    want = kc.transpose(-1, -2) @ kc
    assert (dS.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert ("vdpbf16ps" in mod.mod.inspect_source("asm")) == pairs.available(target)


def test_target_options():
    """bf16_products only for bfloat16 prefills on LLVM CPUs with AVX512-BF16; GPUs keep their
    decode options."""
    prefill = chains.prefill("hla2")
    zen4 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4"})
    zen3 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver3"})
    assert chains.target_options(prefill, zen4, "bfloat16") == {"bf16_products": True}
    assert chains.target_options(prefill, zen4, "float32") == {}
    assert chains.target_options(prefill, zen3, "bfloat16") == {}
    assert chains.target_options(prefill, resolve("x86-64"), "bfloat16") == {}
    assert chains.target_options(prefill, resolve("aarch64"), "bfloat16") == {}
    assert chains.target_options(chains.prefill("hla2_decay"), zen4, "bfloat16") == {}
    decode = chains.decode("hla2_decay")
    assert chains.target_options(decode, zen4, "bfloat16") == {}
    assert chains.target_options(decode, resolve("cuda"), "float32") == {"columns": True}


@pytest.mark.skipif(not _host_x86(), reason="the pair products are an x86 schedule")
def test_hla_bfloat16_against_float64():
    """hla() on bfloat16 inputs (pair products where the host has AVX512-BF16) against the
    float64 quadratic form of the same numbers."""
    from hla_tvm import hla
    from hla_tvm.ops.hla2 import reference as ref

    gen = torch.Generator().manual_seed(2)
    q, k, v = [(torch.randn(1, 2, 83, 32, generator=gen) / 4).bfloat16() for _ in range(3)]
    out = hla(q, k, v, chunk_size=16)
    want = ref.quadratic(q.double(), k.double(), v.double())
    err = (out.double() - want).abs().max() / want.abs().max()
    assert float(err) <= 2e-2
    assert np.isfinite(out.float().numpy()).all()


def test_records_that_tensorize_load_in_a_fresh_process(tmp_path):
    """A records folder whose trace tensorizes with vdpbf16ps (a bfloat16 prefill tuned for an
    AVX512-BF16 CPU) opens in a process that has scheduled nothing yet, and its trace replays:
    meta_schedule parses every trace when it opens a database, which failed on the intrinsic
    before it was registered."""
    import os
    import subprocess
    import sys

    from tvm.s_tir import meta_schedule as ms

    from hla_tvm import ops
    from hla_tvm.schedule.tuning import records, tune

    zen4 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver4",
                              "num-cores": 2})
    op = ops.get(2, False)
    kernels_at = tune.operator_kernels(op, decayed=False, dk=64, dv=64, chunk=64,
                                       dtype=torch.bfloat16, target=zen4,
                                       **op.options(masked=True, normalize=False, eps=1e-6,
                                                    ridge=0.0))
    name = next(n for n in kernels_at if "ksummary" in n)
    wl = records.workload(*kernels_at[name])
    sch = tune.default_schedule(wl, zen4)
    assert "tensorize" in str(sch.trace)
    db = ms.database.JSONDatabase(*(str(tmp_path / f) for f in records.FILES))
    db.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, db.commit_workload(wl), [1e-3], zen4,
        ms.arg_info.ArgInfo.from_prim_func(wl["main"])))
    script = (
        "import sys, torch, tvm; from hla_tvm import ops\n"
        "from hla_tvm.schedule.tuning import records, tune\n"
        "target = tvm.target.Target({'kind': 'llvm', 'mtriple': 'x86_64-linux-gnu', "
        "'mcpu': 'znver4', 'num-cores': 2})\n"
        "db = records.load(sys.argv[1])\n"
        "op = ops.get(2, False)\n"
        "ks = tune.operator_kernels(op, decayed=False, dk=64, dv=64, chunk=64, "
        "dtype=torch.bfloat16, target=target, **op.options(masked=True, normalize=False, "
        "eps=1e-6, ridge=0.0))\n"
        f"func = records.tuned(*ks[{name!r}], db, target)\n"
        "print('hla_tvm_dpbf16' in func.script())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
