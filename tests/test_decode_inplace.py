"""`decode_`: one token, the state advanced in place, for every operator (decay, grouped heads,
half precision), against float64 serial recurrences; its argument checks; `init_state`."""
import pytest
import torch
from conftest import make_qkv, rel_err

from hla_tvm import decode_, hla, init_state
from hla_tvm.ops.ahla import reference as ahla
from hla_tvm.ops.hla2 import reference as hla2
from hla_tvm.ops.hla3 import reference as hla3

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_decode_inplace_matches_serial[hla2-0.9-True-3-float32]",
    "test_decode_inplace_matches_serial[ahla-per-head-False-1-float32]",
    "test_decode_inplace_matches_serial[hla3-None-True-1-float32]",
}

OPS = {"hla2": (hla2, dict()), "hla2_unmasked_ridge": (hla2, dict(masked=False, ridge=0.3)),
       "ahla": (ahla, dict(asymmetric=True)), "hla3": (hla3, dict(order=3))}
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float64: 1e-9}
KV = {"hla2": ("S",), "ahla": ("P", "m"), "hla3": ("S", "P", "m")}
B, H, DK, DV, STEPS = 2, 6, 8, 4, 12

CASES = [(op, decay, normalize, group, torch.float32) for op in OPS
         for decay in (None, 0.9, "per-head") for normalize in (False, True) for group in (1, 3)
         if not (op == "hla2_unmasked_ridge" and (normalize or group > 1))]
CASES += [(op, None, False, 1, dtype) for op in ("hla2", "ahla", "hla3")
          for dtype in (torch.float16, torch.bfloat16, torch.float64)]


def _decay(decay, group):
    if decay == "per-head":   # one value per key/value group (a shared state needs that)
        return torch.tensor([0.5, 0.9, 0.99, 0.7, 0.95, 0.8][: H // group]).repeat_interleave(
            group)
    return decay


@pytest.mark.parametrize("op, decay, normalize, group, dtype", CASES,
                         ids=lambda x: str(x).replace("torch.", ""))
def test_decode_inplace_matches_serial(op, decay, normalize, group, dtype):
    ref, kw = OPS[op]
    name = op.split("_")[0]
    dec = _decay(decay, group)
    q, _, _ = make_qkv(B, H, STEPS, DK, DV, seed=1, positive=normalize)
    _, k, v = make_qkv(B, H // group, STEPS, DK, DV, seed=2, positive=normalize)
    opts = {x: kw[x] for x in ("masked", "ridge") if x in kw}
    want, want_st = ref.serial(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                               normalize=normalize, decay=dec, **opts)
    state = init_state(B, H, DK, DV, kv_heads=H // group, dtype=dtype,
                       order=kw.get("order", 2), asymmetric=kw.get("asymmetric", False))
    tensors = {n: x for n, x in state.items()}
    for t in range(STEPS):
        x = [y[:, :, t].to(dtype) for y in (q, k, v)]
        out = decode_(*x, state, normalize=normalize, decay=dec, **kw)
        assert out.shape == (B, H, DV) and out.dtype == dtype
        tol = 5e-4 if name == "hla2" and dec is not None and normalize else TOL[dtype]
        assert rel_err(out, want[:, :, t]) <= tol, t
    for n, x in state.items():
        assert x is tensors[n]   # the same tensors, advanced in place
        expect = want_st[n][:, ::group] if n in KV.get(name, ()) else want_st[n]
        assert rel_err(x, expect) <= max(TOL[dtype], 5e-4), n


def test_four_dim_tokens_and_out_and_hla_agree():
    q, k, v = make_qkv(B, H, 1, DK, DV, seed=4, dtype=torch.float32)
    _, st = hla(*make_qkv(B, H, 9, DK, DV, seed=5, dtype=torch.float32), return_state=True)
    before = {n: x.clone() for n, x in st.items()}
    want, want_st = hla(q, k, v, state=st, return_state=True)   # functional: st unchanged
    assert all(torch.equal(st[n], before[n]) for n in st)
    out = torch.empty(B, H, 1, DV)
    got = decode_(q, k, v, st, out=out)
    assert got is out and torch.equal(out, want)
    assert all(torch.equal(st[n], want_st[n]) for n in st)


def test_non_contiguous_tokens_are_fine():
    q, k, v = make_qkv(B, H, 5, DK, DV, seed=6, dtype=torch.float32)
    st = init_state(B, H, DK, DV)
    st2 = init_state(B, H, DK, DV)
    a = decode_(q[:, :, 2], k[:, :, 2], v[:, :, 2], st)   # slices: not contiguous
    b = decode_(q[:, :, 2].contiguous(), k[:, :, 2].contiguous(), v[:, :, 2].contiguous(), st2)
    assert torch.equal(a, b)


def _odd_view(x):
    """A contiguous copy of x that starts 4 bytes past an aligned address (a view into a larger
    buffer), which the compiled kernels' aligned vector loads must never see."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype)[1:]
    flat.copy_(x.reshape(-1))
    return flat.view(x.shape)


def test_tensors_at_odd_addresses_are_copied_or_refused():
    """Inputs at odd offsets give the same result as aligned ones (no crash); a state or `out`
    updated in place at an odd offset is refused with a clear error."""
    q, k, v = make_qkv(B, H, 1, DK, DV, seed=6, dtype=torch.float32)
    st = init_state(B, H, DK, DV)
    want = decode_(q, k, v, init_state(B, H, DK, DV))
    got = decode_(*(_odd_view(x) for x in (q, k, v)), st)
    assert got.data_ptr() % 64 == 0 and torch.equal(got, want)
    with pytest.raises(ValueError, match=r"state\['C'\] must start at a 64-byte aligned"):
        decode_(q, k, v, _bad(st, "C", _odd_view(st["C"])))
    with pytest.raises(ValueError, match="64-byte aligned"):
        decode_(q, k, v, st, out=_odd_view(torch.empty(B, H, 1, DV)))
    qs, ks, vs = make_qkv(B, H, 37, DK, DV, seed=7)
    ref = hla(qs, ks, vs, backend="torch")
    odd = hla(*(_odd_view(x.float()) for x in (qs, ks, vs)), chunk_size=16)
    assert rel_err(odd, ref) <= 1e-4


def _bad(state, name, value):
    bad = dict(state)
    bad[name] = value
    return bad


def test_errors_name_the_argument():
    q, k, v = (x[:, :, 0] for x in make_qkv(B, H, 1, DK, DV, seed=7, dtype=torch.float32))
    st = init_state(B, H, DK, DV)
    decode_(q, k, v, st)   # (this state passed once: a view of its memory is checked again)
    S = st["S"]
    cases = [
        (_bad(st, "S", S[:1]), ValueError, r"state\['S'\] must have shape \[2, 6, 8, 8\]"),
        (_bad(st, "C", st["C"].double()), TypeError, r"state\['C'\] must be torch.float32"),
        (_bad(st, "S", S.transpose(-1, -2)), ValueError, r"state\['S'\] must be contiguous"),
        (_bad(st, "C", st["C"].view(torch.int32)), TypeError, r"state\['C'\] must be torch.f"),
        (_bad(st, "G", st["G"].view(B, H, DV, DK)[:, :, :DK]), ValueError,
         r"state\['G'\] must have shape"),
        ({n: x for n, x in st.items() if n != "h"}, ValueError, "exactly the keys"),
        (_bad(st, "extra", S), ValueError, "exactly the keys"),
        (_bad(st, "m", [1, 2]), TypeError, r"state\['m'\] must be a torch.Tensor"),
        ([S], TypeError, "state must be a dict"),
        (init_state(B, H, DK, DV, order=3), ValueError, "exactly the keys"),
    ]
    for state, error, match in cases:
        snapshot = {n: x.clone() for n, x in st.items()}
        with pytest.raises(error, match=match):
            decode_(q, k, v, state)
        assert all(torch.equal(st[n], snapshot[n]) for n in st)   # nothing was written
    with pytest.raises(ValueError, match="one token"):
        decode_(*make_qkv(B, H, 2, DK, DV, dtype=torch.float32), st)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        decode_(q.numpy(), k, v, st)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        decode_(q, k, v, st, out=torch.empty(B, H, DV + 1))
    with pytest.raises(ValueError, match="masked=False and ridge"):
        decode_(q, k, v, init_state(B, H, DK, DV, asymmetric=True), asymmetric=True, ridge=1.0)
    with pytest.raises(ValueError, match="kv_heads=4 must divide heads=6"):
        init_state(B, H, DK, kv_heads=4)


def test_hla_one_token_with_padding():
    """hla() at T = 1 with attention_mask: the padded row keeps its state and outputs zeros."""
    q, k, v = make_qkv(B, H, 1, DK, DV, seed=8, dtype=torch.float32)
    _, st = hla(*make_qkv(B, H, 9, DK, DV, seed=9, dtype=torch.float32), return_state=True)
    mask = torch.tensor([[1], [0]])
    out, new = hla(q, k, v, state=st, attention_mask=mask, return_state=True)
    want, want_st = hla2.step(*(x[:, :, 0].double() for x in (q, k, v)),
                              {n: x.double() for n, x in st.items()})
    assert rel_err(out[0, :, 0], want[0]) <= 1e-4 and (out[1] == 0).all()
    for n in st:
        assert rel_err(new[n][0], want_st[n][0]) <= 1e-4 and torch.equal(new[n][1], st[n][1])
