"""Function bodies of `hla_tvm::HLA` in standard ONNX (opset 18): the serial recurrence as a Scan
over time, so any conforming runtime runs a model that carries them (ModelProto.functions).

    HLA(q [B, H, T, Dk], k [B, Hkv, T, Dk], v [B, Hkv, T, Dv], decay_heads? [H], *state?)
        -> (o [B, H, T, Dv], *state)

Attributes: order (2 or 3), asymmetric, masked, normalize (0/1), eps, ridge, decay (floats).
The optional input `decay_heads` (one gamma per query head) replaces the scalar attribute; state
inputs are all given or all omitted (omitted: a fresh sequence, zeros). State entries, in order:
second order S, C, m, G, h; AHLA P, m, E, n; third order S, P, m, F, eta (as the operators'
references); entries built from k, v alone (`Operator.kv_state`) have Hkv heads. The recurrences
are those of `hla_tvm.ops.{hla2, ahla, hla3}.reference.step`, float32.

The body's structure depends on the structural attributes and on which optional inputs are
present, so each combination is its own FunctionProto, told apart by the node's and the
function's `overload` (`overload_name`); `add_functions` attaches the ones a model's nodes use."""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

DOMAIN = "hla_tvm"
OP_TYPE = "HLA"
OPSET = 18

STATE_NAMES = {(2, False): ("S", "C", "m", "G", "h"), (2, True): ("P", "m", "E", "n"),
               (3, False): ("S", "P", "m", "F", "eta")}
VECTOR_STATES = {"m", "h", "n", "eta"}    # [B, H, d]; the others are [B, H, d, e]


ATTRIBUTES = {"order": 2, "asymmetric": 0, "masked": 1, "normalize": 0, "eps": 1e-6,
              "ridge": 0.0, "decay": 1.0}
INT64_MAX = 2 ** 63 - 1


def overload_name(order, asymmetric, masked, normalize, decay_input=False, state_input=False):
    """The overload of one variant, e.g. o2a0m1n0 (+ "_g" with a decay input, "_s" with state)."""
    return (f"o{order}a{int(asymmetric)}m{int(masked)}n{int(normalize)}"
            + ("_g" if decay_input else "") + ("_s" if state_input else ""))


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


def _kv_state(order, asymmetric):
    from .. import ops

    return set(ops.get(order, asymmetric).kv_state)


def _shape_of(b, name, shapes):
    """Shape(...) pieces: B, H (of q), dk, dv as int64 [1] tensors (computed once)."""
    if not shapes:
        sq, sv = b.emit("Shape", ["q"]), b.emit("Shape", ["v"])
        sk = b.emit("Shape", ["k"])
        part = lambda s, i: b.emit("Slice", [s, b.const([i]), b.const([i + 1])])  # noqa: E731
        shapes.update(B=part(sq, 0), H=part(sq, 1), Hkv=part(sk, 1), dk=part(sq, 3),
                      dv=part(sv, 3))
        shapes["G"] = b.emit("Div", [shapes["H"], shapes["Hkv"]])
    return shapes[name]


def _repeat_heads(b, x, shapes):
    """[B, Hkv, ...] -> [B, H, ...], each key/value head repeated H / Hkv times in place."""
    sx = b.emit("Shape", [x])
    lead = b.emit("Slice", [sx, b.const([0]), b.const([2])])
    rest = b.emit("Slice", [sx, b.const([2]), b.const([INT64_MAX])])
    wide = b.emit("Expand", [b.unsq(x, 2),
                             b.emit("Concat", [lead, _shape_of(b, "G", shapes), rest], axis=0)])
    return b.emit("Reshape", [wide, b.emit("Concat", [b.const([0, -1]), rest], axis=0)])


def _first_of_group(b, x, shapes):
    """[B, H, ...] -> [B, Hkv, ...]: the first query head of each group."""
    return b.emit("Slice", [x, b.const([0]), b.const([INT64_MAX]), b.const([1]),
                            _shape_of(b, "G", shapes)])


def make_function(order=2, asymmetric=False, masked=True, normalize=False, decay_input=True,
                  state_input=True, opset=OPSET):
    """The FunctionProto of `hla_tvm::HLA` for one variant (see the module docstring), importing
    the standard ops at `opset` (the model's: OPSET, or 21 in a file with quantized weights;
    the ops it uses mean the same in both)."""
    op = (order, asymmetric)
    if op not in STATE_NAMES:
        raise ValueError(f"order={order} with asymmetric={asymmetric} is not an HLA operator")
    names = STATE_NAMES[op]
    kv = _kv_state(order, asymmetric)
    outer, shapes = _Body("f"), {}

    def attr_const(name):
        out = outer.emit("Constant", [], value_float=0.0)
        outer.nodes[-1].attribute[0].ref_attr_name = name
        return out

    eps, ridge = attr_const("eps"), attr_const("ridge")
    gamma = "decay_heads" if decay_input else attr_const("decay")
    g4 = outer.emit("Reshape", [gamma, outer.const([1, -1, 1, 1])])   # [1, H or 1, 1, 1]
    g3 = outer.emit("Reshape", [gamma, outer.const([1, -1, 1])])
    k, v = (_repeat_heads(outer, x, shapes) for x in ("k", "v"))
    perm = [2, 0, 1, 3]
    qT, kT, vT = (outer.emit("Transpose", [x], perm=perm) for x in ("q", k, v))
    if state_input:
        init = [_repeat_heads(outer, f"{n}_in", shapes) if n in kv else f"{n}_in" for n in names]
    else:
        dims = [("B", "H", "dk") + (("dk",) if n == "S" else ("dv",)) if n not in VECTOR_STATES
                else ("B", "H", "dk") for n in names]
        init = [outer.emit("ConstantOfShape", [outer.emit(
            "Concat", [_shape_of(outer, d, shapes) for d in ds], axis=0)]) for ds in dims]

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
    res = outer.emit("Scan", init + [qT, kT, vT], n_out=len(names) + 1, body=graph,
                     num_scan_inputs=3)
    o = outer.emit("Transpose", [res[-1]], perm=[1, 2, 0, 3])
    outer.nodes.append(helper.make_node("Identity", [o], ["o"]))
    for n, r in zip(names, res[:-1]):
        r = _first_of_group(outer, r, shapes) if n in kv else r
        outer.nodes.append(helper.make_node("Identity", [r], [f"{n}_out"]))
    defaults = [helper.make_attribute(k, v) for k, v in ATTRIBUTES.items()]
    return helper.make_function(
        DOMAIN, OP_TYPE, ["q", "k", "v", "decay_heads"] + [f"{n}_in" for n in names],
        ["o"] + [f"{n}_out" for n in names], outer.nodes, [helper.make_opsetid("", opset)],
        attribute_protos=defaults,
        overload=overload_name(order, asymmetric, masked, normalize, decay_input, state_input))


def node(inputs, outputs, *, order=2, asymmetric=False, masked=True, normalize=False, eps=1e-6,
         ridge=0.0, decay=1.0, name=None):
    """A `hla_tvm::HLA` NodeProto; inputs q, k, v[, decay or "", *state]. Its overload is set
    from the attributes and the inputs present."""
    inputs = list(inputs) + [""] * (4 - len(inputs))   # decay is "" when absent
    decay_input, state_input = inputs[3] != "", len(inputs) > 4
    return helper.make_node(
        OP_TYPE, inputs, outputs, domain=DOMAIN, name=name,
        overload=overload_name(order, asymmetric, masked, normalize, decay_input, state_input),
        order=int(order), asymmetric=int(asymmetric), masked=int(masked),
        normalize=int(normalize), eps=float(eps), ridge=float(ridge), decay=float(decay))

def one_node_model(shapes, *, order=2, asymmetric=False, masked=True, normalize=False,
                   eps=1e-6, ridge=0.0, decay=1.0):
    """A ModelProto with one `hla_tvm::HLA` node (and its function body) over float32 graph
    inputs of `shapes` {name: shape}: q, k, v, optionally "decay" ([H], replacing the scalar
    attribute) and the state entries as "<name>_in" (all or none); outputs o and "<name>_out"."""
    names = STATE_NAMES[(order, bool(asymmetric))]
    state_input = f"{names[0]}_in" in shapes
    node_in = ["q", "k", "v", "decay" if "decay" in shapes else ""] + \
        ([f"{n}_in" for n in names] if state_input else [])
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shapes[n]))
           for n in node_in if n]
    outs = [helper.make_tensor_value_info("o", TensorProto.FLOAT, [None] * 4)] + \
        [helper.make_tensor_value_info(f"{n}_out", TensorProto.FLOAT,
                                       [None] * (3 if n in VECTOR_STATES else 4))
         for n in names]
    hla = node(node_in, ["o"] + [f"{n}_out" for n in names], order=order,
               asymmetric=asymmetric, masked=masked, normalize=normalize, eps=eps, ridge=ridge,
               decay=decay, name="hla0")
    graph = helper.make_graph([hla], "one_hla", ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(DOMAIN, 1)])
    return add_functions(model)


def describe(node):
    """`node`'s name for error messages."""
    return f"HLA node {node.name or '(unnamed)'!r} ({node.domain}::{node.op_type})"


def node_variant(node):
    """The variant of a `hla_tvm::HLA` node: dict(order, asymmetric, masked, normalize, eps,
    ridge, decay, decay_input, state_input, overload); ValueError naming the node when an
    attribute value, the input count or the output count is not one the operator has."""
    attrs = dict(ATTRIBUTES)
    for a in node.attribute:
        if a.name not in ATTRIBUTES:
            raise ValueError(f"{describe(node)}: unknown attribute {a.name!r}; the operator has "
                             f"{sorted(ATTRIBUTES)}")
        want = onnx.AttributeProto.INT if isinstance(ATTRIBUTES[a.name], int) else \
            onnx.AttributeProto.FLOAT
        if a.type != want:
            raise ValueError(f"{describe(node)}: attribute {a.name!r} must be "
                             f"{'an int' if want == onnx.AttributeProto.INT else 'a float'}, "
                             f"got {onnx.AttributeProto.AttributeType.Name(a.type).lower()}")
        attrs[a.name] = helper.get_attribute_value(a)
    order, asym = attrs["order"], attrs["asymmetric"]
    if (order, bool(asym)) not in STATE_NAMES or asym not in (0, 1):
        raise ValueError(f"{describe(node)}: order={order}, asymmetric={asym} is not an HLA "
                         "operator (order 2 with asymmetric 0 or 1, or order 3 with asymmetric 0)")
    for flag in ("masked", "normalize"):
        if attrs[flag] not in (0, 1):
            raise ValueError(f"{describe(node)}: {flag} must be 0 or 1, got {attrs[flag]}")
    if (order, asym) != (2, 0) and (not attrs["masked"] or attrs["ridge"]):
        raise ValueError(f"{describe(node)}: masked=0 and ridge apply to symmetric second order "
                         "only")
    if not 0.0 < attrs["decay"] <= 1.0:
        raise ValueError(f"{describe(node)}: decay must lie in (0, 1], got {attrs['decay']}")
    for name in ("eps", "ridge"):   # (as hla() takes them)
        if not attrs[name] >= 0.0:
            raise ValueError(f"{describe(node)}: {name} must be a number >= 0, got "
                             f"{attrs[name]}")
    names = STATE_NAMES[(order, bool(asym))]
    n_in, n_out = len(node.input), len(node.output)
    if n_in not in (3, 4, 4 + len(names)):
        raise ValueError(f"{describe(node)}: takes q, k, v, optional decay_heads (\"\" for none) "
                         f"and optionally all {len(names)} state tensors ({', '.join(names)}): "
                         f"3, 4 or {4 + len(names)} inputs, got {n_in}")
    if not 1 <= n_out <= 1 + len(names):
        raise ValueError(f"{describe(node)}: returns o and up to {len(names)} state tensors, "
                         f"got {n_out} outputs")
    attrs.update(asymmetric=bool(asym), masked=bool(attrs["masked"]),
                 normalize=bool(attrs["normalize"]),
                 decay_input=n_in > 3 and node.input[3] != "", state_input=n_in > 4)
    attrs["overload"] = overload_name(order, asym, attrs["masked"], attrs["normalize"],
                                      attrs["decay_input"], attrs["state_input"])
    if node.overload and node.overload != attrs["overload"]:
        raise ValueError(f"{describe(node)}: overload {node.overload!r} does not match its "
                         f"attributes and inputs (expected {attrs['overload']!r})")
    return attrs


def hla_nodes(graph):
    """The `hla_tvm::HLA` nodes of `graph` (top level)."""
    return [n for n in graph.node if n.op_type == OP_TYPE and n.domain == DOMAIN]


def model_opset(model):
    """The version of the standard ops `model` imports."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), OPSET)


def add_functions(model):
    """Attach the function body every `hla_tvm::HLA` node of `model` needs (setting each node's
    overload; bodies already present are kept) and import the hla_tvm domain. Returns model."""
    have = {(f.domain, f.name, f.overload) for f in model.functions}
    opset = model_opset(model)
    for n in hla_nodes(model.graph):
        var = node_variant(n)
        n.overload = var["overload"]
        if (DOMAIN, OP_TYPE, var["overload"]) not in have:
            model.functions.append(make_function(
                var["order"], var["asymmetric"], var["masked"], var["normalize"],
                var["decay_input"], var["state_input"], opset))
            have.add((DOMAIN, OP_TYPE, var["overload"]))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def check_functions(model, require=True):
    """ValueError naming the first `hla_tvm::HLA` node whose function body the model lacks
    (with `require`: without one, ONNX Runtime and other runtimes cannot run the node), or
    carries in another form than the one its attributes define (`make_function`): ONNX Runtime
    runs the body and TVM the attributes, so a body that computed something else would give
    two answers."""
    have = {(f.domain, f.name, f.overload): f for f in model.functions}
    checked = set()
    for n in hla_nodes(model.graph):
        var = node_variant(n)
        key = (DOMAIN, OP_TYPE, n.overload)
        if key not in have and not require:
            continue
        if key not in have:
            raise ValueError(
                f"{describe(n)}: the model carries no function body for overload "
                f"{n.overload or '(none)'!r} (expected {var['overload']!r}), so a runtime "
                "without hla_tvm cannot run it; add it with hla_tvm.onnx.add_functions(model)")
        if key not in checked:
            want = make_function(var["order"], var["asymmetric"], var["masked"],
                                 var["normalize"], var["decay_input"], var["state_input"],
                                 model_opset(model))
            if _body(have[key]) != _body(want):
                raise ValueError(
                    f"{describe(n)}: the model's function body for overload {n.overload!r} is "
                    "not the one its attributes define (altered, or written by another "
                    "version): runtimes would compute something else than the node says; "
                    "export the model again")
            checked.add(key)
    return model


def _body(func):
    """A FunctionProto's content without its documentation, as bytes (deterministic)."""
    func = onnx.FunctionProto.FromString(func.SerializeToString())
    func.ClearField("doc_string")
    return func.SerializeToString(deterministic=True)


def check(model):
    """Every HLA node valid and carrying its function body, then onnx.checker's full check."""
    check_functions(model)
    onnx.checker.check_model(model, full_check=True)
    return model
