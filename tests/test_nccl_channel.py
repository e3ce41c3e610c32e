"""The NCCL (CuPy) drafter channel between two GPUs, and the Ray backend with
the drafter on its own GPU. Needs two GPUs: skipped elsewhere (the multi-GPU
issue runs it)."""

import multiprocessing as mp

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _end(rank, uid, q):
    from specray.actors.transport import CupyNcclChannel

    torch.cuda.set_device(rank)
    ch = CupyNcclChannel(uid, rank, torch.device("cuda", rank))
    if rank == 0:
        hidden = torch.randn(37, 5 * 4096, dtype=torch.bfloat16, device="cuda:0")
        meta = torch.arange(37, device="cuda:0")
        ch.send(2, [hidden, meta, torch.zeros(0, device="cuda:0")])
        cmd, (tokens,) = ch.recv()
        torch.cuda.synchronize()
        q.put((cmd, hidden.sum().item(), tokens.cpu().tolist()))
    else:
        cmd, (hidden, meta, empty) = ch.recv()
        ch.send(4, [meta[:5] * 2])
        torch.cuda.synchronize()
        q.put((cmd, hidden.sum().item(), list(hidden.shape), empty.numel()))


def test_nccl_channel_roundtrip():
    from specray.actors.transport import nccl_unique_id

    uid = nccl_unique_id()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_end, args=(r, uid, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    sender = next(r for r in results if r[0] == 4)
    receiver = next(r for r in results if r[0] == 2)
    assert sender[2] == [0, 2, 4, 6, 8]
    assert receiver[2] == [37, 5 * 4096] and receiver[3] == 0
    assert abs(sender[1] - receiver[1]) < 1e-3 * max(1.0, abs(sender[1]))


def test_ray_separate_drafter_on_its_own_gpu_matches_colocated(tmp_path):
    from factories import make_drafter, make_target
    from specray import LLM, SamplingParams
    from specray.placement import ensure_ray

    hf = make_target(tmp_path / "t", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    make_drafter(tmp_path / "d", hf.config, block_size=16)
    ensure_ray()
    prompts = [[5, 6, 7, 8], [9] * 20, list(range(2, 60))]
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = {}
    for placement in ("colocated", "separate"):
        llm = LLM(tmp_path / "t", tmp_path / "d", device="cuda", dtype="float32", backend="ray",
                  drafter_placement=placement, num_kv_blocks=256)
        try:
            outs[placement] = [o.token_ids for o in llm.generate(prompts, p)]
        finally:
            llm.shutdown()
    assert outs["separate"] == outs["colocated"]
