"""The fused elementwise kernels (``kernels/fused_triton.py``) against their
PyTorch references (``kernels/fused.py``), on the GPU (``gpu``) and in
Triton's interpreter on the CPU (``interp``: ``TRITON_INTERPRET=1``).

The kernels round where the references round, so in 16-bit dtypes they
give the references' bits wherever the arithmetic is the same: the
residual add and the V copy must match exactly. A norm's fp32 sum (in
another order), exp / sqrt (other implementations) and FMA contraction
may move an fp32 intermediate by an ulp, which two roundings later can
move the output by up to two units in its last place, rarely. Checked
there: at most two ulps anywhere (for RoPE outputs, ulps of the head's
largest value) and >= 99 % of the elements identical.
Then the whole target forward in bf16, fused against the references on
the same GPU."""

from __future__ import annotations

import os

import pytest
import torch

from kernel_helpers import _patch_interpreter

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
gpu = pytest.mark.gpu
interp = pytest.mark.skipif(not INTERP, reason="set TRITON_INTERPRET=1 to run kernels in Triton's interpreter")
DTYPES = [torch.bfloat16, torch.float16]


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return "cuda"


def _modules():
    pytest.importorskip("triton")
    if INTERP:
        _patch_interpreter()
    from specray.kernels import fused, fused_triton

    return fused, fused_triton


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor, exact: bool, per_head: bool = False):
    """Identical (``exact``), or at most two ulps apart and >= 99 % identical.
    ``per_head``: ulps of the largest value in the head (last dim), since
    RoPE mixes a head's values and cancellation makes small outputs carry
    their inputs' absolute error."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    ulp = torch.finfo(ref.dtype).eps  # relative spacing at 1.0
    scale = ref.float().abs()
    if per_head:
        scale = scale.amax(-1, keepdim=True)
    scale = scale.clamp_min(torch.finfo(ref.dtype).tiny)
    diff = (out.float() - ref.float()).abs()
    assert (diff <= (0 if exact else 2.02) * ulp * scale).all(), f"max diff {diff.max().item():.3e}"
    same = (out == ref).float().mean().item()
    assert same == 1.0 if exact else same >= 0.99, f"{same:.4f} identical"


def _rotary(D, device):
    from specray.actors.models.layers import Rotary
    from specray.config import RopeSpec

    return Rotary(RopeSpec(theta=10000.0), D, 4096, device)


def _rope(N, D, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return _rotary(D, device).lookup(torch.randint(0, 4096, (N,), generator=g).to(device), dtype)


def _check_rms_norm(device, dtype, N, H, residual):
    fused, ft = _modules()
    g = torch.Generator().manual_seed(N * 7 + H)
    x = (3 * torch.randn(N, H, generator=g)).to(device, dtype)
    r = torch.randn(N, H, generator=g).to(device, dtype) if residual else None
    w = (1 + 0.2 * torch.randn(H, generator=g)).to(device, dtype)
    x0, r0 = x.clone(), (r.clone() if residual else None)
    y, s = ft.rms_norm(x, w, 1e-6, r)
    y_ref, s_ref = fused.rms_norm(x, w, 1e-6, r)
    assert torch.equal(x, x0) and (r is None or torch.equal(r, r0)), "an input was written"
    if r is None:
        assert s is x  # the stream is x itself (no copy, no write: the kernel gets it as s_ptr)
    else:
        torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # r + x, one rounded add: exact everywhere
    assert_same_bits(y, y_ref, exact=False)


def _check_silu_mul(device, dtype, N, I):
    fused, ft = _modules()
    g = torch.Generator().manual_seed(N + I)
    gate_up = (2 * torch.randn(N, 2 * I, generator=g)).to(device, dtype)
    assert_same_bits(ft.silu_mul(gate_up), fused.silu_mul(gate_up), exact=False)


def _check_qkv_rope(device, dtype, N, nq, nkv, D, norm, store):
    fused, ft = _modules()
    g = torch.Generator().manual_seed(N * 31 + nq * 5 + D + norm + 2 * store)
    qkv = (2 * torch.randn(N, (nq + 2 * nkv) * D + 8, generator=g)).to(device, dtype)[:, :-8]  # strided rows
    cos_sin = _rope(N, D, dtype, device, N)
    q_norm = (1 + 0.2 * torch.randn(D, generator=g)).to(device, dtype) if norm and nq else None
    k_norm = (1 + 0.2 * torch.randn(D, generator=g)).to(device, dtype) if norm else None
    q_src, kv_src = (qkv[:, : nq * D] if nq else None), qkv[:, nq * D :]
    if not store:
        q, k = ft.qkv_rope(q_src, kv_src, nq, nkv, D, cos_sin, q_norm, k_norm, 1e-6)
        q_ref, k_ref = fused.qkv_rope(q_src, kv_src, nq, nkv, D, cos_sin, q_norm, k_norm, 1e-6)
        assert_same_bits(k, k_ref, exact=False, per_head=True)
    else:
        blocks, bs = -(-N // 16) + 3, 16
        cache = torch.randn(2, blocks, bs, nkv, D, generator=g).to(device, dtype)
        caches = [cache, cache.clone()]
        slots = (torch.randperm((blocks - 1) * bs, generator=g)[:N] + bs).to(device)  # distinct, not block 0
        q, none = ft.qkv_rope(q_src, kv_src, nq, nkv, D, cos_sin, q_norm, k_norm, 1e-6,
                              caches[0][0], caches[0][1], slots)
        q_ref, _ = fused.qkv_rope(q_src, kv_src, nq, nkv, D, cos_sin, q_norm, k_norm, 1e-6,
                                  caches[1][0], caches[1][1], slots)
        assert none is None
        assert_same_bits(caches[0][0], caches[1][0], exact=False, per_head=True)  # K, untouched rows too
        assert torch.equal(caches[0][1], caches[1][1])  # V: a copy
    if nq:
        assert_same_bits(q, q_ref, exact=False, per_head=True)
    else:
        assert q is None


def _check_context_kv(device, dtype, N, L, nkv, D, norm):
    """All layers' cache writes in one call against ``qkv_rope`` per layer;
    a layer's slice of the output, norm or cache taken from another layer
    fails it."""
    fused, ft = _modules()
    g = torch.Generator().manual_seed(N * 13 + L * 7 + D + norm)
    kv_all = (2 * torch.randn(N, L * 2 * nkv * D + 8, generator=g)).to(device, dtype)[:, :-8]  # strided rows
    rope = _rope(N, D, dtype, device, N + 1)
    k_norms = (1 + 0.2 * torch.randn(L, D, generator=g)).to(device, dtype) if norm else None
    blocks, bs = -(-N // 16) + 3, 16
    cache = torch.randn(L, 2, blocks, bs, nkv, D, generator=g).to(device, dtype)
    got, want, before = cache, cache.clone(), cache.clone()
    slots = (torch.randperm((blocks - 1) * bs, generator=g)[:N] + bs).to(device)
    ft.context_kv(kv_all, nkv, D, rope, k_norms, 1e-6, got, slots)
    width = 2 * nkv * D
    for li in range(L):  # the definition: qkv_rope's cache write, layer by layer
        fused.qkv_rope(None, kv_all[:, li * width:(li + 1) * width], 0, nkv, D, rope, None,
                       None if k_norms is None else k_norms[li], 1e-6, want[li, 0], want[li, 1], slots)
    assert_same_bits(got[:, 0], want[:, 0], exact=False, per_head=True)
    assert torch.equal(got[:, 1], want[:, 1])
    assert not torch.equal(got, before)  # it wrote


RMS_CASES = [(1, 576), (37, 576), (5, 4096), (3, 100), (16, 64)]
SILU_CASES = [(1, 1536), (16, 1536), (7, 100), (3, 3000)]
QKV_CASES = [(1, 9, 3, 64), (16, 9, 3, 64), (40, 32, 8, 128), (5, 0, 2, 128), (3, 4, 4, 32)]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H", RMS_CASES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_gpu(dtype, N, H, residual):
    _check_rms_norm(_cuda(), dtype, N, H, residual)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,I", SILU_CASES)
def test_silu_mul_gpu(dtype, N, I):
    _check_silu_mul(_cuda(), dtype, N, I)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,nq,nkv,D", QKV_CASES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("store", [False, True])
def test_qkv_rope_gpu(dtype, N, nq, nkv, D, norm, store):
    _check_qkv_rope(_cuda(), dtype, N, nq, nkv, D, norm, store)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,L,nkv,D", [(1, 4, 3, 64), (16, 4, 3, 64), (40, 2, 8, 128)])
@pytest.mark.parametrize("norm", [False, True])
def test_context_kv_gpu(dtype, N, L, nkv, D, norm):
    _check_context_kv(_cuda(), dtype, N, L, nkv, D, norm)


@gpu
def test_fused_ops_capture_in_cuda_graph_gpu():
    """Replayed with new contents (slots, positions, values, weights), a
    captured call writes what an eager one does."""
    from specray.kernels import ops

    fused, _ = _modules()
    assert ops._fused is not None  # else ops runs the references and this compares them with themselves
    dev, dt, N, nq, nkv, D = _cuda(), torch.bfloat16, 4, 9, 3, 64
    qkv = torch.zeros(N, (nq + 2 * nkv) * D, device=dev, dtype=dt)
    h = torch.zeros(N, 576, device=dev, dtype=dt)
    res = torch.zeros(N, 576, device=dev, dtype=dt)
    rot = _rotary(D, dev)
    positions = torch.zeros(N, dtype=torch.int64, device=dev)
    slots = torch.zeros(N, dtype=torch.int64, device=dev)
    w, qn, kn = (torch.ones(n, device=dev, dtype=dt) for n in (576, D, D))
    k_cache = torch.zeros(8, 16, nkv, D, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)

    def step():
        y, s = ops.rms_norm(h, w, 1e-6, res)
        q, _ = ops.qkv_rope(qkv[:, : nq * D], qkv[:, nq * D :], nq, nkv, D, rot.lookup(positions, dt), qn, kn,
                            1e-6, k_cache, v_cache, slots)
        return y, s, q, ops.silu_mul(res)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    g = torch.Generator().manual_seed(0)
    for buf in (qkv, h, res):
        buf.copy_(torch.randn(buf.shape, generator=g).to(dev, dt))
    for buf in (w, qn, kn):
        buf.copy_((1 + 0.2 * torch.randn(buf.shape, generator=g)).to(dev, dt))
    positions.copy_(torch.tensor([5, 4000, 17, 1234]))
    slots.copy_(torch.tensor([17, 40, 3 * 16 + 5, 127]))
    graph.replay()
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    q_ref, _ = fused.qkv_rope(qkv[:, : nq * D], qkv[:, nq * D :], nq, nkv, D, rot.lookup(positions, dt), qn, kn,
                              1e-6, k_ref, v_ref, slots)
    y_ref, s_ref = fused.rms_norm(h, w, 1e-6, res)
    y, s, q, m = outs
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # the residual add: exact
    for got, want, per_head in zip((y, q, m), (y_ref, q_ref, fused.silu_mul(res)), (False, True, False)):
        assert_same_bits(got, want, exact=False, per_head=per_head)
    assert_same_bits(k_cache, k_ref, exact=False, per_head=True)
    assert torch.equal(v_cache, v_ref)


@gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_target_forward_fused_vs_reference_gpu(tmp_path, arch, monkeypatch):
    """The whole bf16 target forward (prefill, taps) with the fused kernels
    against the same forward on the references, same GPU."""
    from factories import make_target
    from specray.actors.kv_cache import BlockAllocator, BlockTable, block_table_tensor
    from specray.actors.target import TargetWorker
    from specray.config import TargetSpec
    from specray.kernels import ops
    from specray.plan import AttentionMetadata, TargetBatch

    _cuda()
    make_target(tmp_path, arch, seed=5, hidden_size=384, intermediate_size=768, num_attention_heads=6,
                num_key_value_heads=2, head_dim=64, num_hidden_layers=4, vocab_size=512)
    spec = TargetSpec.from_dir(tmp_path)
    worker = TargetWorker(spec, device="cuda", dtype="bfloat16", max_model_len=256, tap_layer_ids=(0, 2, 3))
    worker.init_cache(num_blocks=32, block_size=16)
    table = BlockTable(BlockAllocator(32, 16))
    table.reserve(150)
    ids = torch.randint(2, spec.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    attn = AttentionMetadata(torch.arange(150), torch.tensor(table.slots(0, 150)), torch.tensor([0, 150]),
                             torch.tensor([150]), block_table_tensor([table.blocks]), 150, 150)
    batch = TargetBatch(ids, attn, torch.arange(150), want_hidden=True)
    assert ops._fused is not None
    logits, hidden = worker.execute(batch), worker.last_hidden.clone()
    monkeypatch.setattr(ops, "_fused", None)
    logits_ref, hidden_ref = worker.execute(batch), worker.last_hidden
    assert (hidden - hidden_ref).abs().max() <= 0.02 * hidden_ref.abs().max()
    assert (logits - logits_ref).abs().max() <= 0.02 * logits_ref.abs().max()
    assert (logits.argmax(-1) == logits_ref.argmax(-1)).float().mean() >= 0.98


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H", [(3, 576), (2, 100)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_interp(dtype, N, H, residual):
    _check_rms_norm("cpu", dtype, N, H, residual)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_interp(dtype):
    _check_silu_mul("cpu", dtype, 3, 100)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,nq,nkv,D", [(3, 9, 3, 64), (2, 0, 2, 32)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("store", [False, True])
def test_qkv_rope_interp(dtype, N, nq, nkv, D, norm, store):
    _check_qkv_rope("cpu", dtype, N, nq, nkv, D, norm, store)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
def test_context_kv_interp(dtype, norm):
    _check_context_kv("cpu", dtype, 3, 3, 2, 32, norm)
