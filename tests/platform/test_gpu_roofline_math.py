"""The floors of bench/gpu_roofline.py, checked by hand for Llama-3-8B, and its --smoke run."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from splitserve.platform.models import build_model
from splitserve.platform.weights.presets import preset_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_roofline.py"
_spec = importlib.util.spec_from_file_location("gpu_roofline", SCRIPT)
roofline = sys.modules["gpu_roofline"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(roofline)

LLAMA3_8B = preset_config("llama-3-8b", "random:llama-3-8b")
EMBED = 128256 * 4096  # one vocab x hidden table
LAYER_MATMULS = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336  # q k v o, gate up down
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 kv heads, bf16


@pytest.mark.parametrize("preset", ["llama-3-8b", "tiny"])
def test_param_count_matches_the_model(preset):
    cfg = preset_config(preset, f"random:{preset}")
    with torch.device("meta"):  # shapes only: 8B parameters, no memory
        model = build_model(cfg)
    assert roofline.param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_decode_bytes_llama3_8b_batch1_context_1k():
    assert roofline.param_count(LLAMA3_8B) == 8_030_261_248  # 16.06e9 bytes in bf16
    assert roofline.layer_matmul_params(LLAMA3_8B) == LAYER_MATMULS
    weights = (8_030_261_248 - EMBED + 4096) * 2  # the input table: one row gathered
    assert roofline.decode_weight_bytes(LLAMA3_8B, 1, "bfloat16") == weights == 15_009_857_536
    assert roofline.kv_bytes_per_token(LLAMA3_8B, "bfloat16") == KV_PER_TOKEN == 131_072
    assert roofline.decode_step_bytes(LLAMA3_8B, 1, 1024, "bfloat16") == weights + 1024 * KV_PER_TOKEN
    step = roofline.decode_step_bytes(LLAMA3_8B, 64, 1024, "bfloat16")
    assert step == (8_030_261_248 - EMBED + 64 * 4096) * 2 + 64 * 1024 * KV_PER_TOKEN
    assert roofline.floor_seconds(step, 3.0e12) == pytest.approx(step / 3.0e12)


def test_prefill_flops_llama3_8b():
    attention_2k = 32 * 4 * 32 * 128 * (2048 * 2049 // 2)  # causal: query i sees i + 1 keys
    lm_head_row = 2 * EMBED
    assert roofline.prefill_flops(LLAMA3_8B, 2048) == 2 * 32 * LAYER_MATMULS * 2048 + lm_head_row + attention_2k
    assert roofline.prefill_flops(LLAMA3_8B, 2048) == pytest.approx(2.97e13, rel=0.01)
    # one token after a 999-token prefix: 1000 keys, as a decode step would see
    one = roofline.prefill_flops(LLAMA3_8B, 1, start_pos=999)
    assert one == 2 * 32 * LAYER_MATMULS + lm_head_row + 32 * 4 * 32 * 128 * 1000


def test_write_replaces_only_its_section(tmp_path):
    """The section goes to its own file beside the page (benchmarks/gpu-roofline.md), which the page links."""
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkeep me\n\n<!-- other:begin -->\nother\n<!-- other:end -->\n")
    roofline.write(str(doc), f"{roofline.MARK_BEGIN}\nfirst\n{roofline.MARK_END}")
    roofline.write(str(doc), f"{roofline.MARK_BEGIN}\nsecond\n{roofline.MARK_END}")
    page, text = doc.read_text(), (tmp_path / "benchmarks" / "gpu-roofline.md").read_text()
    assert "keep me" in page and "<!-- other:begin -->\nother" in page
    assert page.count("](benchmarks/gpu-roofline.md)") == 1 and roofline.MARK_BEGIN not in page
    assert "second" in text and "first" not in text and text.count(roofline.MARK_BEGIN) == 1


def test_smoke_run_end_to_end(tmp_path):
    """--smoke runs every phase on CPU with random:tiny and writes a complete section."""
    doc = tmp_path / "benchmarks.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--write", str(doc)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [d["batch"] for d in result["decode"]] == [1, 2]
    assert [p["tokens"] for p in result["prefill"]] == [16, 64]
    assert all(d["step_s"] > 0 and d["floor_s"] > 0 for d in result["decode"])
    assert result["baseline"]["hf_tok_s"] > 0 and result["attention_path"] == "torch reference"
    text = (tmp_path / "benchmarks" / "gpu-roofline.md").read_text()
    assert roofline.MARK_BEGIN in text and roofline.MARK_END in text and "| 64 |" in text
    assert "](benchmarks/gpu-roofline.md)" in doc.read_text()
