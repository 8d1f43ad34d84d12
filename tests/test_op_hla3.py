"""Third order (((W W^T * L) W) V with W = L * (Q K^T)): where the paper's Algorithm 3
differs from the masked form, half precision, and the checks every operator passes
(`operator_checks`) against its float64 quadratic form and serial recurrence."""
import torch
from conftest import make_qkv, rel_err
from operator_checks import (  # noqa: F401  (the shared checks, run for OP)
    FAST as SHARED_FAST,
    test_chunked_equals_serial_with_decay,
    test_decayed_chunks_equal_serial_over_many_chunks,
    test_family_matches_serial,
    test_fast_chunked_family_matches_serial,
    test_fast_chunked_tiny_decay_stays_finite,
    test_fast_steps_match_serial,
    test_gradients_match_quadratic_form,
    test_grouped_heads_equal_repeated_heads,
    test_one_head_many_chunks,
    test_padding_equals_removing_it,
    test_per_head_decay,
    test_serial_equals_quadratic,
    test_torch_backend_token_by_token_equals_serial,
)

from hla_tvm import hla
from hla_tvm.ops.hla3 import reference as ref

OP = "hla3"   # the operator of this module's checks (the `op` fixture)

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = SHARED_FAST | {
    "test_family_matches_serial[0.9-True-False-float32]",
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
