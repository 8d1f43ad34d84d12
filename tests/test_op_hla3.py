"""Third order (((W W^T * L) W) V with W = L * (Q K^T)): where the paper's Algorithm 3
differs from the masked form, and half precision on the torch backend (the checks every operator
passes are in test_op_shared.py)."""
import torch
from conftest import make_qkv, rel_err

from hla_tvm import hla
from hla_tvm.ops.hla3 import reference as ref

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_half_precision_torch_backend",
    "test_paper_algorithm3_is_not_the_masked_form",
}


def test_paper_algorithm3_is_not_the_masked_form():
    """Algorithm 3 sums the index triples whose largest index is attained at least twice; the
    masked form ((W W^T * L) W) V sums those with the query-moment index largest."""
    q, k, v = make_qkv(1, 1, 8, 3, 2, seed=7)
    twice = ref.triple_sum(q, k, v, lambda i, j, u: [i, j, u].count(max(i, j, u)) >= 2)
    j_max = ref.triple_sum(q, k, v, lambda i, j, u: i <= j and u <= j)
    assert rel_err(ref.paper_algorithm3(q, k, v), twice) < 1e-12
    assert rel_err(ref.quadratic(q, k, v), j_max) < 1e-12
    q, k, v = make_qkv(1, 1, 24, 5, 5, seed=8)
    assert rel_err(ref.paper_algorithm3(q, k, v), ref.quadratic(q, k, v)) > 0.3
    assert rel_err(ref.serial(q, k, v)[0], ref.quadratic(q, k, v)) < 1e-12


def test_half_precision_torch_backend():
    q, k, v = make_qkv(1, 2, 50, 8, 8, seed=15)
    for dtype in (torch.float16, torch.bfloat16):
        out = hla(q.to(dtype), k.to(dtype), v.to(dtype), backend="torch", order=3)
        assert out.dtype == dtype
        assert rel_err(out, ref.quadratic(q, k, v)) < 2e-2
