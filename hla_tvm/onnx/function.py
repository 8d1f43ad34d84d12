"""Function bodies of `hla_tvm::HLA` in standard ONNX (opset 18), so any conforming runtime runs a
model that carries them (ModelProto.functions): an If on T = 1 whose branches are a single
token's step (`_one_token`, the operators' `reference.step`: a decode step) and the chunk form
(`_chunks`: a Scan over chunks of min(T, CHUNK) tokens, zeros padding the last, each step matrix
products from the state carried in: `_chunk`, the operators' `fast.chunked` for one chunk).

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
CHUNK = 64   # tokens per step of the chunk Scan (fewer where T is shorter)


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


class _Weights:
    """The decay weights of chunks of n tokens (n an int64 [1] tensor) for g4 [1, H or 1, 1, 1]
    (ones without decay), built outside the Scan. The same for every chunk: gt = g^t
    [1, H or 1, n, 1] (t = 1..n), Gam[t, s] = g^(t-s) [s <= t] ([1, H or 1, n, n]), the mask
    L (s <= t); second order (`second`) also gt1 = g^(t-1), Gam1[t, s] = g^(t-1-s) [s < t], the
    mask Ls (s < t) and its KW weights g^t Gamma (- g^(t-1) L masked). Per chunk of len tokens
    (the last may be short; the zero tokens padding it add nothing), stacked [NC, 1, H or 1, .,
    .] for the Scan (`per_chunk`, in the order of `names`): tail = g^(len-s) [n, 1] (s = 1..len,
    0 past it), gl = g^len; second order also tail1 = g^(len-1-s) (0 from s = len) and
    gl1 = g^(len-1)."""

    def __init__(self, b, g4, n, lens, second):
        f = lambda x: b.emit("Constant", [], value_float=float(x))   # noqa: E731
        pw = lambda e: b.emit("Pow", [g4, e])                        # noqa: E731
        mul = lambda x, y: b.emit("Mul", [x, y])                      # noqa: E731
        sub = lambda x, y: b.emit("Sub", [x, y])                      # noqa: E731
        mx0 = lambda x: b.emit("Max", [x, f(0)])                      # noqa: E731
        floats = lambda x: b.emit("Cast", [x], to=TensorProto.FLOAT)  # noqa: E731
        t = floats(b.emit("Range", [f(1), b.emit("Add", [floats(b.sq(n, 0)), f(1)]), f(1)]))
        tc, tr = b.unsq(t, 1), b.unsq(t, 0)                           # [n, 1], [1, n]
        D = sub(tc, tr)                                              # t - s
        self.L = floats(b.emit("Not", [b.emit("Less", [D, f(0)])]))
        self.gt = pw(tc)
        self.Gam = mul(pw(mx0(D)), self.L)
        # per chunk: lens [NC] -> [NC, 1, 1, 1, 1], g5 [1, 1, H or 1, 1, 1]
        g5 = b.unsq(g4, 0)
        ln = b.emit("Reshape", [lens, b.const([-1, 1, 1, 1, 1])])
        ex = sub(ln, tc)                                             # len - s, [NC, 1, 1, n, 1]

        def masked_power(e):   # g^e where e >= 0, else 0
            keep = floats(b.emit("Not", [b.emit("Less", [e, f(0)])]))
            return mul(b.emit("Pow", [g5, mx0(e)]), keep)

        self.per_chunk = {"tail": masked_power(ex), "gl": b.emit("Pow", [g5, ln])}
        if second:
            self.Ls = floats(b.emit("Greater", [D, f(0)]))
            self.gt1 = pw(sub(tc, f(1)))
            self.Gam1 = mul(pw(mx0(sub(D, f(1)))), self.Ls)
            self.KW_unmasked = mul(self.gt, self.Gam)                    # g^t Gamma
            self.KW_masked = sub(self.KW_unmasked, mul(self.gt1, self.L))   # - g^(t-1) L
            self.per_chunk.update(tail1=masked_power(sub(ex, f(1))),
                                  gl1=b.emit("Pow", [g5, sub(ln, f(1))]))
        self.names = tuple(self.per_chunk)

    def in_chunk(self, names):
        """These weights with the per-chunk ones named by the Scan body's inputs `names`."""
        w = object.__new__(_Weights)
        w.__dict__.update(self.__dict__)
        w.__dict__.update(zip(self.names, names))
        return w


# state entries carried side by side in the chunk Scan: a matrix [B, H, d, Dv] and the vector
# [B, H, d] its normalizer sums, the same recurrence with v = 1 (`_chunk` works on [M | x])
PAIRS = {"C": "m", "G": "h", "P": "m", "E": "n", "F": "eta"}


def _carried(names):
    """The chunk Scan's state: the names, each (matrix, vector) pair of PAIRS as one entry."""
    return [n for n in names if n not in PAIRS.values()]


def _chunk(b, op, st, Q, K, Va, w, masked, ridge):
    """New state and [num | den] [B, H, n, Dv + 1] of one chunk (Q, K [B, H, n, dk], Va = [V | 1])
    from the state carried in (`_carried`: [C | m], [G | h], ...): the operators'
    `fast.chunked` for one chunk, whose docstrings give the forms; the denominator is the
    numerator's with v = 1 (mm: a matrix product; every decay weight 1 without decay)."""
    order, asym = op
    mm = lambda x, y: b.emit("MatMul", [x, y])          # noqa: E731
    mul = lambda x, y: b.emit("Mul", [x, y])            # noqa: E731
    add = lambda x, y: b.emit("Add", [x, y])            # noqa: E731
    sub = lambda x, y: b.emit("Sub", [x, y])            # noqa: E731
    tr = lambda x: b.emit("Transpose", [x], perm=[0, 1, 3, 2])   # noqa: E731
    gl = w.gl
    Kt = tr(K)
    tVa = mul(w.tail, Va)
    if (order, asym) == (2, False):
        S, Ca, Ga = st
        Qt = tr(Q)
        S2 = add(mul(gl, S), mm(Kt, mul(w.tail, K)))
        Ca2 = add(mul(gl, Ca), mm(Qt, tVa))
        KQ = mm(K, Qt)
        Bs = mul(KQ, w.Ls)
        KCa = mm(K, Ca)
        Ga2 = add(mul(gl, Ga), mm(Kt, add(mul(w.gl1, KCa), mm(Bs, mul(w.tail1, Va)))))
        W0 = tr(KQ)                                     # Q K^T
        W = mul(W0, w.L)
        Z = add(mul(w.gt, mm(Q, S)), mul(ridge, Q))     # diag(g^t) Q S + l Q
        M = add(mul(mm(Z, Qt), w.Gam), mul(mm(mul(W, w.Gam), KQ), w.Gam))
        X = mm(Z, Ca)
        if masked:
            M = sub(M, mul(mm(W, Bs), w.Gam1))
            X = sub(X, mm(Q, Ga))
        KW = mul(W0, w.KW_masked if masked else w.KW_unmasked)
        out = add(add(mul(w.gt, X), mm(KW, KCa)), mm(M, Va))
        new = [S2, Ca2, Ga2]
    elif asym:
        Pa, Ea = st
        A = mul(mm(Q, Kt), w.L)
        Pa2 = add(mul(gl, Pa), mm(Kt, tVa))
        QPa = mm(Q, Pa)
        Ea2 = add(mul(gl, Ea), mm(Kt, add(mul(gl, QPa), mm(A, tVa))))
        At = mul(A, w.Gam)
        out = add(mul(w.gt, mm(Q, Ea)), mm(At, add(mul(w.gt, QPa), mm(At, Va))))
        new = [Pa2, Ea2]
    else:
        S, Pa, Fa = st
        WG = mul(mm(Q, Kt), w.Gam)
        S2 = add(mul(gl, S), mm(Kt, mul(w.tail, K)))
        Pa2 = add(mul(gl, Pa), mm(Kt, tVa))
        Ya = add(mul(w.gt, mm(Q, Pa)), mm(WG, Va))
        U = add(mm(S, tr(mul(w.gt, Q))), mm(Kt, tr(WG)))   # column s: g^s S q_s + ...
        Fa2 = add(mul(gl, Fa), mm(U, mul(w.tail, Ya)))
        M = mul(mm(Q, U), w.Gam)
        out = add(mul(w.gt, mm(Q, Fa)), mm(M, Ya))
        new = [S2, Pa2, Fa2]
    return new, out


def _kv_state(order, asymmetric):
    # ops imports torch: the package imports this module with onnx alone
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


def _typed(name, rank=4):
    """A float32 value of `rank` symbolic dims (a subgraph's input or output)."""
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [None] * rank)


def _one_token(b, op, init, q, k, v, g4, masked, normalize, eps, ridge):
    """(o [B, H, 1, Dv], new state) of a single token (T = 1: a decode step), the operators'
    `reference.step`, with no Scan."""
    g3 = b.sq(g4, -1)
    def token(x):   # x[:, :, 0] (sliced first: shape inference visits this branch for any T)
        return b.sq(b.emit("Slice", [x, b.const([0]), b.const([1]), b.const([2])]), 2)

    new, out = _step(b, op, init, *(token(x) for x in (q, k, v)), g4, g3, masked, normalize,
                     eps, ridge)
    return b.unsq(out, 2), new


def _chunks(b, op, init, q, k, v, g4, masked, normalize, eps, ridge, names, dims):
    """(o [B, H, T, Dv], new state) of T tokens, a Scan over chunks of n = min(T, CHUNK) (zeros
    padding the last; `_chunk` on [matrix | vector] state pairs, v with a column of ones)."""
    B, H, dv = dims
    init = dict(zip(names, init))
    carried = _carried(names)
    init = [b.emit("Concat", [init[n], b.unsq(init[PAIRS[n]], -1)], axis=-1)
            if n in PAIRS else init[n] for n in carried]
    T = b.emit("Slice", [b.emit("Shape", [q]), b.const([2]), b.const([3])])
    n = b.emit("Max", [b.emit("Min", [T, b.const([CHUNK])]), b.const([1])])   # (T = 0: no
    # division by zero; ONNX Runtime then refuses the empty Scan with an error)
    NC = b.emit("Div", [b.emit("Sub", [b.emit("Add", [T, n]), b.const([1])]), n])
    Tc = b.emit("Mul", [NC, n])
    to_float = lambda x: b.emit("Cast", [b.sq(x, 0)], to=TensorProto.FLOAT)  # noqa: E731
    starts = b.emit("Range", [b.emit("Constant", [], value_float=0.0), to_float(Tc),
                              to_float(n)])
    lens = b.emit("Min", [b.emit("Sub", [to_float(T), starts]), to_float(n)])
    w = _Weights(b, g4, n, lens, op == (2, False))

    def chunked(x):   # [B, H, T, d] -> [B, H, NC, n, d], zeros after the last token
        d = b.emit("Slice", [b.emit("Shape", [x]), b.const([3]), b.const([4])])
        zeros = b.emit("ConstantOfShape", [b.emit("Concat", [B, H, b.emit("Sub", [Tc, T]), d],
                                                  axis=0)])
        return b.emit("Reshape", [b.emit("Concat", [x, zeros], axis=2),
                                  b.emit("Concat", [B, H, NC, n, b.const([-1])], axis=0)])

    ones = b.emit("ConstantOfShape", [b.emit("Concat", [B, H, T, b.const([1])], axis=0)],
                  value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]))
    Va = b.emit("Concat", [v, ones], axis=-1)                    # [V | 1]
    body = _Body("c")
    st_in = [f"st_{n}" for n in carried]
    xs = ["q_c", "k_c", "v_c"] + [f"{n}_c" for n in w.names]
    new, out = _chunk(body, op, st_in, *xs[:3], w.in_chunk(xs[3:]), masked, ridge)
    outs = [body.emit("Identity", [x]) for x in new + [out]]
    graph = helper.make_graph(body.nodes, "hla_chunk", [_typed(x) for x in st_in + xs],
                              [_typed(x) for x in outs])
    res = b.emit("Scan", init + [chunked(q), chunked(k), chunked(Va)] +
                 [w.per_chunk[n] for n in w.names], n_out=len(carried) + 1, body=graph,
                 num_scan_inputs=len(xs), scan_input_axes=[2, 2, 2] + [0] * len(w.names),
                 scan_output_axes=[2])
    out = b.emit("Reshape", [res[-1], b.emit("Concat", [B, H, Tc, b.const([-1])], axis=0)])
    out = b.emit("Slice", [out, b.const([0]), T, b.const([2])])   # [num | den]
    last = b.const([-1])

    def split(x):   # [X | x] -> X, x
        return (b.emit("Slice", [x, b.const([0]), dv, last]),
                b.sq(b.emit("Slice", [x, dv, b.const([INT64_MAX]), last]), -1))

    o, den = split(out)
    if normalize:
        o = b.emit("Div", [o, b.unsq(b.emit("Add", [den, eps]), -1)])
    final = {}
    for name, x in zip(carried, res[:-1]):
        if name in PAIRS:
            final[name], final[PAIRS[name]] = split(x)
        else:
            final[name] = x
    return o, [final[name] for name in names]


def _signature(order, asymmetric):
    """(op, state names, key/value-only entries) of the operator; ValueError for none."""
    op = (order, asymmetric)
    if op not in STATE_NAMES:
        raise ValueError(f"order={order} with asymmetric={asymmetric} is not an HLA operator")
    return op, STATE_NAMES[op], _kv_state(order, asymmetric)


def _attributes(outer, decay_input):
    """(eps, ridge, gamma, g4 [1, H or 1, 1, 1]): the attributes as values of the body (gamma
    the decay_heads input where it is given, else the decay attribute)."""
    def attr_const(name):
        out = outer.emit("Constant", [], value_float=0.0)
        outer.nodes[-1].attribute[0].ref_attr_name = name
        return out

    eps, ridge = attr_const("eps"), attr_const("ridge")
    gamma = "decay_heads" if decay_input else attr_const("decay")
    return eps, ridge, gamma, outer.emit("Reshape", [gamma, outer.const([1, -1, 1, 1])])


def _initial_state(outer, names, kv, state_input, shapes):
    """The state entering the sequence, every entry with H heads: the state inputs
    (key/value-only entries repeated per group), else zeros."""
    if state_input:
        return [_repeat_heads(outer, f"{n}_in", shapes) if n in kv else f"{n}_in" for n in names]
    dims = [("B", "H", "dk") + (("dk",) if n == "S" else ("dv",)) if n not in VECTOR_STATES
            else ("B", "H", "dk") for n in names]
    return [outer.emit("ConstantOfShape", [outer.emit(
        "Concat", [_shape_of(outer, d, shapes) for d in ds], axis=0)]) for ds in dims]


def _function(outer, shapes, o, state, names, kv, variant, opset):
    """The FunctionProto whose body is `outer`'s nodes, with outputs o and the final `state`
    (key/value-only entries taken at the first query head of each group); `variant`: the
    arguments of `overload_name`."""
    outer.nodes.append(helper.make_node("Identity", [o], ["o"]))
    for n, r in zip(names, state):
        r = _first_of_group(outer, r, shapes) if n in kv else r
        outer.nodes.append(helper.make_node("Identity", [r], [f"{n}_out"]))
    defaults = [helper.make_attribute(k, v) for k, v in ATTRIBUTES.items()]
    return helper.make_function(
        DOMAIN, OP_TYPE, ["q", "k", "v", "decay_heads"] + [f"{n}_in" for n in names],
        ["o"] + [f"{n}_out" for n in names], outer.nodes, [helper.make_opsetid("", opset)],
        attribute_protos=defaults, overload=overload_name(*variant))


def make_function(order=2, asymmetric=False, masked=True, normalize=False, decay_input=True,
                  state_input=True, opset=OPSET):
    """The FunctionProto of `hla_tvm::HLA` for one variant (see the module docstring), importing
    the standard ops at `opset` (the model's: OPSET, or 21 in a file with quantized weights;
    the ops it uses mean the same in both)."""
    op, names, kv = _signature(order, asymmetric)
    outer, shapes = _Body("f"), {}
    eps, ridge, _, g4 = _attributes(outer, decay_input)
    dims = [_shape_of(outer, d, shapes) for d in ("B", "H", "dv")]   # (made here, outside
    # the branches that use them)
    k, v = (_repeat_heads(outer, x, shapes) for x in ("k", "v"))
    init = _initial_state(outer, names, kv, state_input, shapes)
    branches = {}
    for label, prefix, make, extra in (("then_branch", "t", _one_token, ()),
                                       ("else_branch", "e", _chunks, (names, dims))):
        b = _Body(prefix)
        o, new = make(b, op, init, "q", k, v, g4, masked, normalize, eps, ridge, *extra)
        outs = [b.emit("Identity", [x]) for x in [o] + new]
        branches[label] = helper.make_graph(b.nodes, f"hla_{label}", [], [
            _typed(x, 3 if n in VECTOR_STATES else 4) for x, n in zip(outs, ("o",) + names)])
    T = outer.emit("Slice", [outer.emit("Shape", ["q"]), outer.const([2]), outer.const([3])])
    one = outer.sq(outer.emit("Equal", [T, outer.const([1])]), 0)
    res = outer.emit("If", [one], n_out=len(names) + 1, **branches)
    return _function(outer, shapes, res[0], res[1:], names, kv,
                     (order, asymmetric, masked, normalize, decay_input, state_input), opset)


def _serial_function(order=2, asymmetric=False, masked=True, normalize=False, decay_input=True,
                     state_input=True, opset=OPSET):
    """The body files exported before the chunk form carry (accepted by `check_functions`: the
    same operator, a Scan over the tokens), node for node as they were written."""
    op, names, kv = _signature(order, asymmetric)
    outer, shapes = _Body("f"), {}
    eps, ridge, gamma, g4 = _attributes(outer, decay_input)
    g3 = outer.emit("Reshape", [gamma, outer.const([1, -1, 1])])
    k, v = (_repeat_heads(outer, x, shapes) for x in ("k", "v"))
    perm = [2, 0, 1, 3]
    qT, kT, vT = (outer.emit("Transpose", [x], perm=perm) for x in ("q", k, v))
    init = _initial_state(outer, names, kv, state_input, shapes)
    body = _Body("s")
    st_in = [f"st_{n}" for n in names]
    new, out = _step(body, op, st_in, "q_t", "k_t", "v_t", g4, g3, masked, normalize, eps, ridge)
    outs = [body.emit("Identity", [x]) for x in new] + [body.emit("Identity", [out])]
    ranks = [3 if n in VECTOR_STATES else 4 for n in names]
    graph = helper.make_graph(
        body.nodes, "hla_step",
        [_typed(x, r) for x, r in zip(st_in, ranks)] +
        [_typed(x, 3) for x in ("q_t", "k_t", "v_t")],
        [_typed(x, r) for x, r in zip(outs, ranks + [3])])
    res = outer.emit("Scan", init + [qT, kT, vT], n_out=len(names) + 1, body=graph,
                     num_scan_inputs=3)
    o = outer.emit("Transpose", [res[-1]], perm=[1, 2, 0, 3])
    return _function(outer, shapes, o, res[:-1], names, kv,
                     (order, asymmetric, masked, normalize, decay_input, state_input), opset)


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
    carries in another form than the one its attributes define (`make_function`, or the
    per-token Scan of files exported before it, `_serial_function`): ONNX Runtime runs the body
    and TVM the attributes, so a body that computed something else would give two answers."""
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
            args = (var["order"], var["asymmetric"], var["masked"], var["normalize"],
                    var["decay_input"], var["state_input"], model_opset(model))
            body = _body(have[key])
            if body != _body(make_function(*args)) and \
                    body != _body(_serial_function(*args)):
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
