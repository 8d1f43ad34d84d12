"""Tensor patterns of real model code around the HLA layers, compiled as PyTorch means them,
each checked against PyTorch eager on the same model or tensors:
  - indexing the time axis from its end (`h[:, -1]`, `h[:, T - 1]`: last-token pooling, a
    token shift), where the frontend's safe `take` once clamped index -1 to row 0;
  - `cumsum` (transformers' `position_ids = attention_mask.cumsum(-1) - 1`) and
    `Tensor.scatter`, whose kernels TVM's legalizer emits without a root block, which the CPU
    schedule rules assumed (a crash in `ParallelFallback`);
  - slices of the time axis: a token shift `torch.cat([prev, h[:, :-1]], 1)` (RWKV, Mamba's
    convolutions), which torch.export refused for prompts of two tokens, and `h + h[:, -1:]`,
    whose shape TVM lost ("emit_te now only supports Tensor that has ShapeExpr shape")."""
import numpy as np
import pytest
import torch
from conftest import rel_err
from torch import nn

from hla_tvm.compiler import compile as compile_model
from hla_tvm.nn import HLAttention
from hla_tvm.runtime import load

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_take_keeps_pytorch_indexing",
    "test_token_id_lookup_stays_in_bounds",
    "test_stored_table_lookup_counts_negative_ids_from_the_end",
    "test_rules_leave_kernels_without_a_root_block",
    "test_last_row_matches_pytorch_in_prefill_and_decode[negative]",
}

VOCAB, D, HEADS = 40, 16, 2


class _Tiny(nn.Module):
    """Embedding, one HLA layer with a residual, a linear head; `mix` (the pattern under
    test) turns the tokens and the hidden rows [B, T, D] into the rows the head reads."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.attn = HLAttention(D, HEADS, decay=0.9)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def init_state(self, batch):
        return [self.attn.init_state(batch)]

    def inputs(self, tokens):
        return self.embed(tokens)

    def forward(self, tokens, state=None):
        x = self.inputs(tokens)
        y, st = self.attn(x, None if state is None else state[0])
        return self.head(self.mix(tokens, x + y)), [st]

    def mix(self, tokens, h):
        return h


class LastRowLM(_Tiny):
    """The last position's hidden row added to every position (last-token pooling mixed back
    in), taken as `h[:, -1]` ("negative") or `h[:, T - 1]` with T = h.shape[1] ("symbolic")."""

    def __init__(self, pick):
        super().__init__()
        self.pick = pick

    def mix(self, tokens, h):
        last = h[:, -1] if self.pick == "negative" else h[:, h.shape[1] - 1]
        return h + last[:, None]


class CumsumLM(_Tiny):
    """Learned positions from a mask's cumsum, as transformers computes position_ids (int64),
    and a running sum of the embeddings over time (float32)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(32, D)

    def inputs(self, tokens):
        position_ids = (tokens >= 0).long().cumsum(-1) - 1
        x = self.embed(tokens) + self.pos(position_ids)
        return x + 0.25 * torch.cumsum(x, 1)


class ScatterLM(_Tiny):
    """Tensor.scatter into the hidden rows (a row sum written at a column the token picks:
    scatter.src) and into a fresh zeros tensor (one-hot marks: scatter.value)."""

    def mix(self, tokens, h):
        h = h.scatter(-1, (tokens % D)[..., None], h.sum(-1, keepdim=True))
        marks = torch.zeros_like(h).scatter(-1, (tokens * 3 % D)[..., None], 1.0)
        return h + marks


class ShiftLM(_Tiny):
    """A token shift, as RWKV writes it: each row mixed with the row before it, the first with
    the last row of the step before (a state entry of the model's own):
    `torch.cat([prev[:, None], h[:, :-1]], 1)`."""

    def init_state(self, batch):
        return [self.attn.init_state(batch), {"prev": torch.zeros(batch, D)}]

    def forward(self, tokens, state=None):
        x = self.inputs(tokens)
        y, st = self.attn(x, None if state is None else state[0])
        h = x + y
        prev = torch.zeros(h.shape[0], D) if state is None else state[1]["prev"]
        shifted = torch.cat([prev[:, None], h[:, :-1]], 1)
        return self.head(h + 0.5 * shifted), [st, {"prev": h[:, -1]}]


class PadShiftLM(ShiftLM):
    """The same token shift written with F.pad, as Mamba's and many hybrids' causal mixes are:
    `F.pad(h, (0, 0, 1, 0))[:, :T]`, its first row then taken from the state."""

    def forward(self, tokens, state=None):
        x = self.inputs(tokens)
        y, st = self.attn(x, None if state is None else state[0])
        h = x + y
        prev = torch.zeros(h.shape[0], D) if state is None else state[1]["prev"]
        shifted = torch.nn.functional.pad(h, (0, 0, 1, 0))[:, :h.shape[1]]
        first = (torch.arange(h.shape[1]) == 0)[None, :, None]
        shifted = torch.where(first, prev[:, None], shifted)
        return self.head(h + 0.5 * shifted), [st, {"prev": h[:, -1]}]


class RingLM(_Tiny):
    """A buffer of the last 4 rows in the state, written with index_copy at the position
    counter (a static KV cache's pattern); each output reads the buffer's mean."""

    def init_state(self, batch):
        return [self.attn.init_state(batch), {"ring": torch.zeros(batch, 4, D),
                                              "pos": torch.zeros(batch, dtype=torch.int64)}]

    def forward(self, tokens, state=None):
        x = self.inputs(tokens)
        y, st = self.attn(x, None if state is None else state[0])
        ring = torch.zeros(x.shape[0], 4, D) if state is None else state[1]["ring"]
        pos = torch.zeros(x.shape[0], dtype=torch.int64) if state is None else state[1]["pos"]
        ring = ring.index_copy(1, (pos[0] + torch.arange(x.shape[1])) % 4, x + y)
        return self.head(y + ring.mean(1, keepdim=True)), [st, {"ring": ring,
                                                                "pos": pos + x.shape[1]}]


class LastSliceLM(_Tiny):
    """The last row as a one-row slice, `h + h[:, -1:]`."""

    def mix(self, tokens, h):
        return h + h[:, -1:]


class LengthBranchLM(_Tiny):
    """Code that branches on the prompt's length beyond a few values (refused)."""

    def mix(self, tokens, h):
        return h * 2 if h.shape[1] > 300 else h


MODELS = {"negative": lambda: LastRowLM("negative"), "symbolic": lambda: LastRowLM("symbolic"),
          "cumsum": CumsumLM, "scatter": ScatterLM, "shift": ShiftLM, "pad_shift": PadShiftLM, "ring": RingLM,
          "last_slice": LastSliceLM}


@pytest.fixture(scope="module")
def compiled_pattern(tmp_path_factory):
    """name -> (the PyTorch model, its compiled module loaded), compiled once per module."""
    done = {}

    def get(name):
        if name not in done:
            torch.manual_seed(0)
            model = MODELS[name]().eval()
            path = tmp_path_factory.mktemp(name) / f"{name}.so"
            compile_model(model, out=path)
            done[name] = model, load(path)
        return done[name]

    return get


def _check_prefill_and_decode(model, m, lengths=(2, 5, 13), steps=3, batch=2):
    """Prefill of each length from a fresh state, then `steps` decode steps from the last
    prefill's state (batch `batch`, and one stream through the static batch entry), each
    against PyTorch."""
    g = torch.Generator().manual_seed(1)
    for T in lengths:
        tokens = torch.randint(0, VOCAB, (batch, T), generator=g)
        with torch.no_grad():
            want, st = model(tokens, None)
        got, state = m.prefill(tokens.numpy(), m.init_state(batch))
        assert rel_err(torch.from_numpy(got), want) <= 1e-5, f"prefill of {T} tokens"
    for b in (batch, 1):
        st_b = [{k: v[:b].clone() for k, v in layer.items()} for layer in st]
        state_b = m.init_state(b)
        state_b = m.prefill(tokens[:b].numpy(), state_b)[1]
        for step in range(steps):
            nxt = torch.randint(0, VOCAB, (b,), generator=g)
            with torch.no_grad():
                want, st_b = model(nxt[:, None], st_b)
            got, state_b = m.decode(nxt.numpy(), state_b)
            assert rel_err(torch.from_numpy(got), want[:, 0]) <= 1e-5, \
                f"decode step {step} (batch {b})"


@pytest.mark.parametrize("pick", ["negative", "symbolic"])
def test_last_row_matches_pytorch_in_prefill_and_decode(compiled_pattern, pick):
    """h[:, -1] and h[:, T - 1] give the last row in prefill (T symbolic) and decode (T = 1):
    "clip" mode once clamped -1 to row 0, and TVM's importer refused the symbolic index
    ("value has to be scalar or Tensor")."""
    _check_prefill_and_decode(*compiled_pattern(pick))


def test_cumsum_positions_match_pytorch(compiled_pattern):
    """cumsum (int64 positions from a mask, float32 running sums) compiles (its kernel has no
    root block: ParallelFallback raised "Cannot find a block with the name: root") and
    matches."""
    _check_prefill_and_decode(*compiled_pattern("cumsum"))


def test_scatter_matches_pytorch(compiled_pattern):
    """Tensor.scatter (a tensor source and a value) compiles and matches."""
    _check_prefill_and_decode(*compiled_pattern("scatter"))


def test_token_shift_matches_pytorch_at_every_length(compiled_pattern):
    """The token shift compiles (torch.export's guard "T - 1 != 1" kept as a runtime
    assertion: the module records that its prefill must not take 2 tokens, which the runtime
    runs as decode steps) and matches PyTorch for prompts of 2, 3, 5 and 13 tokens and the
    decode steps after them."""
    model, m = compiled_pattern("shift")
    assert m.meta["prefill_skips"] == [2]
    _check_prefill_and_decode(model, m, lengths=(2, 3, 5, 13))


def test_a_token_shift_through_pad_matches_pytorch(compiled_pattern):
    """`F.pad(h, (0, 0, 1, 0))[:, :T]` (once refused by TVM's importer: `prim.if_then_else`
    had no type rule) compiles and matches PyTorch at every length and in decode."""
    model, m = compiled_pattern("pad_shift")
    _check_prefill_and_decode(model, m, lengths=(1, 2, 3, 5, 13))


def test_index_copy_into_a_state_buffer_matches_pytorch(compiled_pattern):
    """`buf.index_copy(1, positions % 4, rows)` (decomposed as a scatter: torch's index_put
    form was refused by TVM's importer) compiles and matches in prefill and decode (prompts of
    at most 4 tokens: longer ones write a row twice, which PyTorch leaves undefined)."""
    _check_prefill_and_decode(*compiled_pattern("ring"), lengths=(1, 2, 4))


def test_a_one_row_slice_of_the_time_axis_matches_pytorch(compiled_pattern):
    """`h + h[:, -1:]` keeps its shape through TVM's importer (`compiler.passes.shape_bounds`) and
    matches."""
    model, m = compiled_pattern("last_slice")
    assert "prefill_skips" not in m.meta
    _check_prefill_and_decode(model, m)


@pytest.mark.parametrize("name", ["shift", "last_slice"])
def test_time_axis_slices_through_onnx(name, tmp_path):
    """The token shift (`h[:, :-1]`) and `h + h[:, -1:]` through the ONNX route: exported with
    `hla_tvm.onnx.export` (from a state: the shift keeps its last row), they run in ONNX
    Runtime and compile with `hla_tvm.onnx.compile`
    (TVM's ONNX importer left the slice's length min(max(T - 1, 0), T), and legalizing failed:
    "emit_te now only supports Tensor that has ShapeExpr shape"), matching PyTorch in prefill
    of 2 to 13 tokens and the decode steps after."""
    from hla_tvm import onnx as hla_onnx
    from hla_tvm.compiler import flatten_state

    torch.manual_seed(0)
    model = MODELS[name]().eval()
    path = tmp_path / f"{name}.onnx"
    hla_onnx.export(model, path, from_state=True)
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, _ = model(tokens, None)
    feeds = {"tokens": tokens.numpy()}
    for n, x in zip((i.name for i in hla_onnx.session(path).get_inputs()[1:]),
                    flatten_state(model.init_state(2))):
        feeds[n] = x.numpy()
    got = hla_onnx.session(path).run(None, feeds)[0]
    assert rel_err(torch.from_numpy(got), want) <= 1e-5
    m = load(hla_onnx.compile(path, out=tmp_path / f"{name}.so"))
    _check_prefill_and_decode(model, m, lengths=(2, 3, 5, 13))
    if name == "shift":   # a fresh-start graph cannot take the state of the model's own
        hla_onnx.export(model, tmp_path / "fresh.onnx")
        with pytest.raises(ValueError, match="export it with from_state=True"):
            hla_onnx.compile(tmp_path / "fresh.onnx", out=tmp_path / "fresh.so")


def test_code_branching_on_the_prompt_length_is_refused_in_one_line(tmp_path):
    """A model whose code takes another branch beyond 300 tokens cannot have one symbolic
    prefill: refused in one line naming the condition, no module written."""
    torch.manual_seed(0)
    with pytest.raises(ValueError) as err:
        compile_model(LengthBranchLM().eval(), out=tmp_path / "m.so")
    msg = str(err.value)
    assert "\n" not in msg and "prompt's length" in msg and "300" in msg, msg
    assert not (tmp_path / "m.so").exists()


def _relax_module(build, arrays):
    """The Relax module whose main(*params) returns the tuple build(bb, params), params named
    and typed by `arrays` ({name: (shape, dtype)})."""
    from tvm import relax

    bb = relax.BlockBuilder()
    params = [relax.Var(name, relax.TensorType(shape, dtype))
              for name, (shape, dtype) in arrays.items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.Tuple(build(bb, params)))
        bb.emit_func_output(out)
    return bb.get()


def _relax_vm(build, arrays):
    """A VM of `_relax_module(build, arrays)` passed through `safe_take` (as `compile` does)
    and built by the CPU pipeline."""
    import tvm
    from tvm import relax

    from hla_tvm.compiler import cpu_pipeline
    from hla_tvm.compiler.passes.safe_take import safe_take
    from hla_tvm.target import resolve

    tgt = resolve("llvm")
    mod = safe_take(_relax_module(build, arrays))
    return relax.VirtualMachine(tvm.compile(mod, target=tgt, relax_pipeline=cpu_pipeline(tgt)),
                                tvm.cpu())


def _vm_outputs(vm, inputs):
    import tvm

    got = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs])
    return [g.numpy() for g in got]


def test_take_keeps_pytorch_indexing():
    """Every take the frontend makes safe keeps PyTorch's meaning: a negative constant index on
    a symbolic axis (the time axis) and on a static one, a list of constant indices, and
    index tensors with negative entries (what `x[:, idx]` makes), against torch's own
    indexing of the same tensor, at several lengths of the symbolic axis (1 included)."""
    from tvm import relax, tirx

    T = tirx.Var("T", "int64")

    def build(bb, params):
        x, idx = params
        take = relax.op.take
        return [bb.emit(take(x, relax.const(-1, "int64"), 1)),
                bb.emit(take(x, relax.const(np.array([-1, 0, -2]), "int64"), 1)),
                bb.emit(take(x, relax.const(-1, "int64"), 2)),
                bb.emit(take(x, relax.const(np.array([-4, 3]), "int64"), 2)),
                bb.emit(take(x, idx, 1))]

    vm = _relax_vm(build, {"x": ((2, T, 4), "float32"), "idx": ((3,), "int64")})
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5):
        x = torch.randn(2, n, 4, generator=g)
        idx = torch.tensor([-1, 0, n - 1])
        got = _vm_outputs(vm, [x.numpy(), idx.numpy()])
        want = [x[:, -1], x[:, [-1, 0, -2]] if n > 1 else None,   # (-2: outside one row)
                x[:, :, -1], x[:, :, [-4, 3]], x[:, idx]]
        for i, (a, b) in enumerate(zip(got, want)):
            if b is not None:
                np.testing.assert_array_equal(a, b.numpy(), err_msg=f"take {i} at T = {n}")


def test_token_id_lookup_stays_in_bounds():
    """The token-id lookup keeps reading in bounds: an id past the table (which the runtime
    refuses before a call, but a direct VM call may pass) reads the last row, a negative one
    the first, never memory outside the table."""
    from tvm import relax, tirx

    T = tirx.Var("T", "int64")
    table = np.arange(5 * 3, dtype="float32").reshape(5, 3)

    def build(bb, params):
        (tokens,) = params
        flat = bb.emit(relax.op.reshape(tokens, (T,)))
        return [bb.emit(relax.op.take(relax.const(table), flat, 0))]

    vm = _relax_vm(build, {"tokens": ((1, T), "int64")})
    ids = torch.tensor([[0, 4, 2, 7, 1000, -1, -100]])
    (got,) = _vm_outputs(vm, [ids.numpy()])
    want = torch.from_numpy(table)[ids[0].clamp(0, 4)]
    np.testing.assert_array_equal(got, want.numpy())


def test_stored_table_lookup_counts_negative_ids_from_the_end():
    """A lookup into a table `pack_weights` stores (`quant.kernels.take`, a tied embedding's
    rows) indexes as torch indexes the table: a negative id counts from the end; an id past
    the table reads its last row, never memory outside it."""
    import tvm
    from tvm import te

    from hla_tvm.quant import kernels
    from hla_tvm.target import resolve

    K, N = 3, 5
    q = te.placeholder((K, N), "float32", name="q")   # the table W^T [N, K] stored as [K, N]
    ids = te.placeholder((6,), "int64", name="ids")
    out = kernels.take(q, None, ids, sch=None, k=K, n=N, group=None)
    lib = tvm.compile(te.create_prim_func([q, ids, out]), target=resolve("llvm"))
    table = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([0, -1, 4, -5, 2, 9])
    got = tvm.runtime.tensor(np.zeros((6, K), "float32"))
    lib["main"](tvm.runtime.tensor(table.T.contiguous().numpy()), tvm.runtime.tensor(idx.numpy()),
                got)
    np.testing.assert_array_equal(got.numpy()[:5], table[idx[:5]].numpy())
    np.testing.assert_array_equal(got.numpy()[5], table[N - 1].numpy())


def test_rules_leave_kernels_without_a_root_block():
    """The kernels TVM's legalizer emits for cumsum and scatter_elements have no block named
    "root": every CPU rule declines or leaves them (no exception), the helpers the CUDA rules
    share see no blocks, and the whole CPU pipeline computes what torch does."""
    import tvm_ffi
    from tvm import relax, s_tir, tirx

    from hla_tvm.compiler import legalize
    from hla_tvm.schedule import common
    from hla_tvm.schedule.rules import cpu
    from hla_tvm.schedule.steps.cuda import inline_scratch, scan_lanes, shared_scratch
    from hla_tvm.target import resolve

    T = tirx.Var("T", "int64")

    def build(bb, params):
        x, idx, ids = params
        return [bb.emit(relax.op.cumsum(x, axis=1)),
                bb.emit(relax.op.cumsum(ids, axis=1, dtype="int64")),
                bb.emit(relax.op.scatter_elements(x, idx, x, axis=2))]

    arrays = {"x": ((2, T, 8), "float32"), "idx": ((2, T, 8), "int64"),
              "ids": ((2, T), "int64")}
    tgt = resolve("llvm")
    legal = legalize(_relax_module(build, arrays), tgt)
    rootless = 0
    for _, func in legal.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        sch = s_tir.Schedule(func)
        if common.root_block(sch) is not None:
            continue
        rootless += 1
        assert common.root_blocks(sch) == [] and common.root_scratch(sch) == []
        assert common.independent_outer_loops(sch) == []
        for rule in (cpu.GroupMatvec(), cpu.MatmulTiles(), cpu.SerialSmall(),
                     cpu.ParallelFallback()):
            assert rule.apply(func, tgt, False) is None, type(rule).__name__
        assert not scan_lanes.scan_lanes(sch, 128)
        inline_scratch.inline_scratch(sch, "main")
        shared_scratch.shared_scratch(sch, "main")
        assert tvm_ffi.structural_equal(sch.mod["main"], func)
    assert rootless >= 2   # (cumsum's and scatter's kernels)

    vm = _relax_vm(build, arrays)
    g = torch.Generator().manual_seed(0)
    for n in (1, 6):
        x = torch.randn(2, n, 8, generator=g)
        idx = torch.stack([torch.randperm(8, generator=g) for _ in range(2 * n)]).view(2, n, 8)
        ids = torch.randint(0, 9, (2, n), generator=g)
        got = _vm_outputs(vm, [x.numpy(), idx.numpy(), ids.numpy()])
        want = [torch.cumsum(x, 1), torch.cumsum(ids, 1), x.scatter(2, idx, x)]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-5)


def test_small_whole_powers_become_products():
    """torch.pow(x, 3.0) (GELU-new), x ** 2 and x ** 4 become products of x (TVM's `pow`
    warned on every kernel with an exponent of 3 or more); x ** 2.5 stays a power; the
    compiled function equals PyTorch, negative x included."""
    import tvm
    from tvm import relax

    from hla_tvm.compiler.passes.int_power import int_power
    from hla_tvm.compiler.torch_export import import_exported

    class Powers(nn.Module):
        def forward(self, x):
            return torch.pow(x, 3.0) + x ** 2 + x ** 4 + x.abs() ** 2.5

    x = torch.randn(4, 16)
    mod = int_power(import_exported(torch.export.export(Powers(), (x,))))
    text = mod.script()
    assert text.count("R.power") == 1 and 'R.const(2.5' in text
    ex = relax.build(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x.numpy()))[0].numpy()
    np.testing.assert_allclose(got, Powers()(x).numpy(), rtol=1e-5, atol=1e-5)


class IndexAssignLM(_Tiny):
    """Rows assigned in place through a tensor index on the second axis (`buf[:, idx] = h`),
    which TVM's importer cannot convert (index_put with a None index)."""

    def mix(self, tokens, h):
        buf = torch.zeros(h.shape[0], 4, D)
        buf[:, tokens[0] % 4] = h
        return h + buf.sum(1, keepdim=True)


def test_a_pattern_the_importer_cannot_convert_is_named_in_one_line(tmp_path):
    """The error names the PyTorch op and the model's source line torch kept (here the
    forward that calls `mix`), in one line, not a dump."""
    with pytest.raises(ValueError) as err:
        compile_model(IndexAssignLM().eval(), out=tmp_path / "x.so")
    msg = str(err.value)
    assert "\n" not in msg and "index_put" in msg, msg
    assert "test_frontend_patterns.py:" in msg and "self.mix(tokens" in msg, msg
