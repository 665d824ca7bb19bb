"""The fused CPU kernels (platform/kernels/cpu_ops.c) against their torch definitions.

They are built for this host at first use; where no C compiler works they are absent and the
model keeps its torch path (that fallback is tested too). Every op is checked for values and
for batch invariance (a row's bits do not depend on the other rows of the call).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from splitserve.platform.kernels import cpu_build
from splitserve.platform.kernels.cpu_ops import cpu_ops
from splitserve.platform.models.attention import decode_attention, gather_kv
from splitserve.platform.models.layers import RotaryEmbedding, apply_rotary
from splitserve.platform.quant import formats

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C compiler could build the fused CPU kernels here")
NH, NKV, D, BS, NB = 9, 3, 64, 16, 40


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def test_rms_norm_and_residual_add():
    x, w, res = torch.randn(5, 576), torch.rand(576), torch.randn(5, 576)
    assert torch.allclose(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), None, 1e-5) * w, atol=1e-5)
    updated = res.clone()
    out = ops.add_rms_norm(x, updated, w, 1e-5)
    assert torch.equal(updated, res + x)
    assert torch.allclose(out, F.rms_norm(res + x, (576,), None, 1e-5) * w, atol=1e-5)


def test_silu_mul():
    gate_up = torch.randn(5, 3072) * 4
    assert torch.allclose(ops.silu_mul(gate_up), F.silu(gate_up[:, :1536]) * gate_up[:, 1536:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_rope_rotates_q_and_k_in_place_and_writes_kv_slots(kv_dtype):
    """A float16 cache gets each rotated k and each v rounded to nearest even, as torch's .half()."""
    k_cache, v_cache = torch.zeros(NB, BS, NKV, D, dtype=kv_dtype), torch.zeros(NB, BS, NKV, D, dtype=kv_dtype)
    qkv = torch.randn(7, (NH + 2 * NKV) * D)
    positions = torch.tensor([3, 100, 5, 17, 0, 31, 64])
    slots = torch.tensor([1, 50, 33, 99, 200, 17, 300])
    rotary = RotaryEmbedding(D, 2048, 10000.0, None)
    heads = qkv.view(7, -1, D).clone()
    ref = apply_rotary(heads[:, : NH + NKV], *rotary.cos_sin(positions, torch.float32))
    ops.rope_write_kv(qkv, positions, rotary.cos_cache, rotary.sin_cache, k_cache, v_cache, slots, NH, NKV, D)
    assert torch.allclose(qkv.view(7, -1, D)[:, : NH + NKV], ref, atol=1e-5)
    assert torch.equal(k_cache.view(-1, NKV, D)[slots], qkv.view(7, -1, D)[:, NH : NH + NKV].to(kv_dtype))
    assert torch.allclose(k_cache.view(-1, NKV, D)[slots].float(), ref[:, NH:], atol=1e-5, rtol=1e-3)
    assert torch.equal(v_cache.view(-1, NKV, D)[slots], heads[:, NH + NKV :].to(kv_dtype))


def check_decode_attention(kernels, bs: int, d: int, contexts: list[int], kv_dtype=torch.float32) -> None:
    """`kernels.decode_attention` against torch's gather + softmax on a random paged cache (16
    blocks per sequence; float32 or float16), and one sequence alone equal bit for bit to its row
    in the batch."""
    k_cache, v_cache = torch.randn(NB, bs, NKV, d).to(kv_dtype), torch.randn(NB, bs, NKV, d).to(kv_dtype)
    context = torch.tensor(contexts)
    table = torch.stack([torch.randperm(NB)[:16] for _ in range(len(contexts))])
    q = torch.randn(len(contexts), NH, d)
    mask = torch.arange(16 * bs)[None] < context[:, None]
    ref = decode_attention(q, gather_kv(k_cache, table), gather_kv(v_cache, table), d**-0.5, mask)
    got = kernels.decode_attention(q, k_cache, v_cache, table, context, d**-0.5)
    assert torch.allclose(got, ref, atol=1e-5)
    alone = kernels.decode_attention(
        q[2:3].contiguous(), k_cache, v_cache, table[2:3].contiguous(), context[2:3].contiguous(), d**-0.5
    )
    assert torch.equal(alone[0], got[2])


def check_heads_alone(kernels, group: int, d: int, kv_dtype) -> None:
    """Two KV heads of `group` query heads each: every query head's output equals, bit for bit, what
    it gets alone on its KV head, and the whole matches torch."""
    torch.manual_seed(group * 1000 + d)
    k_cache, v_cache = torch.randn(NB, 16, 2, d).to(kv_dtype), torch.randn(NB, 16, 2, d).to(kv_dtype)
    context = torch.tensor([1, 30, 200])
    table = torch.stack([torch.randperm(NB)[:16] for _ in range(3)])
    q = torch.randn(3, 2 * group, d)
    got = kernels.decode_attention(q, k_cache, v_cache, table, context, d**-0.5)
    mask = torch.arange(256)[None] < context[:, None]
    ref = decode_attention(q, gather_kv(k_cache, table), gather_kv(v_cache, table), d**-0.5, mask)
    assert torch.allclose(got, ref, atol=1e-5)
    for kv_head in range(2):
        for j in range(group):
            h = kv_head * group + j
            alone = kernels.decode_attention(
                q[:, h : h + 1].contiguous(),
                k_cache[:, :, kv_head : kv_head + 1].contiguous(),
                v_cache[:, :, kv_head : kv_head + 1].contiguous(),
                table,
                context,
                d**-0.5,
            )
            assert torch.equal(alone[:, 0], got[:, h]), (kv_head, j)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 96])  # 96: the AVX-512 path with head_dim not a constant
@pytest.mark.parametrize("group", [1, 2, 3, 5, 7])
def test_decode_attention_gives_a_query_head_the_bits_it_gets_alone(group, d, kv_dtype):
    """The AVX-512 path takes a KV head's query heads a few at a time (up to 4 for head_dim 64, 2
    for 128) to load each K and V row once for them: 7 heads go as 4 + 3. Each head's output must
    still be what it is alone on that KV head (test_cpu_a8.py: the other instruction sets)."""
    check_heads_alone(ops, group, d, kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bs,d", [(16, 64), (32, 128), (8, 64), (16, 40)])
def test_decode_attention_reads_the_paged_cache_in_place(bs, d, kv_dtype):
    """(16, 64) and (32, 128) take the 16-keys-at-a-time path on AVX-512 hosts, (8, 64) and
    (16, 40) the per-key one; contexts end mid-block and mid-chunk."""
    check_decode_attention(ops, bs, d, [1, 17, 100, 256 if bs >= 16 else 120], kv_dtype)


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (64, 96)])
def test_q4_linear_is_float32_math_on_the_int4_weights_and_batch_invariant(n, k):
    groups = formats.quantize_int4(torch.randn(n, k) * 0.05)
    codes = groups.codes.view(n, k // 32, 32)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    d, mn = groups.scale.contiguous(), (groups.zero - 8 * groups.scale).contiguous()
    weight = groups.dequantize()
    assert torch.allclose(ops.q4_dequant(qs, d, mn), weight, atol=1e-6)
    x = torch.randn(7, k)
    y = ops.q4_linear(x, qs, d, mn)
    ref = x.double() @ weight.double().t()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5
    for i in range(7):
        assert torch.equal(ops.q4_linear(x[i : i + 1].contiguous(), qs, d, mn)[0], y[i])


def test_disabled_kernels_leave_the_torch_path(monkeypatch):
    monkeypatch.setenv(cpu_build.ENV_DISABLE, "0")
    cpu_build.load.cache_clear()
    try:
        assert cpu_build.load() is None
    finally:
        monkeypatch.undo()
        cpu_build.load.cache_clear()
    assert cpu_build.load() is not None


def test_the_build_is_cached_per_host(tmp_path, monkeypatch):
    """A fresh cache directory gets one library named for the source, compiler and CPU flags."""
    monkeypatch.setenv(cpu_build.ENV_CACHE, str(tmp_path))
    path = cpu_build._build(cpu_build._compiler())
    assert path.parent == tmp_path and path.name.startswith("splitserve_cpu_ops-") and path.exists()
    assert cpu_build._build(cpu_build._compiler()) == path  # second call: reused, not rebuilt


def test_the_c_source_ships_in_the_wheel(tmp_path):
    """Pods build the kernels from the installed package: cpu_ops.c must be package data."""
    import pathlib
    import subprocess
    import sys
    import zipfile

    root = pathlib.Path(__file__).resolve().parents[2]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(root),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("splitserve-*.whl")
    assert "splitserve/platform/kernels/cpu_ops.c" in zipfile.ZipFile(wheel).namelist()


def test_gemm_fixed_is_a_matmul_whose_rows_ignore_their_batch_and_zero_columns():
    """LoRA's shrink and expand (platform/lora/batch.py): the values of x @ w, and a row's bits
    the same whatever rows share the call and wherever exact zeros pad its inner dimension (a
    mixed-adapter step's masked-out columns)."""
    x, w = torch.randn(13, 576), torch.randn(576, 37) * 0.05  # 37 columns: a 16-, a 16- and a 5-wide tile
    y = ops.gemm_fixed(x, w)
    assert torch.allclose(y, x @ w, atol=1e-5)
    for rows in (slice(0, 1), slice(3, 4), slice(2, 9)):
        assert torch.equal(ops.gemm_fixed(x[rows].contiguous(), w), y[rows])
    for cols in (slice(0, 8), slice(16, 32), slice(33, 37)):  # a column's chain is its own
        assert torch.equal(ops.gemm_fixed(x, w[:, cols].contiguous()), y[:, cols])
    # expand: h [M, r] with its adapter's columns among zeros of others, added into y
    h, b = torch.randn(6, 8), torch.randn(8, 96) * 0.1
    base = torch.randn(6, 96)
    alone = ops.gemm_fixed(h, b, out=base.clone())
    padded_h = torch.cat([torch.zeros(6, 16), h, torch.zeros(6, 24)], 1)
    padded_b = torch.cat([torch.randn(16, 96), b, torch.randn(24, 96)], 0)
    assert torch.equal(ops.gemm_fixed(padded_h, padded_b, out=base.clone()), alone)
    assert torch.allclose(alone, base + h @ b, atol=1e-5)


def test_gemma_norm_in_c_is_torchs_within_float32_rounding_on_views():
    """OffsetRMSNorm (y = x / rms(x) * (1 + w)) with the C kernel handed in gives torch's values,
    also on the strided per-head views q_norm and k_norm receive; handing in None restores torch's."""
    from splitserve.platform.models.layers import OffsetRMSNorm

    torch.manual_seed(0)
    norm = OffsetRMSNorm(256, 1e-6)
    norm.weight.data = torch.randn(256) * 0.3
    x = torch.randn(3, 1536)[:, :1024].reshape(3, 4, 256)[:, 1:3] * 20  # two heads of a qkv row
    ref = norm(x)
    norm.use_ops(ops)
    y = norm(x)
    assert y.shape == ref.shape and torch.allclose(y, ref, rtol=1e-6, atol=1e-5)
    norm.use_ops(None)
    assert torch.equal(norm(x), ref)


# -- what the worker agrees to load (cpu_build.open_verified) ---------------------------------------
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One library built for this host with its digest (compiled once: the tests copy it)."""
    return cpu_build._build(cpu_build._compiler(), folder=tmp_path_factory.mktemp("pristine"))


def _install(pristine, folder):
    """The pristine library and its digest, copied into `folder` (what a build there leaves)."""
    folder.mkdir(mode=0o700)
    for path in (pristine, cpu_build._digest_path(pristine)):
        shutil.copy2(path, folder / path.name)
    return folder / pristine.name


@pytest.fixture
def loads(monkeypatch):
    """Every library path ctypes is asked to load, in order."""
    seen = []
    real = cpu_build.ctypes.CDLL

    def spy(name, *args, **kwargs):
        seen.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(cpu_build.ctypes, "CDLL", spy)
    return seen


def _tamper(library, how):
    if how == "bytes appended":
        with open(library, "ab") as f:
            f.write(b"\0planted")
    elif how == "group-writable":
        library.chmod(0o775)
    elif how == "no digest recorded":
        cpu_build._digest_path(library).unlink()
    else:  # a link to another library in its place
        other = library.with_name("elsewhere.so")
        library.rename(other)
        library.symlink_to(other)


@pytest.mark.parametrize(
    "how, message",
    [
        ("bytes appended", "changed after the build"),
        ("group-writable", "writable by its group or others"),
        ("no digest recorded", "none recorded"),
        ("symlink", "does not open as a plain file"),
    ],
)
def test_a_changed_kernel_library_is_refused(tmp_path, pristine, loads, how, message):
    library = _install(pristine, tmp_path / "kernels")
    assert cpu_build.open_verified(library)._name and len(loads) == 1  # as built: loaded
    _tamper(library, how)
    with pytest.raises(cpu_build.KernelRefused, match=message):
        cpu_build.open_verified(library)
    assert len(loads) == 1  # refused before ctypes saw it


def test_the_worker_rebuilds_a_refused_library_and_loads_that(tmp_path, pristine, monkeypatch, loads, caplog):
    library = _install(pristine, tmp_path / "kernels")
    _tamper(library, "bytes appended")
    monkeypatch.setenv(cpu_build.ENV_CACHE, str(library.parent))
    lib = cpu_build.declare(cpu_build._build_and_open(cpu_build._compiler()))  # what load() does
    assert lib.ss_a8_path() and len(loads) == 1 and "changed after the build" in caplog.text
    recorded = cpu_build._digest_path(library).read_text()
    assert hashlib.sha256(library.read_bytes()).hexdigest() == recorded  # rebuilt, its digest recorded


def test_a_world_writable_kernel_folder_is_neither_built_into_nor_loaded_from(
    tmp_path, pristine, monkeypatch, loads, caplog
):
    """Anyone could have planted a library there, with a matching digest file: the worker builds
    and loads a private copy instead and leaves the folder as it found it."""
    planted = _install(pristine, tmp_path / "shared")
    planted.parent.chmod(0o777)
    monkeypatch.setenv(cpu_build.ENV_CACHE, str(planted.parent))
    with pytest.raises(cpu_build.KernelRefused, match="writable by its group or others"):
        cpu_build.open_verified(planted)
    lib = cpu_build.declare(cpu_build._build_and_open(cpu_build._compiler()))
    [private] = re.findall(r"building a private copy in (\S+)", caplog.text)
    try:
        assert lib.ss_a8_path() and len(loads) == 1
        assert sorted(p.name for p in planted.parent.iterdir()) == sorted([planted.name, planted.name + ".sha256"])
        assert os.stat(private).st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(private)
