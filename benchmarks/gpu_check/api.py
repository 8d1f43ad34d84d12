"""`api` (on a GPU machine with TVM's compiler): `hla()` and `decode_()` on CUDA tensors
against the float64 reference."""
import json
import os
import time

from .checks import rel_err, tolerance


def api(args):
    """`hla_tvm.hla` and `decode_` on CUDA tensors, compiled on this machine (needs TVM's
    compiler here, unlike `run`), against the float64 reference: every operator, with and
    without decay, float32 and bfloat16, grouped heads, a prefill then a decode step."""
    import torch

    import hla_tvm
    from hla_tvm import ops

    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.init()   # loads libcudart, which TVM's CUDA runtime links to
    rows = []
    cases = [(2, False, None, torch.float32, 1), (2, False, 0.95, torch.bfloat16, 2),
             (2, True, None, torch.float32, 2), (3, False, 0.95, torch.float32, 1)]
    for order, asym, decay, dtype, group in cases:
        op = ops.get(order, asym)
        name = f"{op.name} decay={decay} {str(dtype)[6:]} group={group}"
        t0 = time.time()
        try:
            g = torch.Generator(device=dev).manual_seed(len(rows))
            B, H, T, d = 2, 4, 100, 64
            mk = lambda h, t: (torch.randn(B, h, t, d, device=dev, generator=g)  # noqa: E731
                               * 0.5).to(dtype)
            q, k, v = mk(H, T + 1), mk(H // group, T + 1), mk(H // group, T + 1)
            o, st = hla_tvm.hla(q[:, :, :T], k[:, :, :T], v[:, :, :T], order=order,
                                asymmetric=asym, decay=decay, return_state=True)
            o1 = hla_tvm.decode_(q[:, :, T], k[:, :, T], v[:, :, T], st, order=order,
                                 asymmetric=asym, decay=decay)
            kf, vf = (x.double().repeat_interleave(group, 1) for x in (k, v))
            ref, rst = op.ref.serial(q.double(), kf, vf, decay=decay)
            err = max(rel_err(o, ref[:, :, :T]), rel_err(o1, ref[:, :, T]))
            floor = rel_err(ref.to(dtype), ref)
            for n, x in st.items():
                want = rst[n][:, ::group] if n in op.kv_state else rst[n]
                err = max(err, rel_err(x, want))
            rows.append({"case": name, "error": err, "floor": floor, "device": str(o.device),
                         "pass": err <= tolerance(str(dtype)[6:]) + floor,
                         "seconds": round(time.time() - t0, 1)})
        except Exception as err:
            rows.append({"case": name, "fail": f"{type(err).__name__}: {err}"[:500],
                         "pass": False})
        print(json.dumps(rows[-1]), flush=True)
    ok = sum(r["pass"] for r in rows)
    print(f"hla()/decode_() on {dev} tensors: {ok} of {len(rows)} cases pass", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "api.json"), "w") as f:
        json.dump(rows, f, indent=1)
