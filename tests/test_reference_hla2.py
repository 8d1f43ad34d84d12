"""The reference math agrees with itself three ways, in float64: quadratic form, serial
recurrence (Algorithm 1), and the chunk-parallel form."""
import pytest
import torch
from conftest import make_qkv, rel_err

from hla_tvm.ops.hla2 import reference as ref

OPTS = [dict(masked=m, normalize=n, ridge=r) for m in (True, False) for n in (False, True)
        for r in (0.0, 0.25)]


@pytest.mark.parametrize("opts", OPTS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_serial_equals_quadratic(opts):
    q, k, v = make_qkv(2, 3, 29, 5, 7, positive=opts["normalize"])
    out, _ = ref.serial(q, k, v, **opts)
    assert rel_err(out, ref.quadratic(q, k, v, **opts)) < 1e-12


@pytest.mark.parametrize("chunk", [1, 3, 8, 29, 64])
@pytest.mark.parametrize("opts", OPTS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_chunked_equals_serial(opts, chunk):
    q, k, v = make_qkv(2, 2, 29, 6, 4, positive=opts["normalize"], seed=1)
    o_ser, st_ser = ref.serial(q, k, v, **opts)
    o_chk, st_chk = ref.chunked(q, k, v, chunk_size=chunk, **opts)
    assert rel_err(o_chk, o_ser) < 1e-12
    for name in ref.STATE_NAMES:
        assert rel_err(st_chk[name], st_ser[name]) < 1e-12, name


def test_figure_1c_without_middle_term_is_wrong():
    """The paper's Figure 1(C) chunk output lacks ((Q S Q^T) * L) V; with it the chunk form is
    exact, without it the output is far off (measured 1.03 relative at T=32, chunk 8)."""
    q, k, v = make_qkv(1, 1, 32, 8, 8, seed=2)
    want = ref.quadratic(q, k, v)
    out, st = [], ref.zero_state(1, 1, 8, 8)
    for c0 in range(0, 32, 8):
        Q, K, V = (x[:, :, c0:c0 + 8] for x in (q, k, v))
        W = (Q @ K.transpose(-1, -2)).tril()
        out.append(Q @ (st["S"] @ st["C"] - st["G"]) + (W @ W.transpose(-1, -2)).tril() @ V)
        _, st = ref.serial(Q, K, V, state=st)
    assert rel_err(torch.cat(out, 2), want) > 0.1
    assert rel_err(ref.chunked(q, k, v, chunk_size=8)[0], want) < 1e-12


def test_state_continues_the_sequence():
    q, k, v = make_qkv(1, 2, 40, 4, 3, seed=3)
    full, st_full = ref.serial(q, k, v)
    a, st = ref.chunked(q[:, :, :17], k[:, :, :17], v[:, :, :17], chunk_size=5)
    b, st = ref.chunked(q[:, :, 17:], k[:, :, 17:], v[:, :, 17:], chunk_size=5, state=st)
    assert rel_err(torch.cat([a, b], 2), full) < 1e-12
    for name in ref.STATE_NAMES:
        assert rel_err(st[name], st_full[name]) < 1e-12


def test_serial_decay_matches_algorithm_1_by_hand():
    """gamma scales every summary; the cross terms G, h use the undecayed previous C, m."""
    q, k, v = make_qkv(1, 1, 6, 3, 2, seed=4)
    gamma = 0.8
    S = torch.zeros(3, 3, dtype=torch.float64)
    C = torch.zeros(3, 2, dtype=torch.float64)
    G = torch.zeros(3, 2, dtype=torch.float64)
    outs = []
    for t in range(6):
        qt, kt, vt = q[0, 0, t], k[0, 0, t], v[0, 0, t]
        G = gamma * G + torch.outer(kt, kt) @ C
        S = gamma * S + torch.outer(kt, kt)
        C = gamma * C + torch.outer(qt, vt)
        outs.append(qt @ (S @ C - G))
    out, _ = ref.serial(q, k, v, decay=gamma)
    assert rel_err(out[0, 0], torch.stack(outs)) < 1e-13
