"""The fast PyTorch forms (each operator's `fast.py`) against the float64 serial recurrences."""
import pytest
import torch
from conftest import make_qkv, rel_err

from hla_tvm import init_state
from hla_tvm.ops import OPERATORS
from hla_tvm.ops.ahla import reference as ahla
from hla_tvm.ops.hla2 import reference as hla2
from hla_tvm.ops.hla3 import reference as hla3

REFS = {"hla2": (hla2, dict()), "ahla": (ahla, dict(asymmetric=True)), "hla3": (hla3, dict(order=3))}


@pytest.mark.parametrize("decay", [None, 0.9, "per-head"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("op", list(OPERATORS))
def test_fast_steps_match_serial(op, normalize, decay):
    ref, kw = REFS[op]
    B, H, T, dk, dv = 2, 3, 9, 8, 4
    dec = torch.tensor([0.5, 0.9, 0.99]) if decay == "per-head" else decay
    q, k, v = make_qkv(B, H, T, dk, dv, seed=3, positive=normalize)
    want, want_st = ref.serial(q, k, v, normalize=normalize, decay=dec)
    st = init_state(B, H, dk, dv, dtype=torch.float64, **kw)
    for t in range(T):
        out = OPERATORS[op].fast.step_(q[:, :, t], k[:, :, t], v[:, :, t], st,
                                       normalize=normalize, decay=dec)
        assert rel_err(out, want[:, :, t]) <= 1e-10
    assert all(rel_err(st[n], want_st[n]) <= 1e-10 for n in st)


def test_fast_hla2_step_options():
    q, k, v = make_qkv(1, 2, 6, 8, 4, seed=4)
    want, _ = hla2.serial(q, k, v, masked=False, ridge=0.5)
    st = init_state(1, 2, 8, 4, dtype=torch.float64)
    step = OPERATORS["hla2"].fast.step_
    got = torch.stack([step(q[:, :, t], k[:, :, t], v[:, :, t], st, masked=False, ridge=0.5)
                       for t in range(6)], 2)
    assert rel_err(got, want) <= 1e-10


@pytest.mark.parametrize("opts", [dict(), dict(normalize=True), dict(masked=False),
                                  dict(masked=False, normalize=True, ridge=0.3),
                                  dict(ridge=0.3, normalize=True)])
# (37, 2): 19 chunks, more than one block of the decayed carry (`ops.common.fast.CARRY_BLOCK`)
@pytest.mark.parametrize("T, chunk", [(1, 4), (37, 8), (64, 16), (50, 64), (37, 2)])
@pytest.mark.parametrize("decay", [None, 0.9, "per-head"])
def test_fast_chunked_matches_quadratic_and_serial(T, chunk, opts, decay):
    hla2_chunked = OPERATORS["hla2"].fast.chunked
    dec = torch.tensor([0.5, 0.9, 0.99]) if decay == "per-head" else decay
    q, k, v = make_qkv(2, 3, T, 8, 4, seed=5, positive=opts.get("normalize", False))
    q0, k0, v0 = make_qkv(2, 3, 7, 8, 4, seed=6, positive=opts.get("normalize", False))
    _, st0 = hla2.serial(q0, k0, v0, decay=dec)
    want, want_st = hla2.serial(q, k, v, state=st0, decay=dec, **opts)
    got, st = hla2_chunked(q, k, v, chunk_size=chunk, state=st0, decay=dec, **opts)
    assert rel_err(got, want) <= 1e-10
    assert all(rel_err(st[n], want_st[n]) <= 1e-10 for n in st)
    if decay is None:
        fresh, _ = hla2_chunked(q, k, v, chunk_size=chunk, **opts)
        assert rel_err(fresh, hla2.quadratic(q, k, v, **opts)) <= 1e-10


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("T, chunk", [(1, 4), (37, 8), (50, 64), (37, 2)])
@pytest.mark.parametrize("op", ["ahla", "hla3"])
@pytest.mark.parametrize("decay", [None, 0.9, "per-head"])
def test_fast_chunked_family_matches_serial(op, T, chunk, normalize, decay):
    """AHLA and third order with every chunk at once, from a carried state, against the
    float64 serial recurrence (outputs and final state)."""
    ref, _ = REFS[op]
    dec = torch.tensor([0.5, 0.9, 0.99]) if decay == "per-head" else decay
    q, k, v = make_qkv(2, 3, T, 8, 4, seed=5, positive=normalize)
    q0, k0, v0 = make_qkv(2, 3, 7, 8, 4, seed=6, positive=normalize)
    _, st0 = ref.serial(q0, k0, v0, decay=dec)
    want, want_st = ref.serial(q, k, v, state=st0, normalize=normalize, decay=dec)
    got, st = OPERATORS[op].fast.chunked(q, k, v, chunk_size=chunk, state=st0,
                                         normalize=normalize, decay=dec)
    assert rel_err(got, want) <= 1e-10
    assert all(rel_err(st[n], want_st[n]) <= 1e-10 for n in st)


@pytest.mark.parametrize("op", ["hla2", "ahla", "hla3"])
def test_fast_chunked_tiny_decay_stays_finite(op):
    """A decay as small as float32 holds (subnormal) gives the serial recurrence's outputs: the
    decayed chunk forms take every power from its exponent and never divide by g."""
    ref, _ = REFS[op]
    q, k, v = make_qkv(1, 2, 37, 8, 4, seed=7)
    want, _ = ref.serial(q, k, v, decay=1e-40)
    got, _ = OPERATORS[op].fast.chunked(q.float(), k.float(), v.float(), chunk_size=8, decay=1e-40)
    assert torch.isfinite(got).all()
    assert rel_err(got.double(), want) <= 1e-5
