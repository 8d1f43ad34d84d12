"""How the compiled prefill splits work it cannot hold at once, for every operator, against
float64 serial recurrences: segments of chunks (state carried in place), (batch, head) blocks,
the GPU's scratch budget, and the key/value-head work of each prefill chain."""
import pytest
import torch
from conftest import make_qkv, rel_err
from test_op_shared import KV_STATE, REFS as OPS

from hla_tvm import hla

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_key_value_work_runs_once_per_key_value_head[hla2]",
    "test_gpu_scratch_budget",
}


@pytest.mark.parametrize("op, decay", [("hla2", None), ("hla2", 0.9), ("ahla", 0.9),
                                       ("hla3", None)])
def test_long_inputs_run_in_segments(op, decay, monkeypatch):
    """With the scratch budget cut to one chunk, a prefill runs chunk by chunk in segments (the
    state carried in place between them) and still equals the float64 serial recurrence."""
    from hla_tvm import backend
    from hla_tvm.ops import chains

    ref, kw = OPS[op]
    q, k, v = make_qkv(1, 2, 70, 8, 4, seed=5)
    monkeypatch.setattr(backend, "SCRATCH_BYTES", 1)
    assert backend.segment_tokens(chains.prefill("hla3"), 1, 2, 8, 4, 16, torch.float32) == 16
    out, st = hla(q.float(), k.float(), v.float(), decay=decay, return_state=True,
                  chunk_size=16, **kw)
    want, want_st = ref.serial(q, k, v, decay=decay)
    assert rel_err(out, want) < 1e-4
    for name, x in want_st.items():
        assert rel_err(st[name], x) < 1e-4, name


def test_gpu_scratch_budget(monkeypatch):
    """A GPU prefill may hold an eighth of the GPU's memory as scratch, at most half of what is
    free, never less than the CPU's budget: the goal's second order at B1 H32 T32768 D128
    (12.9 GB of scratch) runs in one segment on an idle 141 GB GPU, not 103."""
    from hla_tvm import backend
    from hla_tvm.ops import chains

    gib = 1 << 30
    cuda = torch.device("cuda", 0)
    for free, total, want in ((140 * gib, 141 * gib, 141 * gib // 8),
                              (10 * gib, 141 * gib, 5 * gib), (0, 8 * gib, backend.SCRATCH_BYTES)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, f=free, t=total: (f, t))
        assert backend.gpu_scratch_budget(cuda) == want
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (140 * gib, 141 * gib))
    chain = chains.prefill("hla2_decay")
    assert backend.segment_tokens(chain, 1, 32, 128, 128, 32, torch.float32) == 320
    assert backend.segment_tokens(chain, 1, 32, 128, 128, 32, torch.float32,
                                  backend.gpu_scratch_budget(cuda)) >= 32768


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("fit", ["rows", "groups"])
def test_large_inputs_run_in_head_blocks(op, fit, monkeypatch):
    """With a scratch budget for whole batch rows, or for one head group, a CPU prefill runs
    (batch, head) blocks in turn on slices of the caller's tensors (state slices of head size 4
    start off the 64-byte alignment: copied and written back), and equals the float64 serial
    recurrence from a nonzero state, per-head decay, grouped heads."""
    from hla_tvm import backend
    from hla_tvm.ops import chains

    ref, kw = OPS[op]
    B, H, group, T, d, n = 3, 4, 2, 40, 4, 16
    per_head = 3 * backend.scratch_per_chunk(chains.prefill("hla2_decay" if op == "hla2" else op),
                                             d, d, n) * 4
    monkeypatch.setattr(backend, "SCRATCH_BYTES", per_head * (H if fit == "rows" else group))
    blocks = backend.head_blocks(chains.prefill("hla2_decay" if op == "hla2" else op), B, H,
                                 H // group, T, d, d, n, torch.float32)
    assert blocks == ([(b, b + 1, 0, H) for b in range(B)] if fit == "rows" else
                      [(b, b + 1, h, h + group) for b in range(B) for h in (0, group)])
    dec = torch.tensor([0.9, 0.7]).repeat_interleave(group)
    q, _, _ = make_qkv(B, H, T, d, d, seed=11)
    _, k, v = make_qkv(B, H // group, T, d, d, seed=12)
    q0, _, _ = make_qkv(B, H, 5, d, d, seed=13)
    _, k0, v0 = make_qkv(B, H // group, 5, d, d, seed=14)
    full = lambda x: x.repeat_interleave(group, 1)  # noqa: E731
    st0 = ref.serial(q0, full(k0), full(v0), decay=dec)[1]
    want, want_st = ref.serial(q, full(k), full(v), decay=dec, state=st0)
    given = {name: (x[:, ::group] if name in KV_STATE[op] else x).float().contiguous()
             for name, x in st0.items()}
    out, st = hla(q.float(), k.float(), v.float(), decay=dec, state=given, return_state=True,
                  chunk_size=n, **kw)
    assert rel_err(out, want) <= 1e-4
    for name, x in st.items():
        assert rel_err(x, want_st[name][:, ::group] if name in KV_STATE[op] else
                       want_st[name]) <= 1e-4, name


@pytest.mark.parametrize("op", ["hla2", "ahla"])
def test_blocks_of_fewer_heads_than_workers_run_at_once(op, monkeypatch):
    """Where the budget leaves blocks of fewer heads than TVM workers (one head each here, two
    workers), the blocks run at once on threads of one worker each, each within half the
    budget (in segments of T), and the prefill still equals the float64 serial recurrence
    from a nonzero state."""
    from hla_tvm import backend
    from hla_tvm.ops import chains

    ref, kw = OPS[op]
    B, H, T, d, n = 2, 3, 70, 8, 16
    fam = "hla2" if op == "hla2" else op
    per_chunk = backend.scratch_per_chunk(chains.prefill(fam), d, d, n) * 4
    monkeypatch.setattr(backend, "SCRATCH_BYTES", 2 * 2 * per_chunk)   # 2 chunks a worker
    monkeypatch.setattr(backend, "default_threads", lambda: 2)
    ran, taken = [], []
    real_workers, real_segments = backend._block_workers, backend._run_segments

    def workers(count):
        ran.append(count)
        return real_workers(count)

    def segments(*args, **kwargs):
        taken.append((args[9] if len(args) > 9 else kwargs.get("budget"), args[1].shape))
        return real_segments(*args, **kwargs)

    monkeypatch.setattr(backend, "_block_workers", workers)
    monkeypatch.setattr(backend, "_run_segments", segments)
    q, k, v = make_qkv(B, H, T, d, d, seed=21)
    q0, k0, v0 = make_qkv(B, H, 5, d, d, seed=22)
    st0 = ref.serial(q0, k0, v0)[1]
    want, want_st = ref.serial(q, k, v, state=st0)
    given = {name: x.float().contiguous() for name, x in st0.items()}
    out, st = hla(q.float(), k.float(), v.float(), state=given, return_state=True,
                  chunk_size=n, **kw)
    assert ran == [2]
    assert len(taken) == B * H and all(budget == 2 * per_chunk for budget, _ in taken)
    assert backend.segment_tokens(chains.prefill(fam), 1, 1, d, d, n, torch.float32,
                                  2 * per_chunk) == 2 * n   # (segments of 2 chunks)
    assert rel_err(out, want) <= 1e-4
    for name, x in st.items():
        assert rel_err(x, want_st[name]) <= 1e-4, name


@pytest.mark.parametrize("fam", ["hla2", "hla2_decay", "ahla", "hla3"])
def test_key_value_work_runs_once_per_key_value_head(fam):
    """The prefill calls that run on the key/value heads advance exactly the operator's
    key/value-only state entries (stored once per key/value head), and nothing else advances
    them; so with grouped heads that work is done once per key/value head, not per query head."""
    from hla_tvm import ops
    from hla_tvm.ops import chains

    op = {"hla2": ops.get(2, False), "hla2_decay": ops.get(2, False),
          "ahla": ops.get(2, True), "hla3": ops.get(3, False)}[fam]
    chain = chains.prefill(fam)
    kv_calls = [c for c in chain.calls if c.kv]
    assert kv_calls and {x for c in kv_calls for x in c.inplace} == set(op.kv_state)
    assert not {x for c in chain.calls if not c.kv for x in c.inplace} & set(op.kv_state)
    assert all(x in ("k", "v", "gamma") + op.kv_state for c in kv_calls for x in c.reads
               if x not in chain.kinds())
