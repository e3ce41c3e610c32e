"""The few-row projection kernels (``kernels/linear_triton.py``) against
their PyTorch references (``kernels/linear.py``), on the GPU (``gpu``) and
in Triton's interpreter on the CPU (``interp``: ``TRITON_INTERPRET=1``).

The kernel sums each output in fp32 in its own order (cuBLAS in another),
and its norm's statistics may differ from the reference's by an fp32 ulp:
outputs are checked at most two units in the last place of their row's
largest value apart and >= 99 % identical. The residual stream is one
rounded add: exact. A row's bits must not depend on the rows beside it,
nor (on the GPU, whose tensor cores sum 16 columns at a time in order) on
the kernel's tile widths."""

from __future__ import annotations

import pytest
import torch

from test_fused_kernels import DTYPES, INTERP, _cuda, gpu, interp
from kernel_helpers import _patch_interpreter


def _modules():
    pytest.importorskip("triton")
    if INTERP:
        _patch_interpreter()
    from specray.kernels import linear, linear_triton

    return linear, linear_triton


def assert_close_rows(out: torch.Tensor, ref: torch.Tensor):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    ulp = torch.finfo(ref.dtype).eps
    scale = ref.float().abs().amax(-1, keepdim=True).clamp_min(torch.finfo(ref.dtype).tiny)
    diff = (out.float() - ref.float()).abs()
    assert (diff <= 2.02 * ulp * scale).all(), f"max diff {diff.max().item():.3e} (row scale {scale.max().item():.3e})"
    # Where the two fp32 sums differ in their last bits the rounded outputs
    # can differ by one ulp: ~1-2 % of bf16 outputs (H100: 98.0-98.9 %
    # identical), fewer of fp16's.
    same = (out == ref).float().mean().item()
    assert same >= (0.97 if ref.dtype == torch.bfloat16 else 0.99), f"{same:.4f} identical"


def _inputs(device, dtype, M, N, K, seed, bias=False, gate_up=False):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(M, 2 * K if gate_up else K, generator=g)).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    return g, x, w, b


def _check(device, dtype, kind, M, N, K, bias=False, residual=False):
    ref, kern = _modules()
    g, x, w, b = _inputs(device, dtype, M, N, K, M * 101 + N + K, bias, gate_up=kind == "silu")
    x0 = x.clone()
    r = torch.randn(M, K, generator=g).to(device, dtype) if residual else None
    norm_w = (1 + 0.2 * torch.randn(K, generator=g)).to(device, dtype)

    def run(rows, res):
        if kind == "plain":
            return kern.linear(rows, w, b), None
        if kind == "silu":
            return kern.silu_mul_linear(rows, w, b), None
        return kern.norm_linear(rows, norm_w, 1e-6, res, w, b)

    got, s = run(x, r)
    if kind == "plain":
        want = ref.linear(x, w, b)
    elif kind == "silu":
        want = ref.silu_mul_linear(x, w, b)
    else:
        want, s_ref = ref.norm_linear(x, norm_w, 1e-6, r, w, b)
        if r is None:
            assert s is x
        else:
            torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    assert torch.equal(x, x0), "the input was written"
    assert_close_rows(got, want)
    assert torch.equal(run(x[-1:], r if r is None else r[-1:])[0], got[-1:]), "a row's bits depend on the others"
    return run, x, r, got


CASES = [(1, 4096, 4096), (3, 6144, 576), (4, 1000, 100), (2, 96, 1536), (16, 1536, 576), (13, 640, 4096)]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", CASES)
@pytest.mark.parametrize("kind", ["plain", "norm", "norm_residual", "silu"])
def test_skinny_linear_gpu(dtype, M, N, K, kind):
    _check(_cuda(), dtype, kind.split("_")[0], M, N, K, bias=M in (3, 13, 11), residual=kind.endswith("residual"))


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 200, 256), (3, 67, 100), (16, 48, 96), (11, 64, 256)])
@pytest.mark.parametrize("kind", ["plain", "norm", "norm_residual", "silu"])
def test_skinny_linear_interp(dtype, M, N, K, kind):
    _check("cpu", dtype, kind.split("_")[0], M, N, K, bias=M in (3, 13, 11), residual=kind.endswith("residual"))


@gpu
@pytest.mark.parametrize("kind", ["plain", "norm_residual", "silu"])
def test_skinny_linear_bits_do_not_depend_on_the_tile_widths_gpu(kind, monkeypatch):
    _, kern = _modules()
    N, K = 320, 1024
    run, x, r, got = _check(_cuda(), torch.bfloat16, kind.split("_")[0], 13, N, K,
                            residual=kind.endswith("residual"))
    for cfg in [(32, 64, 4, 3), (64, 256, 4, 4), (16, 128, 4, 2)]:  # within the H100's shared memory
        monkeypatch.setitem(kern.CONFIGS, (N, K), cfg)
        assert torch.equal(run(x, r)[0], got), cfg


@gpu
def test_skinny_linear_captures_in_a_cuda_graph_gpu(monkeypatch):
    """Replayed with new contents, a captured call writes what an eager one does."""
    from specray.kernels import ops

    ref, _ = _modules()
    assert ops._linear is not None  # else ops runs the references and this compares them with themselves
    monkeypatch.setattr(ops, "FEW_ROW_KERNELS", True)
    dev, dt, M, N, K = _cuda(), torch.bfloat16, 2, 768, 576
    h, res, w = (torch.zeros(M, K, device=dev, dtype=dt), torch.zeros(M, K, device=dev, dtype=dt),
                 torch.zeros(N, K, device=dev, dtype=dt))
    norm_w, w_down = torch.zeros(K, device=dev, dtype=dt), torch.zeros(K, N // 2, device=dev, dtype=dt)

    def step():
        y, s = ops.norm_linear(h, norm_w, 1e-6, res, w)
        return y, s, ops.silu_mul_linear(y, w_down), ops.linear(h, w)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    g = torch.Generator().manual_seed(0)
    for buf, scale in ((h, 1.0), (res, 1.0), (w, K ** -0.5), (w_down, (N // 2) ** -0.5)):
        buf.copy_((scale * torch.randn(buf.shape, generator=g)).to(dev, dt))
    norm_w.copy_((1 + 0.2 * torch.randn(K, generator=g)).to(dev, dt))
    graph.replay()
    y_ref, s_ref = ref.norm_linear(h, norm_w, 1e-6, res, w)
    y, s, down, plain = outs
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    assert_close_rows(y, y_ref)
    assert_close_rows(down, ref.silu_mul_linear(y, w_down))
    assert_close_rows(plain, ref.linear(h, w))


@gpu
@pytest.mark.parametrize("rows", [1, 3])
def test_target_decode_rows_skinny_vs_cublas_gpu(tmp_path, rows, monkeypatch):
    _check_decode_rows(tmp_path, _cuda(), rows, monkeypatch)


@interp
def test_target_decode_rows_skinny_vs_reference_interp(tmp_path, monkeypatch):
    """The model's wiring of the kernels (the residual stream, taps, the
    MLP) run in the interpreter: the CPU's ops routed to them."""
    from specray.kernels import ops

    _, kern = _modules()
    monkeypatch.setattr(ops, "_linear", kern)
    monkeypatch.setattr(ops, "_skinny_ok", lambda x, w: ops.FEW_ROW_KERNELS and 0 < x.shape[0] <= 4)
    _check_decode_rows(tmp_path, "cpu", 3, monkeypatch)


def _check_decode_rows(tmp_path, device, rows, monkeypatch):
    """A bf16 target's decode forward of a few rows (the kernels' case)
    against the same forward through cuBLAS and the unfused norms."""
    from factories import make_target
    from specray.actors.kv_cache import BlockAllocator, BlockTable, block_table_tensor
    from specray.actors.target import TargetWorker
    from specray.config import TargetSpec
    from specray.kernels import ops
    from specray.plan import AttentionMetadata, TargetBatch

    make_target(tmp_path, "qwen3", seed=5, hidden_size=384, intermediate_size=768, num_attention_heads=6,
                num_key_value_heads=2, head_dim=64, num_hidden_layers=4, vocab_size=512)
    spec = TargetSpec.from_dir(tmp_path)
    worker = TargetWorker(spec, device=device, dtype="bfloat16", max_model_len=256, tap_layer_ids=(0, 2, 3))
    worker.init_cache(num_blocks=64, block_size=16)
    alloc, ctx = BlockAllocator(64, 16), 40
    tables = [BlockTable(alloc) for _ in range(rows)]
    for t in tables:
        t.reserve(ctx + 1)
    gen = torch.Generator().manual_seed(1)
    # Each row's prompt prefilled into its own blocks, then one decode row each.
    prompts = torch.randint(2, spec.vocab_size, (rows * ctx,), generator=gen)
    attn = AttentionMetadata(torch.arange(ctx).repeat(rows), torch.tensor([s for t in tables for s in t.slots(0, ctx)]),
                             torch.arange(rows + 1) * ctx, torch.full((rows,), ctx),
                             block_table_tensor([t.blocks for t in tables]), ctx, ctx)
    worker.execute(TargetBatch(prompts, attn, torch.arange(rows) * ctx + ctx - 1, want_hidden=False))
    ids = torch.randint(2, spec.vocab_size, (rows,), generator=gen)
    attn = AttentionMetadata(torch.full((rows,), ctx), torch.tensor([t.slots(ctx, ctx + 1)[0] for t in tables]),
                             torch.arange(rows + 1), torch.full((rows,), ctx + 1),
                             block_table_tensor([t.blocks for t in tables]), 1, ctx + 1)
    batch = TargetBatch(ids, attn, torch.arange(rows), want_hidden=True)
    assert ops._linear is not None
    monkeypatch.setattr(ops, "FEW_ROW_KERNELS", True)
    calls = []
    monkeypatch.setattr(ops._linear, "_launch", lambda *a, _launch=ops._linear._launch, **k: calls.append(1) or
                        _launch(*a, **k))
    logits, hidden = worker.execute(batch), worker.last_hidden.clone()
    assert len(calls) == 4 * 4  # every projection of every layer ran in the kernels
    monkeypatch.setattr(ops, "FEW_ROW_KERNELS", False)
    logits_ref, hidden_ref = worker.execute(batch), worker.last_hidden
    assert (hidden - hidden_ref).abs().max() <= 0.02 * hidden_ref.abs().max()
    assert (logits - logits_ref).abs().max() <= 0.02 * logits_ref.abs().max()
    assert torch.equal(logits.argmax(-1), logits_ref.argmax(-1))
