"""bench/decode_efficiency.py on the CPU: a tiny random target's forward at
1 and 16 rows, the engine's AR step, and the bytes a step reads."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_decode_efficiency_reports_bandwidth_fractions(tmp_path):
    import json

    import decode_efficiency as mod

    out = tmp_path / "de.json"
    r = mod.main(["--random-shape", "tiny", "--ckpt-dir", str(tmp_path / "ck"), "--device", "cpu",
                  "--dtype", "float32", "--context", "64", "--replays", "3", "--steps", "8", "--kernels", "--out", str(out)])
    assert json.loads(out.read_text()) == r
    assert r["forward_ar_ms"] > 0 and r["forward_verify16_ms"] > 0 and r["engine_ar_ms_per_token"] > 0
    assert abs(r["verify16_over_ar"] - r["forward_verify16_ms"] / r["forward_ar_ms"]) < 0.01
    # the tiny target unties its embedding: a step reads its weights less that table, plus the context's K/V
    assert 0 < r["bytes_read_per_step"] < r["weight_bytes"]
    assert 0 < r["forward_ar_of_copy_bandwidth"] and 0 < r["engine_ar_of_copy_bandwidth"]
    k = r["ar_forward_kernels"]  # on the CPU: the forward's top-level ops, one forward each replay
    assert k["kernels_per_forward"] > 0 and k["one_forward"] and k["by_name"]
    assert abs(sum(e["us_per_forward"] for e in k["by_name"]) - k["kernel_us_per_forward"]) < 0.01 * k["kernel_us_per_forward"] + 1 \
        or len(k["by_name"]) == 30
