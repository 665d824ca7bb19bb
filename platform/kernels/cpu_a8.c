/* splitserve CPU kernels: low-bit weights times int8 activations (the `w4a8` mode's linears and
 * LM head). Built together with cpu_ops.c by cpu_build.py, for the host it runs on.
 *
 *   ss_quantize_a8   x [M, K] float32 -> per row and group of 32 inputs: int8 codes q (absmax / 127
 *                    scale, round to nearest even, never -128), the scale dx, and the sum xs of
 *                    the group's inputs for the weights' minimum term: with two digits the exact
 *                    float sum, with one the sum of the rounded inputs, dx * sum(q) (see below)
 *   ss_q4a8_linear   y[m, n] = sum_g d[n,g] * dx[m,g] * <q4[n,g,:], q[m,g,:]> + mn[n,g] * xs[m,g]
 *   ss_q8a8_linear   y[m, n] = sum_g d[n,g] * dx[m,g] * <q8[n,g,:], q[m,g,:]>   (the LM head's table)
 * Both linears take one or two int8 digits per activation (`digits`, see ss_quantize_a8).
 *
 * Layout: weights are packed in tiles of 16 output rows so that one 512-bit vector holds 4
 * consecutive inputs of each of 16 rows; a dot-product instruction (vpdpbusd, or vpmaddubsw +
 * vpmaddwd on AVX2) against 4 broadcast activation bytes adds 4 products into each row's int32
 * lane. A group's 32 inputs are 8 such steps, and its integer sum is exact. Each output row is one
 * vector lane from the first group to the last: no horizontal sum anywhere, and the weights are
 * unpacked once per group for all the activation rows of a pass.
 *   4-bit tile, per group (256 bytes): byte i*64 + r*4 + c (i < 4, r < 16, c < 4) holds the code of
 *     row r, input 4i + c in its low nibble and input 16 + 4i + c in its high nibble; then d and mn
 *     as float16 [tiles, groups, 16] (GGUF stores them so; float32 would add half the codes' bytes
 *     to every step's read).
 *   8-bit tile, per group (512 bytes): byte j*64 + r*4 + c holds row r, input 4j + c; then d (float16).
 *
 * Why int8 activations: a float32 multiply-add takes one instruction per 16 products and the codes
 * must be widened to float first; an int8 dot product takes one per 64 and widens nothing. This is
 * llama.cpp's arithmetic (its Q8 activations), with a fixed combine order.
 *
 * The minimum term with one digit: a group's weights are d * c + mn with codes c in 0..15, so the
 * kernel's d * dx * <c, q> + mn * xs computes sum(w * x) exactly only if xs is the sum of the inputs
 * q stands for, dx * sum(q), as llama.cpp's Q8_1 blocks keep it. With the exact float sum instead,
 * each input's rounding error is weighted by d * c rather than by the weight d * c + mn: every
 * error counts with the codes' common offset (8 d, about half the group's range), and they no
 * longer cancel. On SmolLM2 that took the top-20 logits 3.5 away from float32 (top-1 changed at 8
 * of 72 positions); with the rounded inputs' sum, 0.92 (3 of 72). Two digits round so finely that
 * the exact sum is kept there (and their bits stay what they were).
 *
 * Batch invariance: a row's activation codes depend on that row only; the integer sums are exact;
 * each output lane then runs the same two fused multiply-adds per group, group after group, on
 * every host and path (AVX-512 VNNI, AVX2, scalar fmaf): the bits of y[m, n] do not depend on M,
 * on the other rows, on the tile a thread takes, or on the instruction set.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define A8_TILE 16
#define A8_ROWS 4 /* activation rows per pass over a tile's weights */
/* A pass's `rows` (1 to A8_ROWS) as a constant: the kernels that keep one sum per row in registers
 * are written for a fixed row count, and this picks the body compiled for it. */
#define ROWS_SWITCH(CALL_D2, CALL_D1) \
    if (digits == 2) switch (rows) { case 1: CALL_D2(1); break; case 2: CALL_D2(2); break; \
                                     case 3: CALL_D2(3); break; case 4: CALL_D2(4); break; } \
    else switch (rows) { case 1: CALL_D1(1); break; case 2: CALL_D1(2); break; \
                         case 3: CALL_D1(3); break; case 4: CALL_D1(4); break; }

static inline int32_t ld4(const int8_t *p) { /* 4 activation codes as one broadcastable word */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

float ss_h2f(uint16_t h); /* cpu_ops.c: IEEE binary16 -> binary32, exact */

static inline float sum32(const float *x) { /* fixed pairwise tree, independent of the vector width */
    float s16[16], s8[8], s4[4];
    for (int i = 0; i < 16; i++) s16[i] = x[i] + x[i + 16];
    for (int i = 0; i < 8; i++) s8[i] = s16[i] + s16[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* One group of 32 inputs. Each step is one IEEE operation whatever the path (the remainder
 * x - v u is one fused multiply-add, the rounding is to nearest even, the sum is sum32's tree), so
 * the scalar, AVX2 and AVX-512 forms give the same codes, units and sums. */
static inline void quantize_group(const float *xg, int8_t *qg, int64_t k, int digits, float *dx, float *xs) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xg[i]));
    float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < 32; i++) {
        float v = nearbyintf(xg[i] * id);
        v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
        qg[i] = (int8_t)v;
        if (digits == 2) {
            float rest = nearbyintf(fmaf(-v, d, xg[i]) * id * 254.f);
            qg[k + i] = (int8_t)(rest > 127.f ? 127.f : (rest < -127.f ? -127.f : rest));
        }
    }
    *dx = digits == 2 ? d / 254.f : d;
    if (digits == 2) {
        *xs = sum32(xg);
    } else {
        int32_t codes = 0;
        for (int i = 0; i < 32; i++) codes += qg[i];
        *xs = d * (float)codes; /* |codes| <= 32 * 127: exact in float, one rounding */
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512i codes16(__m512 x, __m512 id, __m512 *v) { /* round to nearest even, clamp to +-127 */
    const __m512 lim = _mm512_set1_ps(127.f);
    *v = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(x, id), _MM_FROUND_TO_NEAREST_INT |
                                                          _MM_FROUND_NO_EXC), _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
    return _mm512_cvtps_epi32(*v);
}

static inline void quantize_group_v(const float *xg, int8_t *qg, int64_t k, int digits, float *dx, float *xs) {
    __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    __m512 idv = _mm512_set1_ps(id), v0, v1;
    _mm_storeu_si128((__m128i *)qg, _mm512_cvtepi32_epi8(codes16(x0, idv, &v0)));
    _mm_storeu_si128((__m128i *)(qg + 16), _mm512_cvtepi32_epi8(codes16(x1, idv, &v1)));
    if (digits == 2) {
        __m512 dv = _mm512_set1_ps(d), id254 = _mm512_set1_ps(254.f), r0, r1;
        __m512 rest0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_fnmadd_ps(v0, dv, x0), idv), id254);
        __m512 rest1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_fnmadd_ps(v1, dv, x1), idv), id254);
        __m512 one = _mm512_set1_ps(1.f);
        _mm_storeu_si128((__m128i *)(qg + k), _mm512_cvtepi32_epi8(codes16(rest0, one, &r0)));
        _mm_storeu_si128((__m128i *)(qg + k + 16), _mm512_cvtepi32_epi8(codes16(rest1, one, &r1)));
    }
    *dx = digits == 2 ? d / 254.f : d;
    if (digits == 1) { /* the rounded inputs' sum: whole numbers under 2^24, exact in any order */
        *xs = d * (_mm512_reduce_add_ps(_mm512_add_ps(v0, v1)) + 0.f); /* + 0: never -0, as in C */
        return;
    }
    /* sum32's tree: halves of 32, of 16, of 8, of 4, then (0 + 2) + (1 + 3) */
    __m512 s16 = _mm512_add_ps(x0, x1);
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s16), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    *xs = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#define QUANTIZE_GROUP quantize_group_v
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 codes8(__m256 x, __m256 id) { /* round to nearest even, clamp to +-127 */
    const __m256 lim = _mm256_set1_ps(127.f);
    return _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(x, id), _MM_FROUND_TO_NEAREST_INT |
                                                       _MM_FROUND_NO_EXC), _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
}

static inline void store_codes8x4(const __m256 v[4], int8_t *dst) { /* 32 whole floats in +-127 -> int8 */
    __m256i a = _mm256_packs_epi32(_mm256_cvtps_epi32(v[0]), _mm256_cvtps_epi32(v[1]));
    __m256i b = _mm256_packs_epi32(_mm256_cvtps_epi32(v[2]), _mm256_cvtps_epi32(v[3]));
    __m256i c = _mm256_packs_epi16(a, b); /* lanes interleaved per 128 bits: put them back in order */
    c = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)dst, c);
}

static inline void quantize_group_v(const float *xg, int8_t *qg, int64_t k, int digits, float *dx, float *xs) {
    __m256 x[4], v[4], m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int i = 0; i < 4; i++) x[i] = _mm256_loadu_ps(xg + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[i]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    __m256 idv = _mm256_set1_ps(id);
    for (int i = 0; i < 4; i++) v[i] = codes8(x[i], idv);
    store_codes8x4(v, qg);
    if (digits == 2) {
        __m256 dv = _mm256_set1_ps(d), id254 = _mm256_set1_ps(254.f), one = _mm256_set1_ps(1.f), r[4];
        for (int i = 0; i < 4; i++)
            r[i] = codes8(_mm256_mul_ps(_mm256_mul_ps(_mm256_fnmadd_ps(v[i], dv, x[i]), idv), id254), one);
        store_codes8x4(r, qg + k);
    }
    *dx = digits == 2 ? d / 254.f : d;
    if (digits == 1) { /* the rounded inputs' sum: whole numbers under 2^24, exact in any order */
        __m256 c8 = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
        __m128 c4 = _mm_add_ps(_mm256_castps256_ps128(c8), _mm256_extractf128_ps(c8, 1));
        c4 = _mm_add_ps(c4, _mm_movehl_ps(c4, c4));
        *xs = d * (_mm_cvtss_f32(_mm_add_ss(c4, _mm_shuffle_ps(c4, c4, 1))) + 0.f); /* never -0, as in C */
        return;
    }
    __m256 s16[2] = {_mm256_add_ps(x[0], x[2]), _mm256_add_ps(x[1], x[3])}; /* s16[i] = x[i] + x[i + 16] */
    __m256 s8 = _mm256_add_ps(s16[0], s16[1]);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    *xs = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#define QUANTIZE_GROUP quantize_group_v
#else
#define QUANTIZE_GROUP quantize_group
#endif

void ss_quantize_a8(const float *x, int64_t m, int64_t k, int digits, int8_t *q, float *dx, float *xs, int threads) {
    /* digits 1: q = round(x / u), u = absmax / 127. digits 2: a second int8 digit for the remainder,
     * q2 = round((x - u q) / (u / 254)), stored K bytes after the first; the kernels combine the two
     * integer sums as 254 s1 + s2 (exact), so dx holds the unit of the last digit. */
    int64_t groups = k / 32;
#pragma omp parallel for num_threads(threads) if (m * k >= 65536)
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++)
            QUANTIZE_GROUP(x + r * k + g * 32, q + r * k * digits + g * 32, k, digits, dx + r * groups + g,
                           xs + r * groups + g);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* ---- 16 rows per 512-bit vector, vpdpbusd ---------------------------------------------------- */
static inline __m512 ld16h(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* 4-bit weights: a block is `rows` activation rows (a constant once inlined: 1 to A8_ROWS)
 * against one tile. Each unpacked weight vector meets every row and digit as soon as it is made,
 * and each (row, digit) sum is two chains of its own (the low and the high nibbles'), kept in
 * registers and in the order written (IN_ORDER). 3-8 % faster than indexing the rows at run time
 * on a Zen 4 EPYC (bench/kernel_ab.py); the integer sums are exact, so no bit changes. The 8-bit
 * head keeps the run-time form below: the same change made it 15 % slower at one row. */
#define IN_ORDER(v) __asm__("" : "+v"(v))

static inline __attribute__((always_inline)) void q4_block(const uint8_t *w, const uint16_t *d, const uint16_t *mn,
                                                           int64_t groups, const int8_t *xq, const float *dx,
                                                           const float *xs, int64_t k, const int digits,
                                                           const int rows, float *y, int64_t n) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[A8_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i a1[A8_ROWS], b1[A8_ROWS], a2[A8_ROWS], b2[A8_ROWS];
        for (int r = 0; r < rows; r++) a1[r] = b1[r] = a2[r] = b2[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m512i p = _mm512_loadu_si512(w + g * 256 + i * 64);
            __m512i lo = _mm512_and_si512(p, low), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + r * k * digits + g * 32 + 4 * i;
                a1[r] = _mm512_dpbusd_epi32(a1[r], lo, _mm512_set1_epi32(ld4(xr)));
                b1[r] = _mm512_dpbusd_epi32(b1[r], hi, _mm512_set1_epi32(ld4(xr + 16)));
                IN_ORDER(a1[r]);
                IN_ORDER(b1[r]);
                if (digits == 2) {
                    a2[r] = _mm512_dpbusd_epi32(a2[r], lo, _mm512_set1_epi32(ld4(xr + k)));
                    b2[r] = _mm512_dpbusd_epi32(b2[r], hi, _mm512_set1_epi32(ld4(xr + k + 16)));
                    IN_ORDER(a2[r]);
                    IN_ORDER(b2[r]);
                }
            }
        }
        __m512 dv = ld16h(d + g * 16), mv = ld16h(mn + g * 16);
        for (int r = 0; r < rows; r++) {
            __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(a1[r], b1[r]));
            if (digits == 2) /* float(254 s + s2): both sums are exact in float (|.| < 2^24), and the
                              * fused multiply-add rounds their exact combination once */
                s = _mm512_fmadd_ps(s, _mm512_set1_ps(254.f), _mm512_cvtepi32_ps(_mm512_add_epi32(a2[r], b2[r])));
            __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * groups + g]));
            acc[r] = _mm512_fmadd_ps(s, scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n, acc[r]);
}

static inline void q4_tile(const uint8_t *w, const uint16_t *d, const uint16_t *mn, int64_t groups, const int8_t *xq,
                           const float *dx, const float *xs, int64_t k, int digits, int rows, float *y, int64_t n) {
#define Q4_D2(R) q4_block(w, d, mn, groups, xq, dx, xs, k, 2, R, y, n)
#define Q4_D1(R) q4_block(w, d, mn, groups, xq, dx, xs, k, 1, R, y, n)
    ROWS_SWITCH(Q4_D2, Q4_D1)
}

static inline __m512i q8_dot512(const __m512i wq[8], __m512i wsum128, const int8_t *xr) { /* one digit */
    /* vpdpbusd takes unsigned x signed bytes: the activations go in as q + 128 (q ^ 0x80), and
     * 128 * sum(w) comes off again: exact. */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, _mm512_xor_si512(_mm512_set1_epi32(ld4(xr + 4 * j)), flip), wq[j]);
        s1 = _mm512_dpbusd_epi32(s1, _mm512_xor_si512(_mm512_set1_epi32(ld4(xr + 4 * j + 4)), flip), wq[j + 1]);
    }
    return _mm512_sub_epi32(_mm512_add_epi32(s0, s1), wsum128);
}

static inline void q8_tile(const int8_t *w, const uint16_t *d, int64_t groups, const int8_t *xq, const float *dx,
                           int64_t k, int digits, int rows, float *y, int64_t n) {
    __m512 acc[A8_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t g = 0; g < groups; g++) {
        __m512i wq[8], wsum = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            wq[j] = _mm512_loadu_si512(w + g * 512 + j * 64);
            wsum = _mm512_dpbusd_epi32(wsum, ones, wq[j]);
        }
        wsum = _mm512_slli_epi32(wsum, 7);
        __m512 dv = ld16h(d + g * 16);
        for (int r = 0; r < rows; r++) {
            const int8_t *xr = xq + r * k * digits + g * 32;
            __m512 s = _mm512_cvtepi32_ps(q8_dot512(wq, wsum, xr));
            if (digits == 2) /* float(254 s + s2), rounded once (as in q4_tile) */
                s = _mm512_fmadd_ps(s, _mm512_set1_ps(254.f), _mm512_cvtepi32_ps(q8_dot512(wq, wsum, xr + k)));
            __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * groups + g]));
            acc[r] = _mm512_fmadd_ps(s, scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n, acc[r]);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
/* ---- AMX: the same integer group sums from the tile unit, for steps of many rows -------------
 * One tdpbsud (q4: signed activation codes x unsigned 4-bit codes) or tdpbssd (q8) multiplies up
 * to 16 activation rows by a group's 32 inputs of a tile's 16 output rows: A is [rows, 32] bytes
 * read in place (stride K * digits), B is the group's 8 x 64 bytes, which is exactly the tile
 * layout above (row j = inputs 4j..4j+3 of the 16 output rows; the q4 codes are unpacked into it,
 * the q8 table is loaded as it is), and C is [rows, 16] int32 = each activation row's 16 lanes.
 * The sums are exact, so each row's lanes then take the same two fused multiply-adds per group in
 * the same order as the VNNI path: bit for bit the same y, whichever path a step of M rows takes.
 * Linux grants the tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM); where it
 * refuses, or SPLITSERVE_AMX=0 (ss_a8_set_amx(0)), the VNNI path runs. */
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROWS 16
#define AMX_MIN_ROWS 8 /* fewer rows in a block: the VNNI path is as fast (bench/amx_kernels.py) */
static int amx_state = -1; /* -1 not asked yet, 0 off, 1 granted */

static int amx_on(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_state;
}

int ss_a8_set_amx(int enable) {
    amx_state = enable ? -1 : 0;
    return enable ? amx_on() : 0;
}

static int64_t amx_rows(int64_t m) { /* the rows the tiles take: blocks of 16, and a last one of 8 or more */
    return m % AMX_ROWS >= AMX_MIN_ROWS ? m : m - m % AMX_ROWS;
}

struct amx_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static void amx_configure(int rows) { /* C1 C2 | A1 A2 | B: tiles 0 1 | 2 3 | 4 */
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = t < 2 ? 64 : 32;
    c.rows[4] = 8, c.colsb[4] = 64;
    _tile_loadconfig(&c);
}

static inline void q4_unpack_group(const uint8_t *wg, uint8_t *wb) { /* one group's codes in the B layout */
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < 4; i++) {
        __m512i p = _mm512_loadu_si512(wg + i * 64);
        _mm512_store_si512(wb + i * 64, _mm512_and_si512(p, low));
        _mm512_store_si512(wb + (i + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(p, 4), low));
    }
}

/* One tile of 16 output rows for `rows` activation rows, software-pipelined so that neither unit
 * waits on the other's memory: in step g the vector unit unpacks group g + 1's q4 codes, the tile
 * unit sums group g (B from the buffer written a step earlier, or straight from the q8 table) into
 * one half of c, and the vector unit combines group g - 1 from the other half. `mn` NULL: the q8
 * table (signed codes, no minimum). */
static inline __attribute__((always_inline)) void amx_tile_rows(
        const uint8_t *w, const uint16_t *d, const uint16_t *mn, int64_t groups, const int8_t *xq, const float *dx,
        const float *xs, int64_t k, int digits, int rows, float *y, int64_t n) {
    __attribute__((aligned(64))) uint8_t wb[2][512];
    __attribute__((aligned(64))) int32_t c[2][2][AMX_ROWS * 16];
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    if (mn) q4_unpack_group(w, wb[0]);
    for (int64_t g = 0; g <= groups; g++) {
        if (g < groups) {
            if (mn && g + 1 < groups) q4_unpack_group(w + (g + 1) * 256, wb[(g + 1) & 1]);
            _tile_loadd(4, mn ? wb[g & 1] : w + g * 512, 64);
            _tile_loadd(2, xq + g * 32, k * digits);
            _tile_zero(0);
            if (mn) _tile_dpbsud(0, 2, 4);
            else _tile_dpbssd(0, 2, 4);
            _tile_stored(0, c[g & 1][0], 64);
            if (digits == 2) {
                _tile_loadd(3, xq + k + g * 32, k * 2);
                _tile_zero(1);
                if (mn) _tile_dpbsud(1, 3, 4);
                else _tile_dpbssd(1, 3, 4);
                _tile_stored(1, c[g & 1][1], 64);
            }
        }
        if (g == 0) continue;
        int64_t h = g - 1;
        const int32_t *c1 = c[h & 1][0], *c2 = c[h & 1][1];
        __m512 dv = ld16h(d + h * 16), mv = mn ? ld16h(mn + h * 16) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(c1 + r * 16));
            if (digits == 2) /* float(254 s + s2): one rounding of the exact value, as the VNNI path's
                              * integer form; three vector-port operations instead of five */
                s = _mm512_fmadd_ps(s, _mm512_set1_ps(254.f), _mm512_cvtepi32_ps(_mm512_load_si512(c2 + r * 16)));
            __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * groups + h]));
            acc[r] = _mm512_fmadd_ps(s, scale, acc[r]);
            if (mn) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * groups + h]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n, acc[r]);
}

static void amx_tile(const uint8_t *w, const uint16_t *d, const uint16_t *mn, int64_t groups, const int8_t *xq,
                     const float *dx, const float *xs, int64_t k, int digits, int rows, float *y, int64_t n) {
    if (rows == AMX_ROWS && digits == 2 && mn) amx_tile_rows(w, d, mn, groups, xq, dx, xs, k, 2, AMX_ROWS, y, n);
    else if (rows == AMX_ROWS && digits == 2) amx_tile_rows(w, d, NULL, groups, xq, dx, xs, k, 2, AMX_ROWS, y, n);
    else amx_tile_rows(w, d, mn, groups, xq, dx, xs, k, digits, rows, y, n);
}

/* Row blocks outside, tiles inside: a thread configures its tiles once per block of 16 rows, and
 * a layer's packed weights (well under L2) are read from memory once, from cache after. */
static void a8_amx(int q8, const int8_t *xq, const float *dx, const float *xs, int64_t m, int64_t k, int digits,
                   const uint8_t *w, const uint16_t *d, const uint16_t *mn, int64_t n, float *y, int threads) {
    int64_t groups = k / 32, tiles = n / A8_TILE, tile_bytes = groups * (q8 ? 512 : 256);
#pragma omp parallel num_threads(threads) if (n * k * m >= 32768)
    {
        for (int64_t r0 = 0; r0 < m; r0 += AMX_ROWS) {
            int rows = m - r0 < AMX_ROWS ? (int)(m - r0) : AMX_ROWS;
            amx_configure(rows);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles; t++)
                amx_tile(w + t * tile_bytes, d + t * groups * 16, q8 ? NULL : mn + t * groups * 16, groups,
                         xq + r0 * k * digits, dx + r0 * groups, q8 ? NULL : xs + r0 * groups, k, digits, rows,
                         y + r0 * n + t * A8_TILE, n);
        }
        _tile_release();
    }
}
#define A8_AMX 1
#endif
#define A8_PATH "avx512-vnni"

#elif defined(__AVX2__) && defined(__FMA__)
/* ---- 8 rows per 256-bit vector: a tile is two halves ----------------------------------------- */
static inline __m256 ld8h(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i times254(__m256i s) { return _mm256_sub_epi32(_mm256_slli_epi32(s, 8), _mm256_slli_epi32(s, 1)); }

#if defined(__AVXVNNI__)
static inline __m256i dot4_u8s8(__m256i acc, __m256i u, __m256i s) {
    /* 4 products of u8 (<= 15, or |w| <= 128 with the sign moved onto s) and s8 per int32 lane */
    return _mm256_dpbusd_avx_epi32(acc, u, s);
}

static inline __m256i q4_dot256(const __m256i wq[8], const int8_t *xr) { /* one group, one digit */
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        s0 = dot4_u8s8(s0, wq[j], _mm256_set1_epi32(ld4(xr + 4 * j)));
        s1 = dot4_u8s8(s1, wq[j + 1], _mm256_set1_epi32(ld4(xr + 4 * j + 4)));
    }
    return _mm256_add_epi32(s0, s1);
}

static inline void q4_tile(const uint8_t *w, const uint16_t *d, const uint16_t *mn, int64_t groups, const int8_t *xq,
                           const float *dx, const float *xs, int64_t k, int digits, int rows, float *y, int64_t n) {
    for (int h = 0; h < 2; h++) {
        __m256 acc[A8_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int64_t g = 0; g < groups; g++) {
            __m256i wq[8];
            for (int i = 0; i < 4; i++) {
                __m256i p = _mm256_loadu_si256((const __m256i *)(w + g * 256 + i * 64 + h * 32));
                wq[i] = _mm256_and_si256(p, low);
                wq[i + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
            }
            __m256 dv = ld8h(d + g * 16 + h * 8), mv = ld8h(mn + g * 16 + h * 8);
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + r * k * digits + g * 32;
                __m256i s = q4_dot256(wq, xr);
                if (digits == 2) s = _mm256_add_epi32(times254(s), q4_dot256(wq, xr + k));
                __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * groups + g]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
                acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * groups + g]), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + r * n + h * 8, acc[r]);
    }
}

static inline __m256i q8_dot256(const __m256i wq[8], const __m256i wa[8], const int8_t *xr) { /* one digit */
    /* signed x signed: |w| as the unsigned operand and w's sign moved onto the activations */
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        s0 = dot4_u8s8(s0, wa[j], _mm256_sign_epi8(_mm256_set1_epi32(ld4(xr + 4 * j)), wq[j]));
        s1 = dot4_u8s8(s1, wa[j + 1], _mm256_sign_epi8(_mm256_set1_epi32(ld4(xr + 4 * j + 4)), wq[j + 1]));
    }
    return _mm256_add_epi32(s0, s1);
}

static inline void q8_tile(const int8_t *w, const uint16_t *d, int64_t groups, const int8_t *xq, const float *dx,
                           int64_t k, int digits, int rows, float *y, int64_t n) {
    for (int h = 0; h < 2; h++) {
        __m256 acc[A8_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m256i wq[8], wa[8];
            for (int j = 0; j < 8; j++) {
                wq[j] = _mm256_loadu_si256((const __m256i *)(w + g * 512 + j * 64 + h * 32));
                wa[j] = _mm256_abs_epi8(wq[j]);
            }
            __m256 dv = ld8h(d + g * 16 + h * 8);
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + r * k * digits + g * 32;
                __m256i s = q8_dot256(wq, wa, xr);
                if (digits == 2) s = _mm256_add_epi32(times254(s), q8_dot256(wq, wa, xr + k));
                __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * groups + g]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + r * n + h * 8, acc[r]);
    }
}

#else
/* Without VNNI a product of two bytes takes vpmaddubsw (pairs of products, summed into int16),
 * and the kernels are written so that gcc keeps every sum in a register. A block is `rows`
 * activation rows (a constant once inlined: 1 to A8_ROWS) against one half of a tile (8 output
 * rows): each weight vector, unpacked or loaded once, meets every row and digit as soon as it is
 * made, and each (row, digit) sum is its own chain. Holding a group's 8 weight vectors while
 * indexing the rows at run time (the AVX-VNNI form above) spilled the sums to the stack on AVX2;
 * this form is 1.4-1.5x faster for 2 to 32 rows and gives the same integers, so the same bits.
 * IN_ORDER keeps each chain in the order written: gcc otherwise reassociated the integer sums
 * into a tree built after all the products, a register per product, and spilled them again. */
#define IN_ORDER(v) __asm__("" : "+x"(v))

static inline __attribute__((always_inline)) void q4_half(const uint8_t *w, const uint16_t *d, const uint16_t *mn,
                                                          int64_t groups, const int8_t *xq, const float *dx,
                                                          const float *xs, int64_t k, const int digits,
                                                          const int rows, float *y, int64_t n, int h) {
    /* a group's 8 pairs of products (<= 2 * 15 * 127 each) add up in int16 exactly (<= 30480);
     * one vpmaddwd per digit widens them, the first digit's times 254: 254 s1 + s2 */
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi16(1), unit = _mm256_set1_epi16(254);
    __m256 acc[A8_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i s1[A8_ROWS], s2[A8_ROWS];
        for (int r = 0; r < rows; r++) s1[r] = s2[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(w + g * 256 + i * 64 + h * 32));
            __m256i lo = _mm256_and_si256(p, low), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + r * k * digits + g * 32 + 4 * i;
                s1[r] = _mm256_add_epi16(s1[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(ld4(xr))));
                s1[r] = _mm256_add_epi16(s1[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ld4(xr + 16))));
                IN_ORDER(s1[r]);
                if (digits == 2) {
                    s2[r] = _mm256_add_epi16(s2[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(ld4(xr + k))));
                    s2[r] = _mm256_add_epi16(s2[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ld4(xr + k + 16))));
                    IN_ORDER(s2[r]);
                }
            }
        }
        __m256 dv = ld8h(d + g * 16 + h * 8), mv = ld8h(mn + g * 16 + h * 8);
        for (int r = 0; r < rows; r++) {
            __m256i s = digits == 2 ? _mm256_add_epi32(_mm256_madd_epi16(s1[r], unit), _mm256_madd_epi16(s2[r], one))
                                    : _mm256_madd_epi16(s1[r], one);
            __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * groups + g]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
            acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * groups + g]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + r * n + h * 8, acc[r]);
}

static inline __attribute__((always_inline)) void q8_half(const int8_t *w, const uint16_t *d, int64_t groups,
                                                          const int8_t *xq, const float *dx, int64_t k,
                                                          const int digits, const int rows, float *y, int64_t n,
                                                          int h) {
    /* signed x signed: |w| as the unsigned operand and w's sign moved onto the activations; a pair
     * of products reaches 2 * 128 * 127, so each pair is widened (vpmaddwd) before it is added */
    const __m256i one = _mm256_set1_epi16(1);
    __m256 acc[A8_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i s1[A8_ROWS], s2[A8_ROWS];
        for (int r = 0; r < rows; r++) s1[r] = s2[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i wq = _mm256_loadu_si256((const __m256i *)(w + g * 512 + j * 64 + h * 32)), wa = _mm256_abs_epi8(wq);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + r * k * digits + g * 32 + 4 * j;
                s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                    wa, _mm256_sign_epi8(_mm256_set1_epi32(ld4(xr)), wq)), one));
                IN_ORDER(s1[r]);
                if (digits == 2) {
                    s2[r] = _mm256_add_epi32(s2[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                        wa, _mm256_sign_epi8(_mm256_set1_epi32(ld4(xr + k)), wq)), one));
                    IN_ORDER(s2[r]);
                }
            }
        }
        __m256 dv = ld8h(d + g * 16 + h * 8);
        for (int r = 0; r < rows; r++) {
            __m256i s = digits == 2 ? _mm256_add_epi32(times254(s1[r]), s2[r]) : s1[r];
            __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * groups + g]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + r * n + h * 8, acc[r]);
}

/* the tile functions of the other paths: both halves of a tile, in blocks of a constant number of rows */
static inline void q4_tile(const uint8_t *w, const uint16_t *d, const uint16_t *mn, int64_t groups, const int8_t *xq,
                           const float *dx, const float *xs, int64_t k, int digits, int rows, float *y, int64_t n) {
#define Q4_D2(R) for (int h = 0; h < 2; h++) q4_half(w, d, mn, groups, xq, dx, xs, k, 2, R, y, n, h)
#define Q4_D1(R) for (int h = 0; h < 2; h++) q4_half(w, d, mn, groups, xq, dx, xs, k, 1, R, y, n, h)
    ROWS_SWITCH(Q4_D2, Q4_D1)
}

static inline void q8_tile(const int8_t *w, const uint16_t *d, int64_t groups, const int8_t *xq, const float *dx,
                           int64_t k, int digits, int rows, float *y, int64_t n) {
#define Q8_D2(R) for (int h = 0; h < 2; h++) q8_half(w, d, groups, xq, dx, k, 2, R, y, n, h)
#define Q8_D1(R) for (int h = 0; h < 2; h++) q8_half(w, d, groups, xq, dx, k, 1, R, y, n, h)
    ROWS_SWITCH(Q8_D2, Q8_D1)
}
#endif
#define A8_PATH "avx2"

#else
/* ---- portable C: the same integer sums and the same two fused multiply-adds per group -------- */
static inline int32_t q4_dot_lane(const uint8_t *wg, int lane, const int8_t *xg) {
    int32_t s = 0;
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) {
            uint8_t b = wg[i * 64 + lane * 4 + c];
            s += (b & 0x0F) * xg[4 * i + c] + (b >> 4) * xg[16 + 4 * i + c];
        }
    return s;
}

static inline void q4_tile(const uint8_t *w, const uint16_t *d, const uint16_t *mn, int64_t groups, const int8_t *xq,
                           const float *dx, const float *xs, int64_t k, int digits, int rows, float *y, int64_t n) {
    for (int r = 0; r < rows; r++)
        for (int lane = 0; lane < A8_TILE; lane++) {
            float acc = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                const int8_t *xg = xq + r * k * digits + g * 32;
                int32_t s = q4_dot_lane(w + g * 256, lane, xg);
                if (digits == 2) s = 254 * s + q4_dot_lane(w + g * 256, lane, xg + k);
                acc = fmaf((float)s, ss_h2f(d[g * 16 + lane]) * dx[r * groups + g], acc);
                acc = fmaf(ss_h2f(mn[g * 16 + lane]), xs[r * groups + g], acc);
            }
            y[r * n + lane] = acc;
        }
}

static inline int32_t q8_dot_lane(const int8_t *wg, int lane, const int8_t *xg) {
    int32_t s = 0;
    for (int j = 0; j < 8; j++)
        for (int c = 0; c < 4; c++) s += wg[j * 64 + lane * 4 + c] * xg[4 * j + c];
    return s;
}

static inline void q8_tile(const int8_t *w, const uint16_t *d, int64_t groups, const int8_t *xq, const float *dx,
                           int64_t k, int digits, int rows, float *y, int64_t n) {
    for (int r = 0; r < rows; r++)
        for (int lane = 0; lane < A8_TILE; lane++) {
            float acc = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                const int8_t *xg = xq + r * k * digits + g * 32;
                int32_t s = q8_dot_lane(w + g * 512, lane, xg);
                if (digits == 2) s = 254 * s + q8_dot_lane(w + g * 512, lane, xg + k);
                acc = fmaf((float)s, ss_h2f(d[g * 16 + lane]) * dx[r * groups + g], acc);
            }
            y[r * n + lane] = acc;
        }
}
#define A8_PATH "portable"
#endif

#ifndef A8_AMX
int ss_a8_set_amx(int enable) { (void)enable; return 0; } /* built without AMX: nothing to switch */
#endif

/* The path a step of many rows takes here: "avx512-amx" where the tiles are granted, else A8_PATH. */
const char *ss_a8_path(void) {
#ifdef A8_AMX
    if (amx_state == 1) return "avx512-amx";
#endif
    return A8_PATH;
}

/* Threads split the tiles; each tile's packed weights (K / 2 or K bytes per row) stay in cache
 * while every pass of A8_ROWS activation rows goes over them. */
void ss_q4a8_linear(const int8_t *xq, const float *dx, const float *xs, int64_t m, int64_t k, int digits,
                    const uint8_t *w, const uint16_t *d, const uint16_t *mn, int64_t n, float *y, int threads) {
#ifdef A8_AMX
    int64_t m_amx = amx_rows(m);
    if (m_amx && amx_on()) { /* the tile unit takes whole blocks, the VNNI path a short tail */
        a8_amx(0, xq, dx, xs, m_amx, k, digits, w, d, mn, n, y, threads);
        xq += m_amx * k * digits, dx += m_amx * (k / 32), xs += m_amx * (k / 32), y += m_amx * n, m -= m_amx;
    }
#endif
    int64_t groups = k / 32, tiles = n / A8_TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k * m >= 32768)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t r0 = 0; r0 < m; r0 += A8_ROWS) {
            int rows = m - r0 < A8_ROWS ? (int)(m - r0) : A8_ROWS;
            if (digits == 2)
                q4_tile(w + t * groups * 256, d + t * groups * 16, mn + t * groups * 16, groups, xq + r0 * k * 2,
                        dx + r0 * groups, xs + r0 * groups, k, 2, rows, y + r0 * n + t * A8_TILE, n);
            else
                q4_tile(w + t * groups * 256, d + t * groups * 16, mn + t * groups * 16, groups, xq + r0 * k,
                        dx + r0 * groups, xs + r0 * groups, k, 1, rows, y + r0 * n + t * A8_TILE, n);
        }
}

void ss_q8a8_linear(const int8_t *xq, const float *dx, int64_t m, int64_t k, int digits, const int8_t *w,
                    const uint16_t *d, int64_t n, float *y, int threads) {
#ifdef A8_AMX
    int64_t m_amx = amx_rows(m);
    if (m_amx && amx_on()) {
        a8_amx(1, xq, dx, NULL, m_amx, k, digits, (const uint8_t *)w, d, NULL, n, y, threads);
        xq += m_amx * k * digits, dx += m_amx * (k / 32), y += m_amx * n, m -= m_amx;
    }
#endif
    int64_t groups = k / 32, tiles = n / A8_TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k * m >= 32768)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t r0 = 0; r0 < m; r0 += A8_ROWS) {
            int rows = m - r0 < A8_ROWS ? (int)(m - r0) : A8_ROWS;
            if (digits == 2)
                q8_tile(w + t * groups * 512, d + t * groups * 16, groups, xq + r0 * k * 2, dx + r0 * groups, k, 2,
                        rows, y + r0 * n + t * A8_TILE, n);
            else
                q8_tile(w + t * groups * 512, d + t * groups * 16, groups, xq + r0 * k, dx + r0 * groups, k, 1, rows,
                        y + r0 * n + t * A8_TILE, n);
        }
}
