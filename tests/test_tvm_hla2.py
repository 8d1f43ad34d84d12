"""The compiled TensorIR kernels (backend="tvm", float32) against float64 references."""
import pytest
import torch
from conftest import make_qkv, rel_err

from hla_tvm import hla
from hla_tvm.ops.hla2 import reference as ref

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_matches_quadratic_form[77]",
    "test_options_match_serial_recurrence[masked=False-normalize=True-ridge=0.5]",
    "test_state_carry_prefill_prefill_decode",
    "test_caller_state_is_not_modified",
}

TOL = 1e-4


def f32(*xs):
    return [x.float() for x in xs]


@pytest.mark.parametrize("T", [1, 7, 64, 77, 1000])
def test_matches_quadratic_form(T):
    q, k, v = make_qkv(2, 3, T, 16, 24, seed=T)
    out = hla(*f32(q, k, v))
    assert out.dtype == torch.float32 and out.shape == (2, 3, T, 24)
    assert rel_err(out, ref.quadratic(q, k, v)) <= TOL


def test_matches_quadratic_form_head_size_64():
    q, k, v = make_qkv(1, 2, 300, 64, 48, seed=5)
    assert rel_err(hla(*f32(q, k, v)), ref.quadratic(q, k, v)) <= TOL


OPTS = [dict(masked=m, normalize=n, ridge=r) for m in (True, False) for n in (False, True)
        for r in (0.0, 0.5)]


@pytest.mark.parametrize("opts", OPTS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_options_match_serial_recurrence(opts):
    q, k, v = make_qkv(2, 2, 50, 8, 12, seed=6, positive=opts["normalize"])
    st0 = _random_state(2, 2, 8, 12, seed=7, positive=opts["normalize"])
    want, want_st = ref.serial(q, k, v, state=st0, **opts)
    got, got_st = hla(*f32(q, k, v), state=st0, return_state=True, chunk_size=16, **opts)
    assert rel_err(got, want) <= TOL
    for name in ref.STATE_NAMES:
        assert rel_err(got_st[name], want_st[name]) <= TOL, name
    # one decode step from the same state
    got1, got1_st = hla(*f32(q[:, :, :1], k[:, :, :1], v[:, :, :1]), state=st0,
                        return_state=True, **opts)
    want1, want1_st = ref.serial(q[:, :, :1], k[:, :, :1], v[:, :, :1], state=st0, **opts)
    assert rel_err(got1, want1) <= TOL
    for name in ref.STATE_NAMES:
        assert rel_err(got1_st[name], want1_st[name]) <= TOL, name


@pytest.mark.parametrize("chunk", [1, 5, 32, 128])
def test_chunk_size_does_not_change_the_result(chunk):
    q, k, v = make_qkv(1, 3, 97, 8, 8, seed=8)
    assert rel_err(hla(*f32(q, k, v), chunk_size=chunk), ref.quadratic(q, k, v)) <= TOL


def test_state_carry_prefill_prefill_decode():
    """prefill(T1) -> prefill(T2) -> decode(1) with the state == prefill(T1 + T2 + 1)."""
    T1, T2 = 45, 70
    q, k, v = make_qkv(2, 2, T1 + T2 + 1, 16, 8, seed=9)
    qf, kf, vf = f32(q, k, v)
    parts, st = [], None
    for a, b in ((0, T1), (T1, T1 + T2), (T1 + T2, T1 + T2 + 1)):
        o, st = hla(qf[:, :, a:b], kf[:, :, a:b], vf[:, :, a:b], state=st, return_state=True)
        parts.append(o)
    whole, whole_st = hla(qf, kf, vf, return_state=True)
    assert rel_err(torch.cat(parts, 2), whole) <= TOL
    assert rel_err(torch.cat(parts, 2), ref.quadratic(q, k, v)) <= TOL
    _, serial_st = ref.serial(q, k, v)
    for name in ref.STATE_NAMES:
        assert rel_err(st[name], serial_st[name]) <= TOL, name
        assert rel_err(whole_st[name], serial_st[name]) <= TOL, name


def test_caller_state_is_not_modified():
    q, k, v = f32(*make_qkv(1, 2, 10, 4, 4, seed=10))
    _, st = hla(q, k, v, return_state=True)
    before = {n: x.clone() for n, x in st.items()}
    hla(q, k, v, state=st)
    hla(q[:, :, :1], k[:, :, :1], v[:, :, :1], state=st)
    for name in st:
        assert torch.equal(st[name], before[name])


def test_non_contiguous_inputs():
    q, k, v = make_qkv(2, 3, 33, 8, 8, seed=11)
    qt = q.float().transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, T, D] view, strided
    assert not qt.is_contiguous()
    assert rel_err(hla(qt, *f32(k, v)), ref.quadratic(q, k, v)) <= TOL


def test_torch_backend_matches_tvm_backend_and_reference():
    q, k, v = make_qkv(1, 2, 40, 8, 8, seed=12)
    want = ref.quadratic(q, k, v)
    assert rel_err(hla(q, k, v, backend="torch"), want) < 1e-12
    assert rel_err(hla(*f32(q, k, v), backend="torch"), want) <= TOL


def _random_state(B, H, dk, dv, seed, positive=False):
    """A state reached by running the serial recurrence over random tokens (so it is consistent)."""
    q, k, v = make_qkv(B, H, 9, dk, dv, seed=seed, positive=positive)
    return ref.serial(q, k, v)[1]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float16, 2e-2),
                                        (torch.bfloat16, 2e-2)])
def test_precisions(dtype, tol):
    """Half inputs: float32 state and accumulation, output in the input dtype; float64 stays
    float64 throughout (for verification)."""
    q1, k1, v1 = make_qkv(2, 2, 78, 16, 8, seed=13)
    q, k, v = (x[:, :, :77] for x in (q1, k1, v1))
    want = ref.quadratic(q1, k1, v1)
    out, st = hla(q.to(dtype), k.to(dtype), v.to(dtype), return_state=True)
    assert out.dtype == dtype
    assert st["S"].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rel_err(out, want[:, :, :77]) <= tol
    # decode continues from the prefill state
    o1 = hla(q1[:, :, 77:].to(dtype), k1[:, :, 77:].to(dtype), v1[:, :, 77:].to(dtype), state=st)
    assert o1.dtype == dtype
    assert rel_err(o1, want[:, :, 77:]) <= tol


def test_attention_mask_on_tvm_backend():
    q, k, v = make_qkv(2, 2, 30, 8, 8, seed=14)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[0, :4] = False
    mask[1, 20:] = False
    out, st = hla(*f32(q, k, v), attention_mask=mask, return_state=True)
    for b in range(2):
        keep = mask[b]
        want, want_st = ref.serial(q[b:b + 1, :, keep], k[b:b + 1, :, keep], v[b:b + 1, :, keep])
        assert rel_err(out[b:b + 1, :, keep], want) <= TOL
        assert out[b, :, ~keep].abs().max() == 0
        for n in ref.STATE_NAMES:
            assert rel_err(st[n][b:b + 1], want_st[n]) <= TOL
