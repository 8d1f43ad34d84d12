"""Function bodies of `hla_tvm::HLA` in standard ONNX (opset 18): the serial recurrence as a Scan
over time, so any conforming runtime runs a model that carries them (ModelProto.functions).

Node: HLA(q [B, H, T, Dk], k, v [B, H, T, Dv], decay [H], *state) -> (o [B, H, T, Dv], *state),
attributes eps, ridge (float). The body's structure depends on order, asymmetric, masked and
normalize, so each combination is its own FunctionProto, told apart by the node's and the
function's `overload` (`overload_name`). State entries, in order: second order S, C, m, G, h;
AHLA P, m, E, n; third order S, P, m, F, eta (as `hla_tvm.reference`). decay holds one gamma per
head (ones for none). The recurrences are those of `hla_tvm.reference.{hla2, ahla, hla3}.step`."""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

DOMAIN = "hla_tvm"
OP_TYPE = "HLA"
OPSET = 18

STATE_NAMES = {(2, False): ("S", "C", "m", "G", "h"), (2, True): ("P", "m", "E", "n"),
               (3, False): ("S", "P", "m", "F", "eta")}
VECTOR_STATES = {"m", "h", "n", "eta"}    # [B, H, d]; the others are [B, H, d, e]


def overload_name(order, asymmetric, masked, normalize):
    return f"o{order}a{int(asymmetric)}m{int(masked)}n{int(normalize)}"


class _Body:
    """A tiny builder: emit(op, inputs, **attrs) -> output name."""

    def __init__(self, prefix):
        self.nodes, self.prefix, self.count = [], prefix, 0

    def emit(self, op, inputs, n_out=1, **attrs):
        outs = [f"{self.prefix}{self.count}_{i}" for i in range(n_out)]
        self.count += 1
        self.nodes.append(helper.make_node(op, list(inputs), outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, values, dtype=TensorProto.INT64):
        return self.emit("Constant", [], value=helper.make_tensor(
            f"{self.prefix}c{self.count}", dtype, [len(values)], values))

    def unsq(self, x, axis):
        return self.emit("Unsqueeze", [x, self.const([axis])])

    def sq(self, x, axis):
        return self.emit("Squeeze", [x, self.const([axis])])

    def outer(self, a, b):
        """a b^T per (batch, head): [B, H, d] x [B, H, e] -> [B, H, d, e]."""
        return self.emit("Mul", [self.unsq(a, -1), self.unsq(b, -2)])

    def vecmat(self, x, M):
        """x^T M: [B, H, d] x [B, H, d, e] -> [B, H, e]."""
        return self.sq(self.emit("MatMul", [self.unsq(x, -2), M]), -2)

    def matvec(self, M, x):
        return self.sq(self.emit("MatMul", [M, self.unsq(x, -1)]), -1)

    def dot(self, a, b):
        """sum(a * b) over the last axis, kept: [B, H, 1]."""
        return self.emit("ReduceSum", [self.emit("Mul", [a, b]), self.const([-1])], keepdims=1)

    def decayed(self, g, x, add):
        return self.emit("Add", [self.emit("Mul", [g, x]), add])


def _step(b, op, st, q, k, v, g4, g3, masked, normalize, eps, ridge):
    """New state and output of one token (the reference `step`)."""
    order, asym = op
    if (order, asym) == (2, False):
        S, C, m, G, h = st
        kk = b.outer(k, k)
        G2 = b.decayed(g4, G, b.emit("MatMul", [kk, C]))
        h2 = b.decayed(g3, h, b.matvec(kk, m))
        S2 = b.decayed(g4, S, kk)
        C2 = b.decayed(g4, C, b.outer(q, v))
        m2 = b.decayed(g3, m, q)
        u = b.emit("Add", [b.vecmat(q, S2), b.emit("Mul", [ridge, q])])
        num, den = b.vecmat(u, C2), b.dot(u, m2)
        if masked:
            num = b.emit("Sub", [num, b.vecmat(q, G2)])
            den = b.emit("Sub", [den, b.dot(q, h2)])
        new = [S2, C2, m2, G2, h2]
    elif asym:
        P, m, E, n = st
        P2 = b.decayed(g4, P, b.outer(k, v))
        m2 = b.decayed(g3, m, k)
        E2 = b.decayed(g4, E, b.outer(k, b.vecmat(q, P2)))
        n2 = b.decayed(g3, n, b.emit("Mul", [k, b.dot(q, m2)]))
        num, den = b.vecmat(q, E2), b.dot(q, n2)
        new = [P2, m2, E2, n2]
    else:
        S, P, m, F, eta = st
        S2 = b.decayed(g4, S, b.outer(k, k))
        P2 = b.decayed(g4, P, b.outer(k, v))
        m2 = b.decayed(g3, m, k)
        Sq = b.matvec(S2, q)
        F2 = b.decayed(g4, F, b.outer(Sq, b.vecmat(q, P2)))
        eta2 = b.decayed(g3, eta, b.emit("Mul", [Sq, b.dot(q, m2)]))
        num, den = b.vecmat(q, F2), b.dot(q, eta2)
        new = [S2, P2, m2, F2, eta2]
    out = b.emit("Div", [num, b.emit("Add", [den, eps])]) if normalize else num
    return new, out


def make_function(order=2, asymmetric=False, masked=True, normalize=False):
    """The FunctionProto of `hla_tvm::HLA` for one operator variant (see the module docstring)."""
    op = (order, asymmetric)
    if op not in STATE_NAMES:
        raise ValueError(f"order={order} with asymmetric={asymmetric} is not an HLA operator")
    names = STATE_NAMES[op]
    outer = _Body("f")
    eps = outer.emit("Constant", [], value_float=1e-6)
    outer.nodes[-1].attribute[0].ref_attr_name = "eps"
    ridge = outer.emit("Constant", [], value_float=0.0)
    outer.nodes[-1].attribute[0].ref_attr_name = "ridge"
    g4 = outer.emit("Reshape", ["decay", outer.const([1, -1, 1, 1])])   # [1, H, 1, 1]
    g3 = outer.emit("Reshape", ["decay", outer.const([1, -1, 1])])      # [1, H, 1]
    perm = [2, 0, 1, 3]
    qT, kT, vT = (outer.emit("Transpose", [x], perm=perm) for x in ("q", "k", "v"))

    body = _Body("s")
    st_in = [f"st_{n}" for n in names]
    new, out = _step(body, op, st_in, "q_t", "k_t", "v_t", g4, g3, masked, normalize, eps, ridge)
    outs = [body.emit("Identity", [x]) for x in new] + [body.emit("Identity", [out])]
    def typed(name, rank):  # float32, symbolic dims
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [None] * rank)

    ranks = [3 if n in VECTOR_STATES else 4 for n in names]
    graph = helper.make_graph(
        body.nodes, "hla_step",
        [typed(x, r) for x, r in zip(st_in, ranks)] + [typed(x, 3) for x in ("q_t", "k_t", "v_t")],
        [typed(x, r) for x, r in zip(outs, ranks + [3])])
    res = outer.emit("Scan", [f"{n}_in" for n in names] + [qT, kT, vT], n_out=len(names) + 1,
                     body=graph, num_scan_inputs=3)
    o = outer.emit("Transpose", [res[-1]], perm=[1, 2, 0, 3])
    outer.nodes.append(helper.make_node("Identity", [o], ["o"]))
    for n, r in zip(names, res[:-1]):
        outer.nodes.append(helper.make_node("Identity", [r], [f"{n}_out"]))
    fn = helper.make_function(DOMAIN, OP_TYPE, ["q", "k", "v", "decay"] + [f"{n}_in" for n in names],
                              ["o"] + [f"{n}_out" for n in names], outer.nodes,
                              [helper.make_opsetid("", OPSET)], attributes=["eps", "ridge"],
                              overload=overload_name(order, asymmetric, masked, normalize))
    return fn


def node(inputs, outputs, *, order=2, asymmetric=False, masked=True, normalize=False, eps=1e-6,
         ridge=0.0, name=None):
    """A `hla_tvm::HLA` NodeProto calling the matching function overload."""
    return helper.make_node(OP_TYPE, inputs, outputs, domain=DOMAIN, name=name,
                            overload=overload_name(order, asymmetric, masked, normalize),
                            eps=float(eps), ridge=float(ridge))


def check(model):
    """onnx.checker full check (functions included)."""
    onnx.checker.check_model(model, full_check=True)
    return model
