"""The kernel checks on the GPU: a bundle's modules (`Kernels`), each configuration's prefill
and decode steps against the float64 reference (`check_entry`, `judged`), and the worker
process `run` starts for each family (`worker_checks`)."""
import json
import os
import time

from .bundle import load_runtime
from .entries import OPERATOR, OPTS, entry_id


class Kernels:
    """A bundle's modules, loaded on first use: functions(entry id) -> (entry, chain, [fn])."""

    def __init__(self, bundle):
        self.bundle = bundle
        self.ffi = load_runtime(bundle)
        self.manifest = json.load(open(os.path.join(bundle, "manifest.json")))
        self._mods = {}

    def functions(self, eid):
        from hla_tvm.ops import chains

        e = self.manifest["entries"][eid]
        chain = (chains.decode if e["phase"] == "decode" else chains.prefill)(e["family"])
        if eid not in self._mods:
            self._mods[eid] = self.ffi.load_module(os.path.join(self.bundle, e["module"]))
        mod = self._mods[eid]
        return e, chain, [mod[chains.kernel_name(chain, c, e["d"], e["d"], e["group"])]
                          for c in chain.calls]

    def synchronize(self):
        import torch

        torch.cuda.synchronize()

    def run(self, eid, env, out):
        """Run entry eid's chain on torch CUDA tensors (env as `backend.run_chain` takes it)."""
        from hla_tvm import backend

        e, chain, fns = self.functions(eid)
        with self.ffi.use_torch_stream():
            backend.run_chain(chain, fns, env, out, e["chunk"] or 1)
        return out


def rel_err(x, ref):
    """max |x - ref| / max |ref| (0 when both vanish)."""
    x, ref = x.double(), ref.double()
    scale = ref.abs().max().item()
    return (x - ref).abs().max().item() / (scale or 1.0)


def random_qkv(B, H, Hkv, T, d, dtype, seed, device="cuda"):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h: (torch.randn(B, h, T, d, device=device, generator=g)  # noqa: E731
                    * 0.5).to(dtype)
    return mk(H), mk(Hkv), mk(Hkv)


def check_entry(kern, fam, dtype_name, d, group, normalize, seed=0, device="cuda"):
    """Rows comparing the prefill (from a nonzero state) and three decode steps of one
    configuration with the float64 reference on the GPU."""
    import torch

    from hla_tvm.ops import OPERATORS
    from hla_tvm.ops.chains import operator_of

    dtype = getattr(torch, dtype_name)
    ref = operator_of(fam).ref
    op = OPERATORS[OPERATOR[fam]]
    B, H, T, T0 = 2, 4, 150, 37
    Hkv = H // group
    opts = dict(OPTS[fam], normalize=normalize, eps=1e-6)
    decay = None if fam == "hla2" else torch.linspace(
        0.85, 0.99, Hkv, device=device, dtype=torch.float64).repeat_interleave(group)
    q, k, v = random_qkv(B, H, Hkv, T0 + T + 3, d, dtype, seed, device)
    kf, vf = (x.double().repeat_interleave(group, 1) for x in (k, v))
    qf = q.double()
    # the reference: a first segment gives a nonzero state, then the checked tokens
    _, st0 = ref.serial(qf[:, :, :T0], kf[:, :, :T0], vf[:, :, :T0], decay=decay, **opts)
    o_ref, st1 = ref.serial(qf[:, :, T0:T0 + T], kf[:, :, T0:T0 + T], vf[:, :, T0:T0 + T],
                            decay=decay, state={n: x.clone() for n, x in st0.items()}, **opts)
    rows = []
    pid = entry_id(fam, "prefill", dtype_name, d, group, normalize)
    gamma = (torch.ones(H, device=device) if decay is None else decay.float()).contiguous()
    state = {n: (x[:, ::group] if n in op.kv_state else x).float().contiguous()
             for n, x in st0.items()}
    env = {"q": q[:, :, T0:T0 + T].contiguous(), "k": k[:, :, T0:T0 + T].contiguous(),
           "v": v[:, :, T0:T0 + T].contiguous(), "gamma": gamma, **state}
    # scratch and output start as NaN: a kernel reading an element no kernel wrote shows up
    # (fresh GPU memory is zeros, which can hide it)
    from hla_tvm import backend

    backend._SCRATCH.buf = torch.full((1 << 24,), float("nan"), device=device)
    out = torch.full((B, H, T, d), float("nan"), dtype=dtype, device=device)
    kern.run(pid, env, out)
    kern.synchronize()
    errs = {"o": rel_err(out, o_ref)}
    for n, x in state.items():
        errs[n] = rel_err(x, st1[n][:, ::group] if n in op.kv_state else st1[n])
    rows.append({"entry": pid, "errors": errs, "floor": rel_err(o_ref.to(dtype), o_ref)})
    # decode: three tokens from the reference's state (every entry with the query heads; k, v
    # with the key/value heads)
    did = entry_id("hla2_decay" if fam == "hla2" else fam, "decode", dtype_name, d, group,
                   normalize)
    st = {n: x.float().contiguous() for n, x in st1.items()}
    rst = {n: x.clone() for n, x in st1.items()}
    errs, floor = {}, 0.0
    for t in range(T0 + T, T0 + T + 3):
        o = torch.empty(B, H, 1, d, dtype=dtype, device=device)
        kern.run(did, {"q": q[:, :, t:t + 1].contiguous(), "k": k[:, :, t:t + 1].contiguous(),
                       "v": v[:, :, t:t + 1].contiguous(), "gamma": gamma, **st}, o)
        o_r, rst = ref.step(qf[:, :, t], kf[:, :, t], vf[:, :, t], rst, decay=decay, **opts)
        kern.synchronize()
        errs["o"] = max(errs.get("o", 0.0), rel_err(o[:, :, 0], o_r))
        floor = max(floor, rel_err(o_r.to(dtype), o_r))
    for n in st:
        errs[n] = rel_err(st[n], rst[n])
    rows.append({"entry": did, "errors": errs, "floor": floor})
    return rows


def tolerance(dtype_name):
    """The issue's bound: 1e-4 for float32, 1e-3 for bfloat16, above the error of rounding the
    exact output to the output dtype (`floor`; output elements are rounded, the bound is on
    max |error| / max |reference|)."""
    return 1e-4 if dtype_name == "float32" else 1e-3


def judged(kern, fam, dtype, d, group, normalize, device="cuda"):
    """`check_entry`'s rows with "worst" and "pass" (within `tolerance`), or one failed row
    with the error that stopped it."""
    t0 = time.time()
    try:
        rows = check_entry(kern, fam, dtype, d, group, normalize, device=device)
        for r in rows:
            r["worst"] = max(r["errors"].values())
            r["pass"] = r["worst"] <= tolerance(dtype) + r["floor"]
    except Exception as err:   # a failed configuration is reported; the rest still run
        rows = [{"entry": entry_id(fam, "prefill", dtype, d, group, normalize),
                 "error": f"{type(err).__name__}: {err}"[:600], "pass": False}]
    for r in rows:
        r["seconds"] = round(time.time() - t0, 2)
    return rows


def worker_checks(args):
    kern = Kernels(args.bundle)
    results = []
    for spec in args.checks.split(";"):
        fam, dtype, d, group, normalize = spec.split(",")
        rows = judged(kern, fam, dtype, int(d), int(group), normalize == "1")
        for r in rows:
            print(json.dumps(r), flush=True)
        results += rows
    with open(args.result, "w") as f:
        json.dump(results, f)
