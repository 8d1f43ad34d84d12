"""The HLA operators, one folder each (`hla2`, `ahla`, `hla3`: reference, fast PyTorch forms,
TensorIR kernels, prefill chains), and the records that find them.

    OPERATORS   {name: Operator}: hla2 (second order), ahla, hla3
    FAMILIES    {name: Family}: the kernel families, hla2, hla2_decay, ahla, hla3
    get(order, asymmetric) -> Operator
    chains      a family's prefill and decode chains, their kernels, names and shapes

Importing this package imports torch but not TVM: the kernel builders load on first use."""
from __future__ import annotations

from . import ahla, hla2, hla3
from .operator import Family, Operator, state_dtype

OPERATORS = {op.OPERATOR.name: op.OPERATOR for op in (hla2, ahla, hla3)}
FAMILIES = {f.name: f for op in (hla2, ahla, hla3) for f in op.FAMILIES}

__all__ = ["FAMILIES", "Family", "OPERATORS", "Operator", "get", "state_dtype"]


def get(order, asymmetric):
    """The operator `hla(order=, asymmetric=)` names; ValueError for one that does not exist."""
    for op in OPERATORS.values():
        if op.order == order and op.asymmetric == asymmetric and not isinstance(order, bool):
            return op
    if order not in (2, 3) or isinstance(order, bool):
        raise ValueError(f"order must be 2 or 3, got {order!r}")
    raise ValueError(f"order={order} with asymmetric={asymmetric} is not an HLA operator; "
                     "asymmetric=True is defined for order 2 only")
