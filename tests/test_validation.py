"""Bad input raises a clear ValueError/TypeError/NotImplementedError naming the argument,
before any kernel runs."""
import platform

import pytest
import torch

from hla_tvm import hla
from hla_tvm.ops.hla2 import reference as ref

# a CPU target of another architecture than this machine's
FOREIGN = "x86-64" if platform.machine() in ("aarch64", "arm64") else "aarch64"


def qkv(B=1, H=2, T=5, dk=4, dv=3, dtype=torch.float32):
    return (torch.randn(B, H, T, dk, dtype=dtype), torch.randn(B, H, T, dk, dtype=dtype),
            torch.randn(B, H, T, dv, dtype=dtype))


@pytest.mark.parametrize("backend", ["tvm", "torch"])
@pytest.mark.parametrize("bad, exc, match", [
    (lambda q, k, v: (q[0], k, v), ValueError, r"q must have shape \[B, H, T, Dk\]"),
    (lambda q, k, v: (q, k[..., None], v), ValueError, r"k must have shape"),
    (lambda q, k, v: (q, k, v[0]), ValueError, r"v must have shape \[B, H, T, Dv\]"),
    (lambda q, k, v: (q, k[:, :, :4], v), ValueError, r"k must have shape \[B, Hkv, T, Dk\]"),
    (lambda q, k, v: (q, k[..., :3], v), ValueError, r"k must have shape"),
    (lambda q, k, v: (q, k, v[:, :, :4]), ValueError, r"v must have shape"),
    (lambda q, k, v: (q, k, torch.cat([v, v])), ValueError, r"v must have shape"),
    (lambda q, k, v: (q[:, :, :0], k[:, :, :0], v[:, :, :0]), ValueError, r"T >= 1"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, r"q must be a torch.Tensor"),
    (lambda q, k, v: (q, k.int(), v), TypeError, r"k must be a floating tensor"),
    (lambda q, k, v: (q, k, v.double()), TypeError, r"share a dtype"),
])
def test_bad_tensors(backend, bad, exc, match):
    args = bad(*qkv())
    with pytest.raises(exc, match=match):
        hla(*args, backend=backend)


def test_heads_must_divide():
    q, k, v = qkv(H=3)
    with pytest.raises(ValueError, match="k has 2 heads, which must divide q's 3 heads"):
        hla(q, k[:, :2], v[:, :2])


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(order=5), ValueError, "order must be one of"),
    (dict(order=2.0), TypeError, "order must be an int"),
    (dict(eps=-1.0), ValueError, "eps must be >= 0"),
    (dict(eps="x"), TypeError, "eps must be a real number"),
    (dict(ridge=-0.1), ValueError, "ridge must be >= 0"),
    (dict(decay=0.0), ValueError, "decay must be > 0"),
    (dict(decay=1.5), ValueError, "decay must be <= 1"),
    (dict(decay=torch.ones(3)), ValueError, r"decay as a tensor must have shape \[H\] = \[2\]"),
    (dict(decay=[0.9]), ValueError, "decay as one value per head must have H = 2 values"),
    (dict(decay=(0.9, "x")), TypeError, r"decay\[1\] must be a real number"),
    (dict(decay=[0.9, 1.5]), ValueError, r"decay\[1\] must be <= 1"),
    (dict(decay="x"), TypeError, "decay must be a real number or one value per head"),
    (dict(target=FOREIGN), ValueError, "which this machine cannot run"),
    (dict(chunk_size=0), ValueError, "chunk_size must be >= 1"),
    (dict(chunk_size=129), ValueError, "chunk_size must be at most 128 for the compiled"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(masked=1), TypeError, "masked must be a bool"),
    (dict(target="llvm -mcpu=znver4"), ValueError, "target="),
    (dict(target=3), TypeError, "target must be"),
])
def test_bad_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        hla(*qkv(), **kwargs)


def test_bad_state():
    q, k, v = qkv()
    good = ref.zero_state(1, 2, 4, 3, torch.float32)
    with pytest.raises(TypeError, match="state must be a dict"):
        hla(q, k, v, state=[good])
    with pytest.raises(ValueError, match="exactly the keys"):
        hla(q, k, v, state={n: x for n, x in good.items() if n != "G"})
    bad = dict(good, S=torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match=r"state\['S'\] must have shape \[1, 2, 4, 4\]"):
        hla(q, k, v, state=bad)
    bad = dict(good, C=torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"state\['C'\] must have shape \[1, 2, 4, 3\]"):
        hla(q[:, :, :1], k[:, :, :1], v[:, :, :1], state=bad)
    with pytest.raises(TypeError, match=r"state\['m'\] must be floating"):
        hla(q, k, v, state=dict(good, m=torch.zeros(1, 2, 4, dtype=torch.int64)))


def test_large_chunks_compile_nowhere(tmp_path):
    """A chunk above MAX_CHUNK is refused before any compile (5001 ran a 24 GB machine out of
    memory): by `hla` with the compiled kernels, a one-token `hla`, and `hla_tvm.compile` of a
    model; backend='torch' takes it and gives the chunked form's outputs."""
    import hla_tvm
    from hla_tvm.models import HLALM

    q, k, v = qkv()
    with pytest.raises(ValueError, match="chunk_size must be at most 128"):
        hla(q[:, :, :1], k[:, :, :1], v[:, :, :1], chunk_size=5001)
    want = hla(q.double(), k.double(), v.double(), backend="torch")
    got = hla(q.double(), k.double(), v.double(), backend="torch", chunk_size=5001)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="chunk_size must be at most 128"):
        hla_tvm.compile(HLALM(40, 16, 1, 2, chunk_size=256), out=tmp_path / "m.so")
    assert not list(tmp_path.iterdir())


def test_tvm_backend_refuses_padding_with_decay():
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="attention_mask together with decay"):
        hla(q, k, v, decay=0.9, attention_mask=torch.ones(1, 5))


def test_grouped_heads_need_equal_decay_within_a_group():
    q, k, v = qkv(H=4)
    with pytest.raises(ValueError, match="equal within each group"):
        hla(q, k[:, :2], v[:, :2], backend="torch", decay=torch.tensor([0.9, 0.8, 0.7, 0.7]))


def test_torch_backend_runs_decay_and_half():
    q, k, v = qkv(dtype=torch.float16)
    out = hla(q, k, v, backend="torch", decay=0.9)
    assert out.dtype == torch.float16 and out.shape == (1, 2, 5, 3)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(order=3, asymmetric=True), ValueError, "asymmetric=True is defined for order 2 only"),
    (dict(asymmetric=True, ridge=0.1), ValueError, "ridge are defined for second-order"),
    (dict(order=3, masked=False), ValueError, "masked=False and ridge"),
    (dict(attention_mask=torch.ones(1, 4)), ValueError,
     r"attention_mask must have shape \[B, T\] = \[1, 5\]"),
    (dict(attention_mask=torch.full((1, 5), 2.0)), ValueError, "only 0 \\(padding\\) and 1"),
    (dict(attention_mask=[[1, 1, 1, 1, 1]]), TypeError, "attention_mask must be a torch.Tensor"),
])
def test_bad_family_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        hla(*qkv(), backend="torch", **kwargs)


def test_state_of_another_operator_is_refused():
    q, k, v = qkv()
    _, st = hla(q, k, v, backend="torch", return_state=True)
    with pytest.raises(ValueError, match="exactly the keys"):
        hla(q, k, v, backend="torch", order=3, state=st)


@pytest.mark.parametrize("backend", ["tvm", "torch"])
def test_decay_per_head_as_a_list_tuple_or_array_equals_the_tensor(backend):
    import numpy as np

    q, k, v = qkv()
    want = hla(q, k, v, decay=torch.tensor([0.9, 0.5]), backend=backend)
    for decay in ([0.9, 0.5], (0.9, 0.5), np.array([0.9, 0.5])):
        assert torch.equal(hla(q, k, v, decay=decay, backend=backend), want)
    assert torch.equal(hla(q, k, v, decay=torch.tensor(0.9), backend=backend),
                       hla(q, k, v, decay=0.9, backend=backend))


def test_the_kernels_refuse_inputs_recording_gradients():
    """backend='tvm' computes no gradients: an input that requires grad (with grad mode on) is
    refused, not silently cut from the graph; backend='torch' differentiates."""
    q, k, v = qkv()
    q.requires_grad_()
    with pytest.raises(ValueError, match="q requires grad, but backend='tvm' computes no "
                                         "gradients"):
        hla(q, k, v)
    with torch.no_grad():
        assert torch.allclose(hla(q, k, v), hla(q, k, v, backend="torch"), atol=1e-5)
    hla(q, k, v, backend="torch").sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    from hla_tvm import decode_, init_state

    st = init_state(1, 2, 4, 3, device=None)   # (None: the CPU)
    with pytest.raises(ValueError, match="q requires grad, but decode_ computes no gradients"):
        decode_(q[:, :, 0], k[:, :, 0], v[:, :, 0], st)
    g = torch.tensor(0.9, requires_grad=True)   # one decay for every head, differentiated
    with pytest.raises(ValueError, match="decay requires grad"):
        hla(q.detach(), k, v, decay=g)
    hla(q.detach(), k, v, decay=g, backend="torch").sum().backward()
    assert g.grad is not None and torch.isfinite(g.grad)


def test_init_state_names_a_bad_device():
    from hla_tvm import init_state

    with pytest.raises(ValueError, match="device must be a torch device"):
        init_state(1, 2, 4, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="PyTorch sees no CUDA GPU here"):
            init_state(1, 2, 4, device="cuda")


@pytest.mark.parametrize("backend", ["tvm", "torch"])
@pytest.mark.parametrize("opts", [dict(), dict(decay=0.9), dict(order=3, decay=0.9),
                                  dict(asymmetric=True)])
def test_an_empty_batch_gives_empty_results(backend, opts):
    """B = 0 (prefill, one token, a model) returns empty outputs and states of the right
    shapes, as PyTorch's own operators do."""
    from hla_tvm import decode_, init_state
    from hla_tvm.models import HLALM

    for T in (70, 1):
        z = torch.randn(0, 2, 70, 16)[:, :, :T]
        out, st = hla(z, z, z, backend=backend, return_state=True, **opts)
        assert out.shape == (0, 2, T, 16)
        full = init_state(1, 2, 16, order=opts.get("order", 2),
                          asymmetric=opts.get("asymmetric", False))
        assert {n: x.shape[1:] for n, x in st.items()} == \
            {n: x.shape[1:] for n, x in full.items()} and all(x.shape[0] == 0 for x in st.values())
    q = torch.randn(0, 2, 16)
    assert decode_(q, q, q, {n: x[:0] for n, x in full.items()}, **opts).shape == (0, 2, 16)
    model = HLALM(10, 16, 1, 2, decay=opts.get("decay"), order=opts.get("order", 2))
    assert model(torch.zeros(0, 5, dtype=torch.long))[0].shape == (0, 5, 10)


def test_meta_tensors_are_named():
    """Tensors without values (the meta device) are refused naming the argument: q, a state
    entry (in a prefill and in one-token calls), attention_mask, decay."""
    from hla_tvm import decode_

    m = torch.randn(1, 2, 10, 8, device="meta")
    q = torch.randn(1, 2, 10, 8)
    for backend in ("tvm", "torch"):
        with pytest.raises(ValueError, match="q is on the meta device"):
            hla(m, m, m, backend=backend)
    _, st = hla(q, q, q, return_state=True)
    meta = {n: x.to("meta") for n, x in st.items()}
    for x in (q, q[:, :, :1]):
        with pytest.raises(ValueError, match=r"state\['S'\] is on the meta device"):
            hla(x, x, x, state=meta)
    with pytest.raises(ValueError, match=r"state\['S'\] must be on cpu"):
        decode_(q[:, :, 0], q[:, :, 0], q[:, :, 0], meta)
    with pytest.raises(ValueError, match="attention_mask is on the meta device"):
        hla(q, q, q, attention_mask=torch.ones(1, 10, device="meta"))
    with pytest.raises(ValueError, match="decay is on the meta device"):
        hla(q, q, q, decay=torch.full((2,), 0.9, device="meta"))


def test_decode_names_mixed_token_layouts():
    from hla_tvm import decode_, init_state

    st = init_state(1, 2, 8)
    a, b = torch.randn(1, 2, 8), torch.randn(1, 2, 1, 8)
    for q, kv in ((a, b), (b, a)):
        with pytest.raises(ValueError, match=r"all \[B, H, D\] or all \[B, H, 1, D\]"):
            decode_(q, kv, kv, st)


def test_model_decay_takes_what_the_layer_takes():
    """HLALM(decay=...) takes a 0-d tensor and a numpy scalar as the layer does, and refuses a
    bool (as hla() does); a prompt of no tokens is named as such."""
    import numpy as np

    from hla_tvm.models import HLALM
    from hla_tvm.nn import HLAttention

    for d in (torch.tensor(0.5), np.float32(0.5), 0.5):
        assert HLALM(10, 16, 1, 2, decay=d).config["decay"] == 0.5
    assert HLALM(10, 16, 1, 2, decay=torch.tensor([0.5, 0.25])).config["decay"] == [0.5, 0.25]
    for flag in (True, np.True_, torch.tensor(True), [True, True]):
        for make in (HLALM, HLAttention):
            with pytest.raises(TypeError, match="got a bool"):
                make(10, 16, 1, 2, decay=flag) if make is HLALM else make(16, 2, decay=flag)
    with pytest.raises(ValueError, match="tokens must hold T >= 1"):
        HLALM(10, 16, 1, 2)(torch.zeros(1, 0, dtype=torch.long))
