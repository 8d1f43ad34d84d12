"""PyTorch HLALM -> compiled TVM module -> runtime-only loader, against the PyTorch model."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import rel_err

from hla_tvm.cli import main
from hla_tvm.compiler import compile as compile_model
from hla_tvm.models import HLALM
from hla_tvm.runtime import load

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_prefill_lengths_and_decode_match_pytorch[hla2-3]",
    "test_wrong_state_is_refused[hla2]",
    "test_bad_targets_are_refused_before_export",
    "test_scale_epilogue_keeps_values",
    "test_products_of_one_input_become_one_product",
    "test_torch_tensors_in[hla2]",
    "test_decode_hands_back_the_arrays_it_advanced_in_place[hla2]",
    "test_one_stream_steps_through_the_static_batch_entry[hla2]",
}

VOCAB = 40
CONFIGS = {"hla2": dict(), "ahla": dict(asymmetric=True),
           "hla3": dict(order=3, decay=[0.9, 0.8], n_kv_heads=2)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def compiled(request, compiled_lm):
    return compiled_lm(request.param, **CONFIGS[request.param])


def _torch_logits(model, tokens, state=None):
    with torch.no_grad():
        return model(torch.as_tensor(tokens), state)


@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_lengths_and_decode_match_pytorch(compiled, batch):
    model, path = compiled
    m = load(path)
    rng = np.random.default_rng(batch)
    for T in (5, 33, 70):   # one module serves every prompt length
        tokens = rng.integers(0, VOCAB, (batch, T))
        logits, state = m.prefill(tokens, m.init_state(batch))
        ref, ref_state = _torch_logits(model, tokens)
        assert logits.shape == (batch, T, VOCAB)
        assert rel_err(torch.from_numpy(logits), ref) <= 1e-4
    for _ in range(20):
        tok = rng.integers(0, VOCAB, (batch,))
        logits, state = m.decode(tok, state)
        ref, ref_state = _torch_logits(model, tok[:, None], ref_state)
        assert rel_err(torch.from_numpy(logits), ref[:, 0]) <= 1e-4


def test_one_stream_steps_through_the_static_batch_entry(compiled, monkeypatch):
    """A module of symbolic batch carries DECODE_ONE, its decode with the batch fixed to 1 (no
    shape work per call); the runtime calls it for one stream and the symbolic decode for
    more, and both equal the float64 model along the same tokens."""
    import copy

    from hla_tvm.runtime.model import DECODE_ONE, CompiledModel

    model, path = compiled
    m = load(path)
    assert DECODE_ONE in m.entries and "decode" in m.entries
    called = []
    run = CompiledModel._run
    monkeypatch.setattr(CompiledModel, "_run",
                        lambda self, entry, *a, **k: called.append(entry) or run(self, entry,
                                                                                 *a, **k))
    ref = copy.deepcopy(model).double()
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, VOCAB, (2, 9))
    one, two = m.init_state(1), m.init_state(2)
    want_one = want_two = None
    for t in range(tokens.shape[1]):
        step1, one = m.decode(tokens[:1, t], one)
        step2, two = m.decode(tokens[:, t], two)
        ref1, want_one = _torch_logits(ref, tokens[:1, t:t + 1], want_one)
        ref2, want_two = _torch_logits(ref, tokens[:, t:t + 1], want_two)
        assert rel_err(torch.from_numpy(step1), ref1[:, 0]) <= 1e-4
        assert rel_err(torch.from_numpy(step2), ref2[:, 0]) <= 1e-4
    assert set(called[0::2]) == {DECODE_ONE} and set(called[1::2]) == {"decode"}


def test_decode_hands_back_the_arrays_it_advanced_in_place(compiled):
    """Step after step, a state entry the module advances in place comes back as the very
    array passed in (the module's own view), others as new arrays; logits as PyTorch's. The
    runtime learns which at a thread's first call, then takes the logits alone from the
    result where every entry is in place."""
    model, path = compiled
    m = load(path)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, VOCAB, (2, 5))
    _, state = m.prefill(tokens, m.init_state(2))
    _, ref_state = _torch_logits(model, tokens)
    kept = None
    for _ in range(4):
        tok = rng.integers(0, VOCAB, (2,))
        logits, new = m.decode(tok, state)
        same = [a is b for a, b in zip(new, state)]
        assert kept is None or same == kept   # the same entries, at every step
        kept, state = same, new
        ref, ref_state = _torch_logits(model, tok[:, None], ref_state)
        assert rel_err(torch.from_numpy(logits), ref[:, 0]) <= 1e-4
    # (every entry in place, the fast path then taken, unless key/value heads are grouped)
    grouped = model.config["n_kv_heads"] not in (None, model.config["n_heads"])
    assert all(kept) != grouped, (kept, model.config)


@pytest.mark.parametrize("T", [33, 34, 70])
def test_long_prompts_prefill_in_pieces(compiled, T, monkeypatch):
    """A CPU prefill longer than PREFILL_PIECE runs in pieces of whole chunks (the model's
    chunk is 16; a last piece of one token is avoided): the same logits and state as one
    call, and the PyTorch model's logits."""
    from hla_tvm.runtime import model as runtime

    model, path = compiled
    m = load(path)
    tokens = np.random.default_rng(T).integers(0, VOCAB, (2, T))
    whole, whole_state = m.prefill(tokens, m.init_state(2))
    monkeypatch.setattr(runtime, "PREFILL_PIECE", 16)
    assert len(runtime.prefill_pieces(T, 16)) > 2
    logits, state = m.prefill(tokens, m.init_state(2))
    assert logits.shape == (2, T, VOCAB)
    assert rel_err(torch.from_numpy(logits), torch.from_numpy(whole)) <= 1e-6
    assert rel_err(torch.from_numpy(logits), _torch_logits(model, tokens)[0]) <= 1e-4
    tok = np.array([3, 4])
    after, _ = m.decode(tok, state)
    want, _ = m.decode(tok, whole_state)
    assert rel_err(torch.from_numpy(after), torch.from_numpy(want)) <= 1e-6
    last, _ = m.prefill(tokens, m.init_state(2), logits="last")   # what generation keeps
    assert last.shape == (2, VOCAB) and np.array_equal(last, logits[:, -1])
    one, _ = m.prefill(tokens[:, :1], m.init_state(2), logits="last")
    assert one.shape == (2, VOCAB)
    with pytest.raises(ValueError, match="logits must be 'all' or 'last'"):
        m.prefill(tokens, m.init_state(2), logits=True)


def test_prefill_pieces():
    """Piece boundaries: whole chunks, PREFILL_PIECE rounded down to chunks, no one-token
    last piece (the prefill entry takes 2 or more)."""
    from hla_tvm.runtime import PREFILL_PIECE, prefill_pieces

    assert prefill_pieces(5, 16) == [0, 5]
    assert prefill_pieces(PREFILL_PIECE, 64) == [0, PREFILL_PIECE]
    assert prefill_pieces(PREFILL_PIECE + 1, 64) == [0, PREFILL_PIECE - 64, PREFILL_PIECE + 1]
    assert prefill_pieces(2 * PREFILL_PIECE + 5, 100)[1] % 100 == 0
    assert prefill_pieces(3 * PREFILL_PIECE, None) == [0, PREFILL_PIECE, 2 * PREFILL_PIECE,
                                                       3 * PREFILL_PIECE]


def test_torch_tensors_in(compiled):
    model, path = compiled
    m = load(path)
    tokens = torch.randint(0, VOCAB, (2, 9))
    logits, _ = m.prefill(tokens, m.init_state(2))
    assert rel_err(torch.from_numpy(logits), _torch_logits(model, tokens)[0]) <= 1e-4


def test_saved_state_continues_in_a_new_process(compiled, tmp_path):
    model, path = compiled
    m = load(path)
    prompt = np.arange(12).reshape(1, 12) % VOCAB
    _, state = m.prefill(prompt, m.init_state(1))
    m.save_state(state, tmp_path / "state.npz")
    here, _ = m.decode(np.array([7]), m.copy_state(state))
    code = textwrap.dedent(f"""
        import sys, numpy as np
        from hla_tvm.runtime import load
        m = load({str(path)!r})
        logits, st = m.decode(np.array([7]), m.load_state({str(tmp_path / 'state.npz')!r}))
        np.save({str(tmp_path / 'logits.npy')!r}, logits)
        m.save_state(st, {str(tmp_path / 'again')!r})   # (saving needs no torch either)
        assert "torch" not in sys.modules, "torch was imported"
        maps = open("/proc/self/maps").read()
        assert "libtvm_compiler" not in maps, "the TVM compiler library was loaded"
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ))
    assert run.returncode == 0, run.stderr
    assert np.array_equal(np.load(tmp_path / "logits.npy"), here)


def test_wrong_state_is_refused(compiled):
    _, path = compiled
    m = load(path)
    tokens = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match=r"must have shape \[2, "):
        m.prefill(tokens, m.init_state(3))
    with pytest.raises(ValueError, match="state must be a list of"):
        m.decode(np.zeros(2, dtype=np.int64), m.init_state(2)[:-1])
    bad = m.init_state(2)
    bad[0] = np.zeros((2, 1, 1), dtype=np.float32)
    with pytest.raises(ValueError, match=r"state entry layer0\.\w+ must have shape"):
        m.decode(np.zeros(2, dtype=np.int64), bad)
    with pytest.raises(ValueError, match=r"tokens must be an integer array of shape \[B, T\]"):
        m.prefill(np.zeros((2, 4), dtype=np.float32), m.init_state(2))
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 40\)"):
        m.decode(np.array([VOCAB, 0]), m.init_state(2))
    # the state a call returned is trusted as is, but not once the caller changes the list
    _, state = m.decode(np.zeros(2, dtype=np.int64), m.init_state(2))
    state[0] = np.zeros((2, 1, 1), dtype=np.float32)
    with pytest.raises(ValueError, match=r"state entry layer0\.\w+ must have shape"):
        m.decode(np.zeros(2, dtype=np.int64), state)
    with pytest.raises(ValueError, match="threads must be a positive int"):
        load(path, threads=0)


def test_bad_module_files(tmp_path):
    (tmp_path / "junk.so").write_bytes(b"junk")
    with pytest.raises(ValueError, match="junk.so: not a compiled module"):
        load(tmp_path / "junk.so")
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.so")


def test_cli_compile_and_run(tmp_path, capsys):
    torch.manual_seed(1)
    HLALM(VOCAB, 16, 1, 2).save(tmp_path / "ck.pt")
    assert main(["compile", str(tmp_path / "ck.pt"), "-o", str(tmp_path / "m.so")]) == 0
    assert main(["run", str(tmp_path / "m.so"), "--prompt-ids", "1,2,3", "--steps", "5"]) == 0
    out = capsys.readouterr()
    assert len(out.out.strip().splitlines()[-1].split()) == 5 and "tokens/s" in out.err
    # one thread or the default pool: the same greedy tokens (columns split, not reductions)
    assert main(["run", str(tmp_path / "m.so"), "--prompt-ids", "1,2,3", "--steps", "5",
                 "--threads", "1"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == out.out.strip().splitlines()[-1]


def test_compile_argument_checks(tmp_path):
    model = HLALM(VOCAB, 16, 1, 2)
    with pytest.raises(ValueError, match="not a records folder"):
        compile_model(model, out=tmp_path / "m.so", schedules="tuned")
    with pytest.raises(TypeError, match="schedules must be"):
        compile_model(model, out=tmp_path / "m.so", schedules=3)
    with pytest.raises(TypeError, match="HLALM-like"):
        compile_model(torch.nn.Linear(2, 2), out=tmp_path / "m.so")
    with pytest.raises(ValueError, match="max_batch"):
        compile_model(model, out=tmp_path / "m.so", max_batch=0)


def test_compile_leaves_the_model_alone(tmp_path):
    model = HLALM(VOCAB, 16, 1, 2).double().train()
    compile_model(model, out=tmp_path / "m.so")
    assert model.training and model.embed.weight.dtype == torch.float64


def test_hla_tvm_compile_twice_in_one_process_quietly(tmp_path, capfd, recwarn):
    """hla_tvm.compile stays the function (a submodule of that name used to replace it after
    the first lookup), works twice, and neither TVM's "Fast mode segfaults" take warning nor
    torch's LeafSpec FutureWarning is printed. max_batch is enforced by the runtime."""
    import importlib

    import hla_tvm

    print(hla_tvm.compile)
    for name in ("compiler", "runtime", "api", "onnx"):
        importlib.import_module(f"hla_tvm.{name}")
    torch.manual_seed(3)
    model = HLALM(VOCAB, 16, 1, 2).eval()
    capfd.readouterr()
    for out in ("a.so", "b.so"):
        assert callable(hla_tvm.compile)
        hla_tvm.compile(model, out=tmp_path / out, max_batch=2)
    captured = capfd.readouterr()
    assert "Fast mode" not in captured.out + captured.err
    assert not [w for w in recwarn if "LeafSpec" in str(w.message)]
    m = load(tmp_path / "b.so")
    assert m.max_batch == 2
    with pytest.raises(ValueError, match="batch 3 exceeds this module's max_batch 2"):
        m.init_state(3)
    with pytest.raises(ValueError, match="batch 3 exceeds this module's max_batch 2"):
        m.prefill(np.zeros((3, 4), dtype=np.int64), m.init_state(2))
    with pytest.raises(ValueError, match="batch 3 exceeds this module's max_batch 2"):
        m.decode(np.zeros(3, dtype=np.int64), m.init_state(2))
    logits, _ = m.prefill(np.ones((2, 4), dtype=np.int64), m.init_state(2))
    want = _torch_logits(model, np.ones((2, 4), dtype=np.int64))[0]
    assert rel_err(torch.from_numpy(logits), want) <= 1e-4


def test_a_module_for_one_stream_has_a_static_batch(tmp_path):
    """max_batch=1 compiles (a static batch: torch.export's dims span two values at least),
    its prefill and decode equal the float64 model, and a batch of 2 is refused. Its norms run
    serially (`SerialSmall`), not once per weight element in parallel as dlight's rule had
    them (the logits are the same either way; speed: docs/cpu_schedules.md)."""
    import copy

    torch.manual_seed(4)
    model = HLALM(VOCAB, 32, 2, 4, chunk_size=16).eval()
    m = load(compile_model(model, out=tmp_path / "one.so", max_batch=1))
    assert m.max_batch == 1
    tokens = np.random.default_rng(4).integers(0, VOCAB, (1, 23))
    logits, state = m.prefill(tokens[:, :22], m.init_state(1))
    ref = copy.deepcopy(model).double()
    want, want_state = _torch_logits(ref, tokens[:, :22])
    assert rel_err(torch.from_numpy(logits), want) <= 1e-4
    step, _ = m.decode(tokens[:, 22], state)
    want, _ = _torch_logits(ref, tokens[:, 22:], want_state)
    assert rel_err(torch.from_numpy(step), want[:, 0]) <= 1e-4
    with pytest.raises(ValueError, match="batch 2 exceeds this module's max_batch 1"):
        m.decode(np.zeros(2, dtype=np.int64), m.init_state(1))


@pytest.mark.parametrize("target, error", [
    ("llvm -mcpu=znver4", ValueError), ({"kind": "llvm", "mcpu": "notacpu"}, ValueError),
    ({"kind": "nope"}, ValueError), (3, TypeError)])
def test_bad_targets_are_refused_before_export(tmp_path, target, error):
    with pytest.raises(error, match="target"):
        compile_model(HLALM(VOCAB, 16, 1, 2), out=tmp_path / "m.so", target=target)
    assert not (tmp_path / "m.so").exists()


def test_target_strings_tvm_parses_are_accepted():
    from hla_tvm.target import host_target, resolve

    assert resolve("llvm") is host_target() and resolve(None) is host_target()
    assert resolve('{"kind": "llvm", "mcpu": "znver4"}').attrs["mcpu"] == "znver4"
    assert resolve("c").kind.name == "c"
    assert resolve("nvidia/nvidia-a100").kind.name == "cuda"


def test_rms_norms_become_one_operator_each():
    """The RMSNorm as torch.export gives it (x * rsqrt(mean(x ** 2) + eps) * w) becomes one
    relax.nn.rms_norm per norm: 2 a block, the final one, and each attention's per-head output
    norm; the two kernels each took before (TVM fuses no element-wise producer into a
    reduction) are gone. Numerics: the compiled models above against PyTorch."""
    import re

    from hla_tvm import compiler
    from hla_tvm.compiler.passes.fused_rms_norm import fused_rms_norm

    torch.manual_seed(0)
    model = HLALM(VOCAB, 32, 3, 4, chunk_size=16).eval()
    mod = compiler.to_relax(model, target=compiler.resolve_model_target("llvm"))
    text = fused_rms_norm(mod)["decode"].script()
    assert len(re.findall(r"R\.nn\.rms_norm\(", text)) == 3 * 3 + 1
    assert "R.power(" not in text and "R.rsqrt(" not in text
    assert mod["decode"].script().count("R.power(") == 3 * 3 + 1   # the caller's module kept


@pytest.mark.parametrize("axis, power, weight", [([-1], 2.0, 4), ([0], 2.0, 4), ([-1], 3.0, 4),
                                                 ([-1], 2.0, 1)])
def test_only_the_rms_norm_form_is_rewritten(axis, power, weight):
    """A mean over another axis, another power, or a weight not of the last dimension's size
    stays as it is."""
    from tvm import relax

    from hla_tvm.compiler.passes.fused_rms_norm import fused_rms_norm

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 4], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            m = bb.emit(relax.op.mean(relax.op.power(x, relax.const(power, "float32")),
                                      axis=axis, keepdims=True))
            r = bb.emit(relax.op.rsqrt(relax.op.add(m, relax.const(1e-6, "float32"))))
            y = bb.emit_output(relax.op.multiply(relax.op.multiply(x, r), relax.const(
                np.ones(weight, dtype="float32"))))
        bb.emit_func_output(y)
    text = fused_rms_norm(bb.get())["main"].script()
    assert ("R.nn.rms_norm(" in text) == (axis == [-1] and power == 2.0 and weight == 4)


@pytest.mark.parametrize("shape, dtype, axis", [
    ([64], "float32", [-1]), ([2, "n"], "float32", [-1]), ([2, 4], "float16", [-1]),
    ([2, 4], "float32", None)])
def test_rms_norm_rewrite_leaves_what_it_cannot_take(shape, dtype, axis):
    """Rank 1, a symbolic last dimension, float16 (TVM's rms_norm computes in float32) and a
    mean over every axis keep their form, and the module still legalizes."""
    import tvm
    from tvm import relax

    from hla_tvm.compiler.passes.fused_rms_norm import fused_rms_norm

    n = tvm.tirx.Var("n", "int64")
    dims = [n if d == "n" else d for d in shape]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(dims, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            m = bb.emit(relax.op.mean(relax.op.power(x, relax.const(2.0, dtype)), axis=axis,
                                      keepdims=True))
            r = bb.emit(relax.op.rsqrt(relax.op.add(m, relax.const(1e-6, dtype))))
            y = bb.emit_output(relax.op.multiply(relax.op.multiply(x, r), relax.const(
                np.ones(shape[-1] if shape[-1] != "n" else 1, dtype=dtype))))
        bb.emit_func_output(y)
    out = fused_rms_norm(bb.get())
    assert "R.nn.rms_norm(" not in out["main"].script()
    relax.transform.LegalizeOps()(out)


def test_decode_scales_run_in_their_projections():
    """At decode (T = 1) the q and k scales, (x @ W).view(B, 1, H, d).transpose(1, 2) / sqrt(d),
    become the projections' epilogues: the transposes move only the unit axis (reshapes), and
    the scale moves past the reshapes to the product. Prefill's transposes move T and stay.
    Numerics: the compiled models above against PyTorch."""
    from hla_tvm import compiler
    from hla_tvm.compiler.passes.scale_epilogue import scale_epilogue

    torch.manual_seed(0)
    model = HLALM(VOCAB, 32, 3, 4, chunk_size=16).eval()
    mod = compiler.to_relax(model, target=compiler.resolve_model_target("llvm"))
    out = scale_epilogue(mod)
    decode = out["decode"].script()
    assert "R.permute_dims(lv" not in decode   # (the weights' transposes are constants)
    scales = [line for line in decode.splitlines() if "R.divide(" in line]
    assert len(scales) == 2 * 3
    products = {line.split(":")[0].strip() for line in decode.splitlines()
                if "R.matmul(" in line}
    assert all(line.split("R.divide(")[1].split(",")[0] in products for line in scales)
    prefill = out["prefill"].script()
    assert prefill.count("R.permute_dims(lv") == mod["prefill"].script().count(
        "R.permute_dims(lv")
    assert "R.divide(lv" in mod["decode"].script() and \
        mod["decode"].script().count("R.permute_dims(lv") > 0   # the caller's module kept


def _run_relax(mod, *args):
    import tvm
    from tvm import relax

    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


@pytest.mark.parametrize("case", ["unit", "moves_t", "symbolic", "const_first", "bound_const",
                                  "multiply", "vector"])
def test_scale_epilogue_keeps_values(case):
    """Each rewrite gives the values of numpy's float64 product, and leaves alone what it cannot
    take: a transpose moving a non-unit (or symbolic) axis stays a transpose, a constant that
    is not 0-d stays after the reshape; c / reshape(z) keeps its operand order, also with c
    bound to a variable of its own."""
    import tvm
    from tvm import relax

    from hla_tvm.compiler.passes.scale_epilogue import scale_epilogue

    t = tvm.tirx.Var("t", "int64") if case == "symbolic" else (3 if case == "moves_t" else 1)
    c = relax.const(np.full(3, 4.0, "float32") if case == "vector" else np.float32(4.0))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, t, 6], "float32"))
    w = np.random.default_rng(0).standard_normal((6, 6)).astype("float32")
    with bb.function("main", [x]):
        with bb.dataflow():
            m = bb.emit(relax.op.matmul(x, relax.const(w)))
            r = bb.emit(relax.op.reshape(m, [2, t, 2, 3]))
            p = bb.emit(relax.op.permute_dims(r, [0, 2, 1, 3]))
            if case == "bound_const":
                c = bb.emit(c)
            first = case in ("const_first", "bound_const")
            op = relax.op.multiply if case == "multiply" else relax.op.divide
            y = bb.emit_output(op(c, p) if first else op(p, c))
        bb.emit_func_output(y)
    out = scale_epilogue(bb.get())
    text = out["main"].script()
    assert ("R.permute_dims(" in text) == (case in ("moves_t", "symbolic"))
    last = [line for line in text.splitlines() if line.strip().startswith("gv")][0]
    assert ("R.reshape(" in last) == (case in ("unit", "const_first", "bound_const", "multiply"))
    xs = np.random.default_rng(1).standard_normal((2, 3 if case in ("moves_t", "symbolic")
                                                   else 1, 6)).astype("float32")
    p = (xs.astype(np.float64) @ w).reshape(2, -1, 2, 3).transpose(0, 2, 1, 3)
    want = p * 4.0 if case == "multiply" else 4.0 / p if first else p / 4.0
    np.testing.assert_allclose(_run_relax(out, xs), want, rtol=1e-5, atol=1e-6)


def test_products_of_one_input_become_one_product():
    """`parallel_products`: x's three products with constant weights (one given as nn.Linear's
    [N, K] through a transpose) become one product of the concatenated [K, 8 + 5 + 3] weight
    and slices of it, z's two another; x's product with a weight that is not a constant, and
    its product in another binding block, stay as they were. Values: numpy's float64
    products."""
    import tvm
    from tvm import relax

    from hla_tvm.compiler.passes.parallel_products import parallel_products

    rng = np.random.default_rng(0)
    t = tvm.tirx.Var("t", "int64")
    x = relax.Var("x", relax.TensorType([2, t, 6], "float32"))
    z = relax.Var("z", relax.TensorType([2, t, 4], "float32"))
    p = relax.Var("p", relax.TensorType([6, 7], "float32"))
    w = [rng.standard_normal(s).astype("float32") for s in ((6, 8), (5, 6), (6, 3), (4, 6),
                                                            (4, 2))]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, z, p]):
        with bb.dataflow():
            a = bb.emit(relax.op.matmul(x, relax.const(w[0])))
            wt = bb.emit(relax.op.permute_dims(relax.const(w[1]), [1, 0]))
            b = bb.emit(relax.op.matmul(x, wt))
            c = bb.emit(relax.op.matmul(x, relax.const(w[2])))
            d = bb.emit(relax.op.matmul(z, relax.const(w[3])))   # another input
            e = bb.emit(relax.op.matmul(x, p))                  # a weight not a constant
            f = bb.emit(relax.op.matmul(z, relax.const(w[4])))
            y = bb.emit_output(relax.Tuple([a, b, c, d, e, f]))
        g = bb.emit(relax.op.matmul(x, relax.const(w[0])))   # another block: stays apart
        bb.emit_func_output(relax.Tuple([*[y[i] for i in range(6)], g]))
    mod = bb.get()
    out = parallel_products(mod)
    text = out["main"].script()
    assert text.count("R.matmul(") == 4 and text.count("R.strided_slice(") == 2 + 3
    assert "R.Tensor((2, t, 16)" in text and "R.Tensor((2, t, 6)" in text   # x's and z's
    assert mod["main"].script().count("R.matmul(") == 7   # the caller's module kept
    xs, zs = (rng.standard_normal((2, 3, k)).astype("float32") for k in (6, 4))
    ps = rng.standard_normal((6, 7)).astype("float32")
    exe = tvm.compile(out, target="llvm")
    got = relax.VirtualMachine(exe, tvm.cpu())["main"](
        *[tvm.runtime.tensor(v) for v in (xs, zs, ps)])
    x64, z64 = xs.astype(np.float64), zs.astype(np.float64)
    want = [x64 @ w[0], x64 @ w[1].T, x64 @ w[2], z64 @ w[3], x64 @ ps, z64 @ w[4], x64 @ w[0]]
    for g, v in zip(got, want):
        np.testing.assert_allclose(g.numpy(), v, rtol=1e-5, atol=1e-5)
