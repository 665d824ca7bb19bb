"""The integer-activation kernels (platform/kernels/cpu_a8.c, quant/a8.py) and the one-call decode
step (cpu_decode.c).

- the activation quantizer's codes and rounding bounds (one digit: 1/254 of the group's largest
  input; two digits: 1/64516);
- the 4-bit and 8-bit kernels against an integer reference computed in float64 from the same
  codes, and a row's bits independent of the other rows (batch invariance by construction);
- the packing is the layout cpu_a8.c documents (unpacked back to the codes);
- the same bits from every instruction-set path: the library is rebuilt here for AVX2 (x86-64-v3),
  AVX2 + AVX-VNNI and portable C where this CPU can run them, so an AVX2-only host computes what
  an AVX-512 host computes;
- the one-call decode step gives the Python fused path's logits bit for bit on SmolLM2;
- on a CPU with AMX-INT8 tiles, steps of 8 rows or more take the tile unit and give the VNNI
  path's bits (SPLITSERVE_AMX=0 turns the tiles off); elsewhere that test says the CPU lacks them.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch

from splitserve.platform.kernels import cpu_build
from splitserve.platform.kernels.cpu_ops import CpuOps, cpu_ops
from splitserve.platform.quant import a8, formats
from splitserve.platform.quant.cpu import cpu_flags

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C compiler could build the fused CPU kernels here")


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def activations(m: int, k: int) -> torch.Tensor:
    """Like a normed hidden state: mostly small, with a few large outlier channels."""
    x = torch.randn(m, k)
    x[:, torch.randperm(k)[:3]] *= 40
    return x


@pytest.mark.parametrize("digits", [1, 2])
def test_quantized_activations_round_within_their_bound(digits):
    x = activations(6, 576)
    q, unit, sums = ops.quantize_a8(x, digits)
    assert q.shape == (6, digits * 576) and q.abs().max() <= 127
    groups = x.view(6, 18, 32)
    codes = q.view(6, digits, 18, 32).double()
    if digits == 2:  # the inputs' own sum
        assert torch.equal(sums, groups.sum(-1)) or torch.allclose(sums, groups.sum(-1), atol=1e-4)
    else:  # the sum of what the codes stand for, so the minimum term sees the same inputs
        assert torch.equal(sums, unit * codes[:, 0].sum(-1).float())
    value = codes[:, 0] * 254 + codes[:, 1] if digits == 2 else codes[:, 0]
    approx = value * unit.double()[..., None]
    amax = groups.abs().amax(-1, keepdim=True).double()
    bound = amax / (254 if digits == 1 else 64516)
    assert ((approx - groups.double()).abs() <= bound * 1.001 + 1e-12).all()


def q4_reference(a, codes, scale, minimum):
    q, unit, sums = a
    m, k = q.shape[0], sums.shape[1] * 32
    digits = q.shape[1] // k
    g = k // 32
    qd = q.view(m, digits, g, 32).double()
    value = qd[:, 0] * 254 + qd[:, 1] if digits == 2 else qd[:, 0]
    dots = torch.einsum("mgi,ngi->mng", value, codes.double().view(-1, g, 32))
    return (
        dots * scale.half().double()[None] * unit.double()[:, None]
        + minimum.half().double()[None] * sums.double()[:, None]
    ).sum(-1)


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (32, 64)])
def test_q4_kernel_is_the_integer_sum_and_batch_invariant(digits, n, k):
    kernel = a8.Int4A8Kernel(torch.randn(n, k) * 0.05, None, ops, digits)
    codes, scale, minimum = unpack_q4(kernel)
    x = activations(9, k)
    y = kernel(x)
    ref = q4_reference(ops.quantize_a8(x, digits), codes, scale, minimum)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    for rows in (slice(0, 1), slice(3, 8), slice(8, 9)):
        assert torch.equal(kernel(x[rows].contiguous()), y[rows])
    assert torch.equal(kernel(torch.cat([x[4:5], torch.randn(5, k)]))[0], y[4])


def test_one_digit_linear_is_the_weights_times_the_rounded_inputs():
    """With one digit the minimum term takes the rounded inputs' sum, so a linear computes the 4-bit
    weights (codes, scales and minimums together) times exactly the inputs its codes stand for, as
    llama.cpp's Q8_1 activations do. With the inputs' exact sum there, each rounding error would be
    weighted by the codes alone (0..15) instead of the weight: 3.5 instead of 0.9 of a logit on
    SmolLM2 (test_quantization.py)."""
    kernel = a8.Int4A8Kernel(torch.randn(576, 576) * 0.05, None, ops, 1)
    codes, scale, minimum = unpack_q4(kernel)
    weights = codes.double().view(576, 18, 32) * scale.double()[..., None] + minimum.double()[..., None]
    x = activations(4, 576)
    q, unit, _ = ops.quantize_a8(x, 1)
    rounded = (q.double().view(4, 18, 32) * unit.double()[..., None]).view(4, 576)
    want = rounded @ weights.view(576, 576).T
    assert ((kernel(x).double() - want).abs().max() / want.abs().max()).item() < 1e-5


def unpack_q4(kernel: a8.Int4A8Kernel):
    """The codes, scales and minimums back out of the tile layout cpu_a8.c documents."""
    t, gb = kernel.tiles.shape
    g = gb // 256
    b = kernel.tiles.view(t, g, 4, 16, 4)  # (tile, group, i, row, c)
    low, high = (b & 0x0F), (b >> 4)
    codes = torch.stack([low, high], dim=2).permute(0, 4, 1, 2, 3, 5).reshape(t * 16, g * 32)
    scale = kernel.d.permute(0, 2, 1).reshape(t * 16, g).float()
    minimum = kernel.mn.permute(0, 2, 1).reshape(t * 16, g).float()
    return codes, scale, minimum


def test_q4_packing_round_trips_to_the_codes():
    groups = formats.quantize_int4(torch.randn(48, 96))
    tiles, d, mn = a8.pack_q4_tiles(groups.codes, groups.scale, groups.zero - 8 * groups.scale)
    kernel = a8.Int4A8Kernel.__new__(a8.Int4A8Kernel)
    kernel.tiles, kernel.d, kernel.mn = tiles, d, mn
    codes, scale, minimum = unpack_q4(kernel)
    assert torch.equal(codes, groups.codes) and torch.equal(scale, groups.scale.half().float())
    assert torch.equal(minimum, (groups.zero - 8 * groups.scale).half().float())


def test_q4_1_blocks_keep_their_exact_scales_and_minimums(smollm2_gguf_path):
    """Scales and minimums are stored as float16, as GGUF stores them: Q4_1's d and m survive bit
    for bit, so the kernel computes with exactly the file's weights."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from splitserve.platform.formats.gguf_file import GGUFFile

    file = GGUFFile(smollm2_gguf_path)
    info = file.tensors["blk.3.ffn_down.weight"]
    assert Q(info.tensor_type) == Q.Q4_1
    raw = formats.RawQuant(Q.Q4_1, file.raw(info.name), tuple(info.shape))
    blocks = raw.blocks.reshape(raw.shape[0], raw.shape[1] // 32, 20)
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0])
    m = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0])
    kernel = a8.Int4A8Kernel(raw, None, ops, 2)
    codes, scale, minimum = unpack_q4(kernel)
    assert kernel.exact and torch.equal(scale, d.float()) and torch.equal(minimum, m.float())
    assert torch.equal(formats.Int4Groups(codes, scale, minimum + 8 * scale).dequantize(), raw.dequantize())


def test_q8_head_is_the_integer_sum_over_the_int8_table_and_batch_invariant():
    """(Converting 254 s1 + s2 to float rounds once: |sum| can pass 2^24 for an int8 table.)"""
    table = formats.int8_groups(torch.randn(4096, 576))[0]
    head = a8.Int8A8Head(table.codes, table.scale, ops)
    x = activations(5, 576)
    y = head(x)
    q, unit, _ = ops.quantize_a8(x, head.digits)
    assert head.digits == 2  # the hidden state in two int8 digits
    qd = q.double().view(5, 2, 18, 32)
    dots = torch.einsum("mgi,ngi->mng", qd[:, 0] * 254 + qd[:, 1], table.codes.double().view(4096, 18, 32))
    ref = (dots * table.scale.half().double()[None] * unit.double()[:, None]).sum(-1)  # scales kept in float16
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert torch.equal(head(x[2:3].contiguous())[0], y[2])


def _other_isa(arch: tuple[str, ...]) -> CpuOps:
    return CpuOps(cpu_build.declare(ctypes.CDLL(str(cpu_build._build(cpu_build._compiler(), arch)))))


ISAS = {  # extra compiler flags -> the CPU flags a host needs to run that build, and the path it takes
    ("-march=x86-64-v3",): ({"avx2", "fma", "bmi2", "f16c"}, "avx2"),
    ("-march=x86-64-v3", "-mavxvnni"): ({"avx2", "fma", "bmi2", "f16c", "avx_vnni"}, "avx2"),
    ("-march=x86-64-v2",): (set(), "portable"),
}


@pytest.mark.parametrize("arch", list(ISAS), ids=lambda a: " ".join(a))
def test_every_instruction_set_path_gives_the_same_bits(arch):
    needs, path = ISAS[arch]
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run a {' '.join(arch)} build (lacks {sorted(needs - cpu_flags())})")
    other = _other_isa(arch)
    assert other.a8_path == path
    w = formats.quantize_int4(torch.randn(64, 96) * 0.05)
    x = activations(9, 96)
    table = formats.int8_groups(torch.randn(64, 96))[0]
    table.codes[0, :32] = -128  # the extreme code a GGUF Q8_0 table may hold
    heads = a8.Int8A8Head(table.codes, table.scale, ops), a8.Int8A8Head(table.codes, table.scale, other)
    for digits in (1, 2):
        here, there = (
            a8.Int4A8Kernel(w.dequantize(), None, ops, digits),
            a8.Int4A8Kernel(w.dequantize(), None, other, digits),
        )
        assert torch.equal(ops.quantize_a8(x, digits)[0], other.quantize_a8(x, digits)[0])
        for m in range(1, 10):  # every count of rows a pass over a tile can be left with (blocks of 1-4 rows)
            assert torch.equal(here(x[:m]), there(x[:m])), (digits, m)
            if digits == 2:
                assert torch.equal(heads[0](x[:m]), heads[1](x[:m])), m
    # LoRA's fixed-order float32 GEMM: vector lanes and the scalar fmaf tail round alike
    xf, wf, yf = torch.randn(5, 96), torch.randn(96, 29), torch.randn(5, 29)
    assert torch.equal(ops.gemm_fixed(xf, wf, out=yf.clone()), other.gemm_fixed(xf, wf, out=yf.clone()))


def quantize_reference(x: torch.Tensor, digits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ss_quantize_a8's definition, one IEEE float32 operation at a time (the remainder x - v u is
    fused: computed exactly in float64, rounded once), rounding half to even."""
    m, k = x.shape
    g = x.view(m, k // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    unit = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    v = torch.round(g * inv).clamp(-127, 127)
    codes = [v]
    if digits == 2:
        rest = (g.double() - v.double() * unit.double()).float()
        codes.append(torch.round(rest * inv * 254).clamp(-127, 127))
    q = torch.cat([c.reshape(m, k) for c in codes], 1).to(torch.int8)
    if digits == 1:  # one digit: the rounded inputs' sum, unit * sum(codes), one rounding
        return q, unit.squeeze(-1), unit.squeeze(-1) * v.sum(-1)
    s16 = g[..., :16] + g[..., 16:]
    s8 = s16[..., :8] + s16[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    sums = (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])
    return q, (unit / 254).squeeze(-1), sums


@pytest.mark.parametrize("arch", [("-march=native",), *ISAS], ids=lambda a: " ".join(a))
def test_activation_quantizer_is_its_definition_on_every_instruction_set(arch):
    """The vector quantizers (AVX-512, AVX2) and the portable one give the reference's exact codes,
    units and sums, rounding ties included: an AVX2 host's activations are an AVX-512 host's."""
    needs = ISAS[arch][0] if arch in ISAS else set()
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run a {' '.join(arch)} build (lacks {sorted(needs - cpu_flags())})")
    kernels = ops if arch == ("-march=native",) else _other_isa(arch)
    x = activations(300, 576) * torch.rand(300, 1) * 4
    x[0, :32] = 0  # an all-zero group: unit 0, codes 0
    x[1, :32] = torch.arange(32) - 15.5  # amax 15.5: x * 127 / 15.5 hits exact halves
    x[2, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.25] * 26)  # unit 1: ties to even
    x[3, :32] = 1e-30  # tiny but not zero
    for digits in (1, 2):
        got, want = kernels.quantize_a8(x, digits), quantize_reference(x, digits)
        for name, a, b in zip(("codes", "units", "sums"), got, want):
            assert torch.equal(a, b), f"{name} differ in {(a != b).sum().item()} places (digits {digits})"


def test_one_call_decode_step_gives_the_python_paths_logits_bit_for_bit(make_engine):
    from splitserve.platform.sampling.params import SamplingParams

    engine = make_engine(quantization="auto")
    assert engine.model.decode_plan is not None
    prompts = [[(i * 7919 + 31 * r) % 40000 + 100 for i in range(n)] for r, n in enumerate((5, 40, 130))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)

    def run() -> dict[str, list]:
        ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
        seen: dict[str, list] = {i: [] for i in ids}
        while engine.has_work():
            for out in engine.step():
                seen[out.req_id] += [(t, lp) for t, lp in zip(out.new_token_ids, out.new_logprobs or [])]
        engine.pool.reset_prefix_cache()
        return list(seen.values())

    fast = run()
    plan, engine.model.decode_plan = engine.model.decode_plan, None
    slow = run()
    engine.model.decode_plan = plan
    assert all(len(f) == 12 for f in fast)
    assert fast == slow  # the same tokens and the same logprob floats, not merely close ones


def test_models_without_int_activation_linears_keep_the_python_path(make_engine):
    assert make_engine(quantization="int4").model.decode_plan is None
    assert make_engine(quantization="none").model.decode_plan is None


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("arch", list(ISAS), ids=lambda a: " ".join(a))
@pytest.mark.parametrize("bs,d", [(16, 64), (8, 128), (16, 40)])
def test_decode_attention_on_every_instruction_set(arch, bs, d, kv_dtype):
    """The AVX2 build takes 8 keys at a time where head_dim and the block size allow it (the AVX-512
    build 16; test_cpu_ops.py), the portable build one key at a time: each against torch."""
    from test_cpu_ops import check_decode_attention

    needs, _ = ISAS[arch]
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run a {' '.join(arch)} build (lacks {sorted(needs - cpu_flags())})")
    check_decode_attention(_other_isa(arch), bs, d, [1, 13, 100, 16 * bs - 3], kv_dtype)


@pytest.mark.parametrize("arch", list(ISAS), ids=lambda a: " ".join(a))
@pytest.mark.parametrize("group", [3, 7])
def test_decode_attention_gives_a_query_head_its_own_bits_on_every_instruction_set(arch, group):
    from test_cpu_ops import check_heads_alone

    needs, _ = ISAS[arch]
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run a {' '.join(arch)} build (lacks {sorted(needs - cpu_flags())})")
    for d in (64, 128):
        check_heads_alone(_other_isa(arch), group, d, torch.float16)


def float16_edges() -> torch.Tensor:
    """Every rounding case of float32 -> float16: ties to even both ways, the subnormal range and
    its ties, the largest finite half and the first value that rounds to inf, signed zeros, inf."""
    h = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()  # every finite half
    mid = (h[:-1].double() + h[1:].double()) / 2  # exact ties
    x = torch.cat(
        [
            h,
            mid.float(),
            torch.nextafter(mid.float(), torch.tensor(0.0)),
            torch.nextafter(mid.float(), torch.tensor(1e9)),
            torch.tensor([65519.0, 65520.0, 1e6, float("inf"), 2.0**-25, 2.0**-26, 0.0]),
        ]
    )
    return torch.cat([x, -x, torch.randn(4096) * 100])


@pytest.mark.parametrize("arch", [("-march=native",), *ISAS], ids=lambda a: " ".join(a))
def test_float16_kv_store_rounds_like_torch_on_every_instruction_set(arch):
    """The KV cache's float16 store (vcvtps2ph where the build has it, the portable C conversion
    otherwise) gives torch's .half() bits for every finite half, every tie and the overflow edge."""
    needs = ISAS[arch][0] if arch in ISAS else set()
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run a {' '.join(arch)} build (lacks {sorted(needs - cpu_flags())})")
    kernels = ops if arch == ("-march=native",) else _other_isa(arch)
    x = float16_edges()
    assert torch.equal(kernels.to_half(x).view(torch.int16), x.half().view(torch.int16))


AMX = {"amx_tile", "amx_int8"}


@pytest.fixture
def amx():
    if not AMX <= cpu_flags():
        pytest.skip(f"this CPU has no AMX-INT8 tiles (lacks {sorted(AMX - cpu_flags())})")
    if not ops.set_amx(True):
        pytest.skip("Linux did not grant this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    yield
    ops.set_amx(True)


@pytest.mark.parametrize("m", [8, 16, 21, 33, 40])
def test_amx_tiles_give_the_vnni_paths_bits(amx, m):
    """Whole blocks of 16 rows (and a last block of 8 or more) go to the tiles, a shorter tail to
    VNNI; the integer sums are exact and the combine is the same, so the bits must be equal."""
    n, k = 48, 576
    x = activations(m, k)
    table = formats.int8_groups(torch.randn(n, k))[0]
    table.codes[0, :32] = -128
    for digits in (1, 2):
        kernel = a8.Int4A8Kernel(torch.randn(n, k) * 0.05, None, ops, digits)
        head = a8.Int8A8Head(table.codes, table.scale, ops)
        head.digits = digits
        tiles = kernel(x), head(x)
        assert ops.a8_path == "avx512-amx"
        ops.set_amx(False)
        vnni = kernel(x), head(x)
        assert ops.a8_path == "avx512-vnni"
        ops.set_amx(True)
        assert torch.equal(tiles[0], vnni[0]) and torch.equal(tiles[1], vnni[1])


def test_amx_can_be_turned_off_for_a_process(amx):
    code = (
        "import torch; from splitserve.platform.kernels.cpu_ops import cpu_ops; "
        "from splitserve.platform.quant import a8;"
        "ops = cpu_ops(); a8.Int4A8Kernel(torch.randn(32, 64), None, ops, 2)(torch.randn(16, 64)); print(ops.a8_path)"
    )
    paths = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**__import__("os").environ, "SPLITSERVE_AMX": flag},
        ).stdout.strip()
        for flag in ("0", "1")
    ]
    assert paths == ["avx512-vnni", "avx512-amx"]


def test_a_batch_of_17_gives_the_same_tokens_with_and_without_tiles(amx, make_engine):
    """Through the engine on the real SmolLM2 weights: prefill chunks and decode steps of 17 rows take
    the tiles (16 + a 1-row tail on VNNI); the greedy tokens and their logprobs equal the VNNI run's."""
    from splitserve.platform.sampling.params import SamplingParams

    engine = make_engine(quantization="auto")
    prompts = [[(i * 7919 + 13 * r) % 40000 + 100 for i in range(5 + 7 * r)] for r in range(17)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)

    def run():
        engine.pool.reset_prefix_cache()
        ids = [engine.add_request(params=greedy, prompt_token_ids=p) for p in prompts]
        seen = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.req_id] += [(t, lp.logprob) for t, lp in zip(out.new_token_ids, out.new_logprobs or [])]
        return [seen[i] for i in ids]

    tiles = run()
    ops.set_amx(False)
    assert run() == tiles
