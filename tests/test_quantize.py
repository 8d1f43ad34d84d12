"""Quantized weights (`hla_tvm.quant`): the packed values against an independent float64
quantization, compiled quantized models against PyTorch running the same dequantized weights
(prefill and decode, tied and untied heads, weights kept float32), and schemes refused in one
line."""
import json

import numpy as np
import pytest
import torch
from conftest import rel_err, scheme_tol

from hla_tvm.quant import scheme
from hla_tvm.quant.scheme import dequantize, quantize, values

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_packed_values_are_the_rounded_scaled_weights",
    "test_int4_nibbles_sit_in_byte_rows",
    "test_bf16_rounds_as_torch_does",
    "test_bad_schemes_are_refused_naming_the_argument",
    "test_the_command_refuses_a_group_size_it_cannot_use_in_one_line",
    "test_compiled_model_equals_pytorch_with_dequantized_weights[int4-None-True-32]",
}


def _weight(k, n, seed=0):
    """Random float32 [K, N] with a few large entries (scales set by outliers)."""
    g = np.random.default_rng(seed)
    w = g.standard_normal((k, n)).astype(np.float32) * 0.05
    w[g.integers(0, k, 8), g.integers(0, n, 8)] *= 40
    w[:, 3] = 0.0   # an all-zero column: scale 0, values 0
    return w


@pytest.mark.parametrize("name, group", [("int8", None), ("int8", 32), ("int4", 32),
                                         ("int4", 64), ("int4", 128)])
def test_packed_values_are_the_rounded_scaled_weights(name, group):
    """q = round(w / s) (half to even) with s = max |w| / (127 or 7) over each group (float32),
    and the dequantized weight is q * s rounded to float32 once, within s / 2 of w."""
    k, n = 256, 48
    w = _weight(k, n)
    sch = scheme(name, group)
    packed = quantize(sch, w)
    top, g = (127 if name == "int8" else 7), group or k
    groups = torch.from_numpy(w).double().reshape(k // g, g, n)
    s = (groups.abs().amax(1) / top).float()
    q = torch.round(groups / torch.where(s == 0, 1, s).double()[:, None]).clamp(-top, top)
    q = q.reshape(k, n)
    assert np.array_equal(values(sch, packed), q.int().numpy())
    assert np.array_equal(packed["scale"], s.numpy())
    s_full = s.repeat_interleave(g, 0)
    deq = dequantize(sch, packed)
    assert deq.dtype == np.float32 and np.array_equal(deq, (q.float() * s_full).numpy())
    assert (np.abs(deq - w) <= s_full.numpy() / 2 * (1 + 1e-6) + 1e-12).all()
    assert not deq[:, 3].any()
    want = (np.int8, (k, n)) if name == "int8" else (np.uint8, (k // 2, n))
    assert (packed["q"].dtype, packed["q"].shape) == want
    assert packed["scale"].shape == (k // g, n)


def test_int4_nibbles_sit_in_byte_rows():
    """Row k of an int4 weight is the low nibble of byte row k // 2 (k even) or the high one,
    stored as q + 8."""
    w = np.zeros((32, 2), dtype=np.float32)
    w[:, 0] = np.arange(32) % 15 - 7     # the values themselves (scale 1)
    w[:, 1] = -w[:, 0]
    packed = quantize(scheme("int4", 32), w)
    q = packed["q"].astype(np.int32)
    assert np.array_equal((q & 15) - 8, w[0::2].astype(np.int32))
    assert np.array_equal((q >> 4) - 8, w[1::2].astype(np.int32))
    assert np.array_equal(packed["scale"], np.ones((1, 2), np.float32))


def test_bf16_rounds_as_torch_does():
    w = _weight(64, 40)
    w[0, 0], w[0, 1] = 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8   # ties: to even, both ways
    deq = dequantize(scheme("bf16"), quantize(scheme("bf16"), w))
    assert np.array_equal(deq, torch.from_numpy(w).to(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("kwargs, match", [
    (dict(quantize="int5"), "quantize must be None or one of bf16, int8, int4"),
    (dict(quantize="bf16", group_size=32), "group_size applies to int8 and int4"),
    (dict(group_size=32), "group_size is given without quantize;"),
    (dict(quantize="int4", group_size=48), "group_size must be one of 32, 64, 128"),
])
def test_bad_schemes_are_refused_naming_the_argument(kwargs, match, tmp_path):
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.models import HLALM

    with pytest.raises(ValueError, match=match):
        compile_model(HLALM(40, 32, 1, 4), out=tmp_path / "m.so", **kwargs)
    with pytest.raises(TypeError, match="group_size must be an int"):
        scheme("int4", 32.0)
    assert not (tmp_path / "m.so").exists()


@pytest.mark.parametrize("flags, says", [
    (["--quantize", "bf16", "--group-size", "32"], "--group-size applies to int8 and int4, not "
                                                   "bf16"),
    (["--group-size", "64"], "--group-size is given without --quantize; give --quantize int8"),
])
def test_the_command_refuses_a_group_size_it_cannot_use_in_one_line(tmp_path, capsys, flags,
                                                                     says):
    """The command's message names its own flags (not the Python arguments)."""
    from hla_tvm.cli import main
    from hla_tvm.models import HLALM

    HLALM(40, 32, 1, 4).save(tmp_path / "m.pt")
    assert main(["compile", str(tmp_path / "m.pt"), "-o", str(tmp_path / "m.so"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "m.so").exists()


def _compiled(tmp_path_factory, name, group, tied, d_model=32, **config):
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.models import HLALM

    torch.manual_seed(0)
    model = HLALM(40, d_model, 2, 4, chunk_size=16, tie_embeddings=tied, **config).eval()
    path = tmp_path_factory.mktemp(f"q_{name}") / "model.so"
    compile_model(model, out=path, quantize=name, group_size=group)
    return model, path


def _check_against_pytorch(model, path, sch, T=37):
    """Prefill T tokens then one decode step of the module at `path` against `model` with the
    dequantized weights, float32 PyTorch (<= 1e-4 relative; bf16, and int8 / int4 where this CPU
    prefills them on bfloat16 products, 4e-3 (`scheme_tol`): an input within float32 noise of a
    rounding tie rounds either way, a term off by one bfloat16 step, 2^-8 relative)."""
    from hla_tvm import runtime
    from hla_tvm.quant.torch_weights import dequantized_model

    ref = dequantized_model(model, sch)
    mod = runtime.load(path)
    tokens = torch.randint(0, 40, (2, T + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, _ = ref(tokens, None)
        plain, _ = model(tokens, None)
    state = mod.init_state(2)
    tol = scheme_tol(sch.name, 1e-4)
    got = torch.from_numpy(np.asarray(mod.prefill(tokens[:, :T].numpy(), state)[0]))
    assert rel_err(got, want[:, :T]) <= tol
    step = torch.from_numpy(np.asarray(mod.decode(tokens[:, T].numpy(), state)[0]))
    assert rel_err(step, want[:, T]) <= tol
    return rel_err(want, plain), mod


@pytest.mark.parametrize("name, group, tied, d_model", [
    ("int4", None, True, 32), ("int8", None, True, 32), ("bf16", None, True, 32),
    ("int4", 64, False, 64), ("int8", 32, False, 32)])
def test_compiled_model_equals_pytorch_with_dequantized_weights(name, group, tied, d_model,
                                                                tmp_path_factory):
    from hla_tvm.runtime.model import scheme_name

    model, path = _compiled(tmp_path_factory, name, group, tied, d_model)
    sch = scheme(name, group)
    drift, mod = _check_against_pytorch(model, path, sch)
    assert drift > 1e-6   # the weights did change: the check above is not of float32 weights
    quant = mod.meta["quantize"]
    assert (quant["scheme"], quant["group_size"]) == (sch.name, sch.group_size)
    # a layer's projections as stored: q, k, v as one weight, gate and up as one, out, down
    # (`compiler.passes.parallel_products`); then the table and an untied head
    layers = 2 * 4 + 1 + (0 if tied else 1)
    assert quant["packed"] == layers and quant["kept"] == []
    ratio = {"bf16": 2, "int8": 3.5, "int4": 5}[name]
    assert quant["float_bytes"] >= ratio * quant["bytes"]
    assert scheme_name(mod.meta).startswith(name)


def test_weights_that_do_not_split_into_groups_stay_float32(tmp_path_factory):
    """d_model 48 with int4 groups of 32: the projections reading 48 inputs stay float32 (q, k,
    v as one weight, gate and up as one, out, the tied head), the MLP's down projection (128
    inputs) and nothing else is packed; still exact."""
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.models import HLALM

    torch.manual_seed(1)
    model = HLALM(40, 48, 1, 4, chunk_size=16, mlp_hidden=128).eval()
    path = tmp_path_factory.mktemp("q_kept") / "model.so"
    compile_model(model, out=path, quantize="int4")
    _, mod = _check_against_pytorch(model, path, scheme("int4"))
    quant = mod.meta["quantize"]
    assert quant["packed"] == 1 and len(quant["kept"]) == 4, quant


def test_the_command_says_what_it_packed_and_warns_of_what_it_kept(tmp_path, capsys):
    """`compile --quantize` prints the packed weights; where a weight's K does not split into
    the groups it stays float32, and the command warns (the module runs)."""
    from hla_tvm.cli import main
    from hla_tvm.models import HLALM

    HLALM(40, 32, 1, 4).save(tmp_path / "m.pt")
    assert main(["compile", str(tmp_path / "m.pt"), "-o", str(tmp_path / "m.so"),
                 "--quantize", "int4", "--group-size", "128"]) == 0
    out, err = capsys.readouterr()
    assert "weights: int4 (group 128), 1 packed" in out, out
    assert "warning: weights with K = 32 stay float32 (not a multiple of the group size 128); " \
        "--quantize int4 --group-size 32 packs them" in err, err


def test_states_and_metadata_of_another_scheme_are_refused(tmp_path_factory, tmp_path, capsys):
    """`run --info` names the scheme; a state saved by the float32 module is another model's to a
    quantized one; a module whose metadata names no scheme record is refused when loaded, in
    one line."""
    from hla_tvm import runtime
    from hla_tvm.cli import main
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.runtime import libfile

    model, qpath = _compiled(tmp_path_factory, "int8", None, True)
    assert main(["run", str(qpath), "--info"]) == 0
    assert "weights: int8 (per channel), 9 packed" in capsys.readouterr().out
    fpath = tmp_path / "f32.so"
    compile_model(model, out=fpath)
    fmod, qmod = runtime.load(fpath), runtime.load(qpath)
    state = fmod.init_state(1)
    fmod.prefill(np.array([[1, 2, 3]]), state)
    fmod.save_state(state, tmp_path / "s.npz")
    with pytest.raises(ValueError, match="load_state"):
        qmod.load_state(tmp_path / "s.npz")
    loaded = qmod.load_state(tmp_path / "s.npz", other_model=True)   # same layout: allowed
    assert all(np.array_equal(a, b) for a, b in zip(loaded, state))

    data = qpath.read_bytes()
    image = len(data) - libfile.TRAILER
    size = int.from_bytes(data[image - 16:image - 8], "little")
    meta = json.loads(data[image - 16 - size:image - 16])
    meta["quantize"] = "int4"
    note = json.dumps(meta).encode()
    bad = tmp_path / "bad.so"
    bad.write_bytes(data[:image - 16 - size] + note + len(note).to_bytes(8, "little")
                    + data[image - 8:image])
    libfile.seal(bad)
    with pytest.raises(ValueError, match="quantize entry is not a scheme record") as err:
        runtime.load(bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, group", [("int4", 32), ("int8", None), ("bf16", None)])
def test_onnx_file_with_quantized_weights_runs_everywhere_and_compiles_alike(name, group,
                                                                            tmp_path):
    """export(quantize=): standard DequantizeLinear (INT4/INT8, opset 21) or a Cast of BFLOAT16
    initializers, checked by onnx.checker; ONNX Runtime runs it as PyTorch runs the dequantized
    weights; hla_tvm.onnx.compile of the file takes the scheme it records and gives the logits
    of the checkpoint compiled with that scheme."""
    import onnx
    import onnxruntime as ort

    from hla_tvm import onnx as hla_onnx, runtime
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.models import HLALM
    from hla_tvm.quant.torch_weights import dequantized_model

    torch.manual_seed(0)
    model = HLALM(40, 32, 2, 4, chunk_size=16).eval()
    sch = scheme(name, group)
    path = tmp_path / "model.onnx"
    proto = hla_onnx.export(model, path, quantize=name, group_size=group)
    kinds = [n.op_type for n in proto.graph.node]
    assert kinds.count("Cast" if name == "bf16" else "DequantizeLinear") >= 2 * 7 + 1
    onnx.checker.check_model(onnx.load(path), full_check=True)
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, _ = dequantized_model(model, sch)(tokens, None)
    # the file's own meaning: every node as the standard defines it (ONNX Runtime's default
    # optimizations fuse DequantizeLinear and MatMul into kernels that round the activations
    # to 8 bits, 5e-3 off here: its choice, run below)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    exact = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    got = exact.run(None, {"tokens": tokens.numpy()})[0]
    tol = 4e-3 if name == "bf16" else 1e-4   # (`_check_against_pytorch`)
    assert rel_err(torch.from_numpy(got), want) <= tol
    fused = hla_onnx.session(path).run(None, {"tokens": tokens.numpy()})[0]
    assert rel_err(torch.from_numpy(fused), want) <= 2e-2
    lib = hla_onnx.compile(path, out=tmp_path / "onnx.so")
    ref = compile_model(model, out=tmp_path / "ckpt.so", quantize=name, group_size=group)
    a, b = runtime.load(lib), runtime.load(ref)
    assert a.meta["quantize"]["scheme"] == name
    assert a.meta["quantize"]["packed"] == b.meta["quantize"]["packed"] == 9
    la = a.prefill(tokens.numpy(), a.init_state(2))[0]
    lb = b.prefill(tokens.numpy(), b.init_state(2))[0]
    assert np.abs(la - lb).max() <= (tol if name == "bf16" else 1e-5) * np.abs(lb).max()
    with pytest.raises(ValueError, match="already"):
        hla_onnx.compile(path, out=tmp_path / "other.so",
                         quantize="int8" if name != "int8" else "int4")


class Conv1D(torch.nn.Module):
    """transformers' Conv1D (GPT-2's projections), as its source defines it: weight [nx, nf],
    out = x @ weight + bias (transformers is not a test dependency; the compiler and the
    reference know it by its name and form)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size)


class Conv1DLM(torch.nn.Module):
    """Embedding, one HLA layer whose input and output go through Conv1D projections, a head."""

    def __init__(self, vocab=40, d=32):
        super().__init__()
        from hla_tvm.nn import HLAttention

        self.embed = torch.nn.Embedding(vocab, d)
        self.c_fc, self.c_proj = Conv1D(2 * d, d), Conv1D(d, 2 * d)
        self.attn = HLAttention(d, 4, chunk_size=16)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def init_state(self, batch):
        return [self.attn.init_state(batch)]

    def forward(self, tokens, state=None):
        x = self.embed(tokens)
        y, st = self.attn(x, None if state is None else state[0])
        h = x + y
        h = h + self.c_proj(torch.nn.functional.gelu(self.c_fc(h)))
        return self.head(h), [st]


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_conv1d_weights_are_quantized_in_the_module_and_the_reference(name, tmp_path):
    """GPT-2's Conv1D projections are packed by the compiler and quantized alike by
    `dequantized_model` (the reference once left them float32, comparing another model):
    module and reference agree to float32 noise, and the reference's Conv1D weights changed."""
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.quant.torch_weights import dequantized_model

    torch.manual_seed(0)
    model = Conv1DLM().eval()
    sch = scheme(name, 32)
    ref = dequantized_model(model, sch)
    assert not torch.equal(ref.c_fc.weight, model.c_fc.weight)
    path = compile_model(model, out=tmp_path / "m.so", quantize=name, group_size=32)
    _check_against_pytorch(model, path, sch)


class EinsumLM(torch.nn.Module):
    """Per-head output weights [H, Dh, D] applied with einsum beside nn.Linear projections:
    the einsum's weight is no matmul's [K, N] right operand."""

    def __init__(self):
        super().__init__()
        from hla_tvm.nn import HLAttention

        self.emb, self.attn = torch.nn.Embedding(40, 64), HLAttention(64, 4, chunk_size=16)
        self.heads = torch.nn.Parameter(torch.randn(4, 16, 64) / 8)
        self.head = torch.nn.Linear(64, 40)

    def init_state(self, batch):
        return [self.attn.init_state(batch)]

    def forward(self, tokens, state=None):
        x = self.emb(tokens)
        y, st = self.attn(x, None if state is None else state[0])
        z = torch.einsum("bthd,hde->bte", y.view(*y.shape[:2], 4, 16), self.heads)
        return self.head(x + z), [st]


def test_the_report_names_float32_weights_no_product_packs(tmp_path, capsys):
    """A weight an einsum reads stays float32 (as `dequantized_model` leaves it): the module's
    report lists it with the operator reading it, `compile` notes it, and the module equals
    PyTorch with the other weights dequantized."""
    from hla_tvm.cli.compile import _report_weights
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.runtime.model import weights_summary

    torch.manual_seed(4)
    model = EinsumLM().eval()
    path = tmp_path / "e.so"
    compile_model(model, out=path, quantize="int4")
    _, mod = _check_against_pytorch(model, path, scheme("int4"))
    unpacked = mod.meta["quantize"]["unpacked"]
    assert [w["shape"] for w in unpacked] == [[4, 16, 64]], unpacked
    assert "1 more float32" in weights_summary(mod.meta)
    _report_weights(str(path))
    err = capsys.readouterr().err
    assert "[4, 16, 64]" in err and unpacked[0]["op"] in err
