"""Asymmetric second order (AHLA, ((A A) * L) V with A = L * (Q K^T)): the checks every
operator passes (`operator_checks`) against its float64 quadratic form and serial recurrence."""
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

OP = "ahla"   # the operator of this module's checks (the `op` fixture)

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = SHARED_FAST | {
    "test_family_matches_serial[None-False-True-float32]",
}
