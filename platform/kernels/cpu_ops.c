/* splitserve CPU kernels: the small ops of a transformer step, fused (float32 only).
 *
 * Built by cpu_build.py at first use with -O3 -march=native for the host it runs on (the build
 * is cached per source hash and CPU flags), loaded with ctypes and called from cpu_ops.py, which
 * keeps a pure-torch path for every op. Plain C over raw pointers; threads are OpenMP over
 * independent rows.
 *
 *   ss_rms_norm         out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w
 *   ss_add_rms_norm     res[t] += x[t]; out[t] = rms_norm(res[t])        (residual add fused)
 *   ss_rope_write_kv    rotate q and k of a fused qkv row in place (rotate-half layout, cos/sin
 *                       read from the model's tables by position) and store k, v in their slots
 *                       (a float32 cache, or float16 with `kv16`: rounded to nearest even)
 *   ss_decode_attention one query token per sequence against its paged K/V, read in place
 *                       (16 keys at a time on AVX-512, 8 on AVX2, one at a time otherwise)
 *                       through the block table (no gather, no copy); GQA by query groups per KV
 *                       head; scores, softmax and sums in float32 from a float32 or float16 cache
 *   ss_store_half       float32 -> float16, round to nearest even (F16C / AVX-512, else ss_f2h)
 *   ss_silu_mul         out[t] = silu(gate[t]) * up[t] for a fused gate|up row
 *   ss_q4_linear        int4 weights (per-group scale and minimum) times float32 activations
 *   ss_q4_dequant       the float32 weights of the same, for a GEMM over many rows (prefill)
 *
 * Batch invariance: every sum runs in an order fixed by the source (LANES partial sums combined
 * in a fixed tree), never by the vector width, the alignment or the thread count, so a row gets
 * the same bits whatever else is in the batch. No -ffast-math: the compiler may not reassociate.
 * exp is our own (exp2 split + degree-6 polynomial, max relative error ~2e-7), so it vectorizes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define LANES 16

/* IEEE binary16 <-> binary32 in plain C, for the portable paths (and cpu_a8.c): exact one way,
 * round to nearest even the other, the bits vcvtps2ph gives for every finite input. */
float ss_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) man <<= 1, exp--;
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t ss_f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00 | (uint16_t)((ax >> 13) & 0x1FF); /* NaN stays a (quiet) NaN */
    if (ax >= 0x477FF000u) return sign | 0x7C00;          /* >= 65520 (and inf) rounds to inf */
    if (ax < 0x38800000u) {                                /* below 2^-14: a subnormal half, or zero */
        if (ax < 0x33000000u) return sign;                 /* below 2^-25 */
        uint32_t shift = 126 - (ax >> 23), m = (ax & 0x7FFFFF) | 0x800000;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        return sign | (uint16_t)(r + (rem > half || (rem == half && (r & 1))));
    }
    uint32_t r = (ax - 0x38000000u) >> 13, rem = ax & 0x1FFF; /* rebias 127 -> 15; a carry rounds up the exponent */
    return sign | (uint16_t)(r + (rem > 0x1000 || (rem == 0x1000 && (r & 1))));
}

void ss_store_half(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = ss_f2h(src[i]);
}

static inline float sum_lanes(const float *p) {
    float s8[8];
    for (int i = 0; i < 8; i++) s8[i] = p[i] + p[i + 8];
    float s4[4];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    /* one 16-lane FMA chain and one reduction: a horizontal sum per dot product is what decode
     * attention pays for every key, so it must not go through memory */
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    float s = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
#else
    float acc[LANES] = {0};
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = sum_lanes(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float sum_squares(const float *a, int64_t n) { return dot(a, a, n); }

/* exp(x) for x <= 0 (softmax) and moderate |x| (silu): 2^n * p(f), f in [-0.5, 0.5]. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f;
    float n = nearbyintf(t);
    float f = (t - n) * 0.693147180559945309f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666671633720f + f * (0.0416664853692055f
              + f * (0.00833336077630519f + f * 0.00139053508546203f)))));
    union { float f; int32_t i; } u = {p};
    u.i += (int32_t)n << 23;
    return u.f;
}

static inline void norm_row(const float *x, const float *w, float *out, int64_t h, float eps) {
    float inv = 1.0f / sqrtf(sum_squares(x, h) / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = x[i] * inv * w[i];
}

void ss_rms_norm(const float *x, const float *w, float *out, int64_t t, int64_t h, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (t >= 64)
    for (int64_t r = 0; r < t; r++) norm_row(x + r * h, w, out + r * h, h, eps);
}

void ss_add_rms_norm(const float *x, float *res, const float *w, float *out, int64_t t, int64_t h, float eps,
                     int threads) {
#pragma omp parallel for num_threads(threads) if (t >= 64)
    for (int64_t r = 0; r < t; r++) {
        float *rr = res + r * h;
        const float *xr = x + r * h;
        for (int64_t i = 0; i < h; i++) rr[i] += xr[i];
        norm_row(rr, w, out + r * h, h, eps);
    }
}

static inline void rotate(float *v, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

void ss_rope_write_kv(float *qkv, const int64_t *positions, const float *cos_cache, const float *sin_cache,
                      void *k_cache, void *v_cache, const int64_t *slots, int64_t t, int64_t nh, int64_t nkv,
                      int64_t d, int kv16, int threads) {
    int64_t row = (nh + 2 * nkv) * d, kv = nkv * d;
#pragma omp parallel for num_threads(threads) if (t >= 64)
    for (int64_t r = 0; r < t; r++) {
        float *q = qkv + r * row;
        const float *cos = cos_cache + positions[r] * d, *sin = sin_cache + positions[r] * d;
        for (int64_t hh = 0; hh < nh + nkv; hh++) rotate(q + hh * d, cos, sin, d);
        if (kv16) {
            ss_store_half(q + nh * d, (uint16_t *)k_cache + slots[r] * kv, kv);
            ss_store_half(q + (nh + nkv) * d, (uint16_t *)v_cache + slots[r] * kv, kv);
        } else {
            memcpy((float *)k_cache + slots[r] * kv, q + nh * d, sizeof(float) * kv);
            memcpy((float *)v_cache + slots[r] * kv, q + (nh + nkv) * d, sizeof(float) * kv);
        }
    }
}

/* The cache's row at element offset `off` as float32: in place for a float32 cache, converted
 * into `tmp` for a float16 one (the portable path; the vector paths convert in registers). */
static inline const float *kv_row(const void *cache, int64_t off, int64_t n, int kv16, float *tmp) {
    if (!kv16) return (const float *)cache + off;
    for (int64_t i = 0; i < n; i++) tmp[i] = ss_h2f(((const uint16_t *)cache)[off + i]);
    return tmp;
}

/* One (sequence, KV head): its `group` query heads against ctx keys, two passes over the blocks. */
static void attend_group(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,
                         int64_t ctx, float *out, int64_t group, int64_t nkv, int64_t g, int64_t d,
                         int64_t block_size, float scale, float *scores, int kv16) {
    int64_t kv = nkv * d;
    float tmp[kv16 ? d : 1];
    /* block by block: a position's slot is its block's id * block_size + its offset (no division) */
    for (int64_t first = 0; first < ctx; first += block_size) {
        int64_t kb = table[first / block_size] * block_size * kv + g * d;
        int64_t n = ctx - first < block_size ? ctx - first : block_size;
        for (int64_t o = 0; o < n; o++) {
            const float *key = kv_row(k_cache, kb + o * kv, d, kv16, tmp);
            for (int64_t j = 0; j < group; j++) scores[j * ctx + first + o] = dot(q + j * d, key, d) * scale;
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float *sj = scores + j * ctx;
        float m = -INFINITY;
        for (int64_t p = 0; p < ctx; p++) m = sj[p] > m ? sj[p] : m;
        for (int64_t p = 0; p < ctx; p++) sj[p] = fast_exp(sj[p] - m);
        float acc[LANES] = {0};
        int64_t p = 0;
        for (; p + LANES <= ctx; p += LANES)
            for (int i = 0; i < LANES; i++) acc[i] += sj[p + i];
        float l = sum_lanes(acc);
        for (; p < ctx; p++) l += sj[p];
        float inv = 1.0f / l;
        for (int64_t q2 = 0; q2 < ctx; q2++) sj[q2] *= inv;
    }
    for (int64_t j = 0; j < group; j++) memset(out + j * d, 0, sizeof(float) * d);
    for (int64_t first = 0; first < ctx; first += block_size) {
        int64_t vb = table[first / block_size] * block_size * kv + g * d;
        int64_t n = ctx - first < block_size ? ctx - first : block_size;
        for (int64_t o = 0; o < n; o++) {
            const float *vp = kv_row(v_cache, vb + o * kv, d, kv16, tmp);
            for (int64_t j = 0; j < group; j++) {
                float w = scores[j * ctx + first + o], *out_j = out + j * d;
                for (int64_t i = 0; i < d; i++) out_j[i] += w * vp[i];
            }
        }
    }
}

#if defined(__AVX512F__)
/* The same attention with 16 keys at a time: each query head's 16 dot products are summed by one
 * transpose-and-add tree (45 instructions for 16 keys instead of a horizontal sum per key), the
 * softmax runs on whole vectors, and the weighted sum of V keeps its accumulators in registers.
 * Taken when head_dim is a multiple of 16 (<= 256) and a KV block holds a multiple of 16 keys. */
static inline __m512 sum16x16(__m512 v[16]) { /* lane i = the sum of v[i]'s 16 lanes */
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

static inline __m512 exp16(__m512 x) { /* fast_exp on 16 lanes: 2^n * p(f) */
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(x, _mm512_set1_ps(88.0f)));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(0.00139053508546203f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00833336077630519f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0416664853692055f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.166666671633720f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 ld16kv(const void *cache, int64_t off, int kv16) { /* 16 cache values as float32 */
    return kv16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + off)))
                : _mm512_loadu_ps((const float *)cache + off);
}

/* `heads` query heads of one KV head's group (a constant once inlined) in three passes: scores,
 * softmax, weighted sum of V. Each K and V row is loaded and widened once for all of them, and
 * each head's numbers come from the same fused multiply-adds in the same order as one head alone:
 * a query's bits do not depend on how its group is split. */
static inline __attribute__((always_inline)) void attend_heads16(
        const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t ctx, float *out,
        const int64_t heads, int64_t nkv, int64_t g, const int64_t d, int64_t block_size, float scale, float *scores,
        int kv16) {
    int64_t kv = nkv * d, chunks = d / 16;
    for (int64_t p = 0; p < ctx; p += 16) {
        int64_t kb = (table[p / block_size] * block_size + p % block_size) * kv + g * d;
        int64_t n = ctx - p < 16 ? ctx - p : 16;
        __m512 acc[4][16]; /* fixed sizes: a variable-length array stays in memory */
        for (int64_t o = 0; o < 16; o++) {
            __m512 kx[16];
            for (int64_t c = 0; c < chunks; c++)
                kx[c] = o < n ? ld16kv(k_cache, kb + o * kv + c * 16, kv16) : _mm512_setzero_ps();
            for (int64_t j = 0; j < heads; j++) {
                __m512 a = _mm512_setzero_ps();
                if (o < n)
                    for (int64_t c = 0; c < chunks; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + c * 16), kx[c], a);
                acc[j][o] = a;
            }
        }
        __mmask16 valid = (__mmask16)((1u << n) - 1);
        for (int64_t j = 0; j < heads; j++)
            _mm512_mask_storeu_ps(scores + j * ctx + p, valid, _mm512_mul_ps(sum16x16(acc[j]), _mm512_set1_ps(scale)));
    }
    float inv[4];
    for (int64_t j = 0; j < heads; j++) {
        float *sj = scores + j * ctx;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t p = 0; p < ctx; p += 16) {
            __mmask16 valid = (__mmask16)((1u << (ctx - p < 16 ? ctx - p : 16)) - 1);
            mx = _mm512_mask_max_ps(mx, valid, mx, _mm512_maskz_loadu_ps(valid, sj + p));
        }
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < ctx; p += 16) {
            __mmask16 valid = (__mmask16)((1u << (ctx - p < 16 ? ctx - p : 16)) - 1);
            __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sj + p), m)));
            _mm512_mask_storeu_ps(sj + p, valid, e);
            sum = _mm512_add_ps(sum, e);
        }
        float lanes[16];
        _mm512_storeu_ps(lanes, sum);
        inv[j] = 1.0f / sum_lanes(lanes);
    }
    __m512 o_acc[4][16];
    for (int64_t j = 0; j < heads; j++)
        for (int64_t c = 0; c < chunks; c++) o_acc[j][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < ctx; p += 16) {
        int64_t vb = (table[p / block_size] * block_size + p % block_size) * kv + g * d;
        int64_t n = ctx - p < 16 ? ctx - p : 16;
        for (int64_t o = 0; o < n; o++) {
            __m512 vx[16];
            for (int64_t c = 0; c < chunks; c++) vx[c] = ld16kv(v_cache, vb + o * kv + c * 16, kv16);
            for (int64_t j = 0; j < heads; j++) {
                __m512 w = _mm512_set1_ps(scores[j * ctx + p + o]);
                for (int64_t c = 0; c < chunks; c++) o_acc[j][c] = _mm512_fmadd_ps(w, vx[c], o_acc[j][c]);
            }
        }
    }
    for (int64_t j = 0; j < heads; j++)
        for (int64_t c = 0; c < chunks; c++)
            _mm512_storeu_ps(out + j * d + c * 16, _mm512_mul_ps(o_acc[j][c], _mm512_set1_ps(inv[j])));
}

/* A KV head's whole group, `most` query heads at a time (as many as keep their V sums in 16
 * registers: 4 for head_dim 64, 2 for 128), the last sub-group with what is left. */
#define HEADS_CASE(D, H) case H: attend_heads16(q + j0 * D, k_cache, v_cache, table, ctx, out + j0 * D, H, nkv, g, D, \
                                                block_size, scale, scores + j0 * ctx, kv16); break;
static inline __attribute__((always_inline)) void attend_group16(
        const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t ctx, float *out,
        int64_t group, int64_t nkv, int64_t g, int64_t d, int64_t block_size, float scale, float *scores, int kv16) {
    int64_t most = d == 64 ? 4 : d == 128 ? 2 : 1;
    for (int64_t j0 = 0; j0 < group; j0 += most) {
        int64_t h = group - j0 < most ? group - j0 : most;
        if (d == 64) switch (h) { HEADS_CASE(64, 1) HEADS_CASE(64, 2) HEADS_CASE(64, 3) HEADS_CASE(64, 4) }
        else if (d == 128) switch (h) { HEADS_CASE(128, 1) HEADS_CASE(128, 2) }
        else switch (h) { HEADS_CASE(d, 1) }
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The AVX2 form of attend_group16: 8 keys at a time, the same three passes. */
static inline __m256 sum8x8(__m256 v[8]) { /* lane i = the sum of v[i]'s 8 lanes */
    __m256 a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);          /* per 128: v0 pairs, v1 pairs */
    for (int i = 0; i < 2; i++) b[i] = _mm256_hadd_ps(a[2 * i], a[2 * i + 1]);
    /* b[0] = [k0 k1 k2 k3 | k0 k1 k2 k3] halves (low/high 128 partials), b[1] the same for k4..k7 */
    __m256 lo = _mm256_permute2f128_ps(b[0], b[1], 0x20), hi = _mm256_permute2f128_ps(b[0], b[1], 0x31);
    return _mm256_add_ps(lo, hi);
}

static inline __m256 exp8(__m256 x) { /* fast_exp on 8 lanes */
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(x, _mm256_set1_ps(88.0f)));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
    __m256 p = _mm256_set1_ps(0.00139053508546203f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00833336077630519f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.0416664853692055f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.166666671633720f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

static inline __m256i mask8(int64_t n) { /* the first n of 8 lanes */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __m256 ld8kv(const void *cache, int64_t off, int kv16) { /* 8 cache values as float32 */
    return kv16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + off)))
                : _mm256_loadu_ps((const float *)cache + off);
}

static inline __attribute__((always_inline)) void attend_group8(
        const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t ctx, float *out,
        int64_t group, int64_t nkv, int64_t g, const int64_t d, int64_t block_size, float scale, float *scores, int kv16) {
    int64_t kv = nkv * d, chunks = d / 8;
    for (int64_t j = 0; j < group; j++) {
        const float *qj = q + j * d;
        float *sj = scores + j * ctx;
        for (int64_t p = 0; p < ctx; p += 8) {
            int64_t kb = (table[p / block_size] * block_size + p % block_size) * kv + g * d;
            int64_t n = ctx - p < 8 ? ctx - p : 8;
            __m256 acc[8];
            for (int64_t o = 0; o < 8; o++) {
                acc[o] = _mm256_setzero_ps();
                if (o < n)
                    for (int64_t c = 0; c < chunks; c++)
                        acc[o] = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c * 8), ld8kv(k_cache, kb + o * kv + c * 8, kv16),
                                                 acc[o]);
            }
            _mm256_maskstore_ps(sj + p, mask8(n), _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
        }
        float m = -INFINITY;
        for (int64_t p = 0; p < ctx; p++) m = sj[p] > m ? sj[p] : m;
        __m256 mv = _mm256_set1_ps(m), sum = _mm256_setzero_ps();
        for (int64_t p = 0; p < ctx; p += 8) {
            __m256i valid = mask8(ctx - p);
            __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(sj + p, valid), mv)), _mm256_castsi256_ps(valid));
            _mm256_maskstore_ps(sj + p, valid, e);
            sum = _mm256_add_ps(sum, e);
        }
        float lanes[16] = {0};
        _mm256_storeu_ps(lanes, sum);
        __m256 inv = _mm256_set1_ps(1.0f / sum_lanes(lanes));
        __m256 o_acc[32];
        for (int64_t c = 0; c < chunks; c++) o_acc[c] = _mm256_setzero_ps();
        for (int64_t p = 0; p < ctx; p += 8) {
            int64_t vb = (table[p / block_size] * block_size + p % block_size) * kv + g * d;
            int64_t n = ctx - p < 8 ? ctx - p : 8;
            for (int64_t o = 0; o < n; o++) {
                __m256 w = _mm256_set1_ps(sj[p + o]);
                for (int64_t c = 0; c < chunks; c++)
                    o_acc[c] = _mm256_fmadd_ps(w, ld8kv(v_cache, vb + o * kv + c * 8, kv16), o_acc[c]);
            }
        }
        for (int64_t c = 0; c < chunks; c++) _mm256_storeu_ps(out + j * d + c * 8, _mm256_mul_ps(o_acc[c], inv));
    }
}
#endif

/* One (sequence, KV head) through the widest path this build and shape allow; `kv16` is a constant
 * at each call below, so each path is compiled once per cache type. */
static inline __attribute__((always_inline)) void attend(
        const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t ctx, float *out,
        int64_t group, int64_t nkv, int64_t g, int64_t d, int64_t block_size, float scale, float *scores, int kv16) {
#if defined(__AVX512F__)
    if (d % 16 == 0 && d <= 256 && block_size % 16 == 0) {
        /* it takes the common head sizes as constants itself */
        attend_group16(q, k_cache, v_cache, table, ctx, out, group, nkv, g, d, block_size, scale, scores, kv16);
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (d % 8 == 0 && d <= 256 && block_size % 8 == 0) {
        /* the common head sizes as constants: every loop over a row unrolled, its sums in registers
         * (a run-time d kept the 8 keys' sums and the output row on the stack: 1.5-2.3x slower) */
        if (d == 64) attend_group8(q, k_cache, v_cache, table, ctx, out, group, nkv, g, 64, block_size, scale, scores, kv16);
        else if (d == 128) attend_group8(q, k_cache, v_cache, table, ctx, out, group, nkv, g, 128, block_size, scale, scores, kv16);
        else attend_group8(q, k_cache, v_cache, table, ctx, out, group, nkv, g, d, block_size, scale, scores, kv16);
        return;
    }
#endif
    attend_group(q, k_cache, v_cache, table, ctx, out, group, nkv, g, d, block_size, scale, scores, kv16);
}

void ss_decode_attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
                         const int64_t *context_lens, float *out, int64_t b, int64_t nh, int64_t nkv, int64_t d,
                         int64_t block_size, int64_t max_blocks, float scale, int kv16, int threads) {
    int64_t group = nh / nkv, max_ctx = 0;
    for (int64_t s = 0; s < b; s++) max_ctx = context_lens[s] > max_ctx ? context_lens[s] : max_ctx;
#pragma omp parallel num_threads(threads) if (b * nkv * max_ctx >= 4096)
    {
        float *scores = malloc(sizeof(float) * group * (max_ctx > 0 ? max_ctx : 1));
        /* dynamic: prefill rows (one per prompt token) have contexts of every length */
#pragma omp for collapse(2) schedule(dynamic, 4)
        for (int64_t s = 0; s < b; s++)
            for (int64_t g = 0; g < nkv; g++) {
                const float *qs = q + (s * nh + g * group) * d;
                float *os = out + (s * nh + g * group) * d;
                if (kv16)
                    attend(qs, k_cache, v_cache, block_table + s * max_blocks, context_lens[s], os, group, nkv, g, d,
                           block_size, scale, scores, 1);
                else
                    attend(qs, k_cache, v_cache, block_table + s * max_blocks, context_lens[s], os, group, nkv, g, d,
                           block_size, scale, scores, 0);
            }
        free(scores);
    }
}

void ss_silu_mul(const float *gate_up, float *out, int64_t t, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) if (t >= 64)
    for (int64_t r = 0; r < t; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
    }
}

/* ---- int4 weights, float32 math --------------------------------------------------------------
 *
 *   ss_q4_linear   y[m, n] = sum_g <d[n,g] * q[n,g,:] + mn[n,g], x[m,g,:]>
 *   ss_q4_dequant  w[n, :] = d * q + mn, for a GEMM when a step carries many rows (prefill)
 *
 * Weights: per row n and group g of 32 inputs, 16 bytes of 4-bit codes q in 0..15 in GGUF's order
 * (byte j holds element j in its low nibble, element j + 16 in its high one), a scale d and a
 * minimum mn: w = d * q + mn (Q4_1 exactly; Q4_0 is mn = -8 d). The codes are widened to float32
 * in registers and the products summed in float32: the activations are never rounded, so the
 * numbers are those of the float32 model on these weights (llama.cpp rounds activations to int8,
 * torch's packed kernel to bfloat16). Rows of x are taken Q4_ROWS at a time per unpacked group.
 *
 * Invariance: each y[m, n] is built by the same instructions in the same order (group after
 * group, fixed lanes, one final reduction) whichever block or thread computes it, so a row's
 * result does not depend on how many rows the call has.
 */
#if defined(__AVX512F__)
#define Q4_ROWS 8 /* 16 accumulators + 2 weight vectors of the 32 zmm registers */
#else
#define Q4_ROWS 4 /* 8 accumulators + 4 weight vectors of the 16 ymm registers */
#endif
#define Q4_PREFETCH 8

/* Rows r of x against one weight row. Per group g the codes are widened and turned into the
 * float32 weights once, w = d * q + mn (one FMA per lane), then every row does two FMAs per 16
 * (AVX-512) or four per 8 (AVX2) lanes: the fewest a float32 multiply-add can take. Low and high
 * halves of a group accumulate apart and meet in one fixed reduction at the end. */
static void q4_rows(const uint8_t *qs, const float *d, const float *mn, int64_t groups, const float *x, int64_t k,
                    int rows, float *y, int64_t ystride) {
#if defined(__AVX512F__)
    __m512 acc[Q4_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        __m128i b = _mm_loadu_si128((const __m128i *)(qs + g * 16));
        __m512 scale = _mm512_set1_ps(d[g]), low = _mm512_set1_ps(mn[g]);
        __m512 wlo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))), scale, low);
        __m512 whi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask))),
                                     scale, low);
        for (int r = 0; r < rows; r++) {
            const float *xg = x + r * k + g * 32;
            acc[r][0] = _mm512_fmadd_ps(wlo, _mm512_loadu_ps(xg), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(whi, _mm512_loadu_ps(xg + 16), acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) y[r * ystride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[Q4_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        __m128i b = _mm_loadu_si128((const __m128i *)(qs + g * 16));
        __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        __m256 scale = _mm256_set1_ps(d[g]), low = _mm256_set1_ps(mn[g]);
        __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), scale, low);
        __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), scale, low);
        __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), scale, low);
        __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), scale, low);
        for (int r = 0; r < rows; r++) {
            const float *xg = x + r * k + g * 32;
            acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), acc[r][1]);
            acc[r][0] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m256 a = _mm256_add_ps(acc[r][0], acc[r][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        y[r * ystride] = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
    }
#else
    for (int r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * k + g * 32;
            for (int j = 0; j < 16; j++) acc += ((float)(qs[g * 16 + j] & 0x0F) * d[g] + mn[g]) * xg[j];
            for (int j = 0; j < 16; j++) acc += ((float)(qs[g * 16 + j] >> 4) * d[g] + mn[g]) * xg[j + 16];
        }
        y[r * ystride] = acc;
    }
#endif
}

void ss_q4_linear(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *d, const float *mn,
                  int64_t n, float *y, int threads) {
    int64_t groups = k / 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k * m >= 32768)
    for (int64_t row = 0; row < n; row++) {
        /* the weights stream from memory once per call: ask for a row a few rows ahead */
        if (row + Q4_PREFETCH < n) {
            const char *next = (const char *)(qs + (row + Q4_PREFETCH) * groups * 16);
            for (int64_t b = 0; b < groups * 16; b += 64) __builtin_prefetch(next + b);
            for (int64_t b = 0; b < groups * 4; b += 64) {
                __builtin_prefetch((const char *)(d + (row + Q4_PREFETCH) * groups) + b);
                __builtin_prefetch((const char *)(mn + (row + Q4_PREFETCH) * groups) + b);
            }
        }
        for (int64_t r0 = 0; r0 < m; r0 += Q4_ROWS) {
            int rows = m - r0 < Q4_ROWS ? (int)(m - r0) : Q4_ROWS;
            q4_rows(qs + row * groups * 16, d + row * groups, mn + row * groups, groups, x + r0 * k, k, rows,
                    y + r0 * n + row, n);
        }
    }
}

void ss_q4_dequant(const uint8_t *qs, const float *d, const float *mn, int64_t n, int64_t k, float *w, int threads) {
    int64_t groups = k / 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= 65536)
    for (int64_t row = 0; row < n; row++)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *q = qs + (row * groups + g) * 16;
            float *o = w + row * k + g * 32, s = d[row * groups + g], b = mn[row * groups + g];
            for (int j = 0; j < 16; j++) {
                o[j] = s * (float)(q[j] & 0x0F) + b;
                o[j + 16] = s * (float)(q[j] >> 4) + b;
            }
        }
}

/* ---- float32 GEMM in a fixed order (LoRA's shrink and expand) --------------------------------
 *
 *   ss_gemm_fixed   y[m, n] (+)= sum_k x[m, k] * w[k, n]      (w row-major [K, N])
 *
 * Every output is one chain of fused multiply-adds over k = 0, 1, ..., K-1 from zero (a vector
 * lane or, past the last whole vector, fmaf: both round once per step), then one add into y when
 * accumulating. Its bits therefore depend on its own row of x and its own column of w only: not
 * on M (a BLAS picks other kernels and blockings by shape: a mixed-adapter step then gave a
 * request other tokens than it got alone on an AVX2 host), not on N, not on the thread. A column
 * of w that meets exact zeros in x (a mixed step's masked-out adapter columns) gets the same
 * value as without them: fma(0, w, acc) is acc. */
#define GF_ROWS 4

#if defined(__AVX2__) && defined(__FMA__)
/* `vecs` whole 8-lane vectors of columns; always inlined with a constant, so the accumulators
 * stay in registers */
static inline __attribute__((always_inline)) void gemm_fixed_vecs(const float *x, int64_t ldx, int64_t k, int rows,
                                                                  const float *w, int64_t n, float *y, int64_t ldy,
                                                                  int accumulate, int vecs) {
    __m256 acc[GF_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++)
        for (int v = 0; v < vecs; v++) {
            __m256 wv = _mm256_loadu_ps(w + i * n + 8 * v);
            for (int r = 0; r < rows; r++) acc[r][v] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + i]), wv, acc[r][v]);
        }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) {
            float *yr = y + r * ldy + 8 * v;
            _mm256_storeu_ps(yr, accumulate ? _mm256_add_ps(_mm256_loadu_ps(yr), acc[r][v]) : acc[r][v]);
        }
}
#endif

static void gemm_fixed_tile(const float *x, int64_t ldx, int64_t k, int rows, const float *w, int64_t n, int64_t width,
                            float *y, int64_t ldy, int accumulate) {
    int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (width >= 16)
        gemm_fixed_vecs(x, ldx, k, rows, w, n, y, ldy, accumulate, 2), c = 16;
    else if (width >= 8)
        gemm_fixed_vecs(x, ldx, k, rows, w, n, y, ldy, accumulate, 1), c = 8;
#endif
    for (; c < width; c++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) acc = fmaf(x[r * ldx + i], w[i * n + c], acc);
            y[r * ldy + c] = accumulate ? y[r * ldy + c] + acc : acc;
        }
}

/* x rows `ldx` floats apart, y rows `ldy` apart (a slice of a wider matrix); w [k, n] dense */
static void gemm_fixed_ld(const float *x, int64_t ldx, int64_t m, int64_t k, const float *w, int64_t n, float *y,
                          int64_t ldy, int accumulate, int threads) {
    int64_t tiles = (n + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k * n >= 262144)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t c0 = t * 16, width = n - c0 < 16 ? n - c0 : 16;
        for (int64_t r0 = 0; r0 < m; r0 += GF_ROWS) {
            int rows = m - r0 < GF_ROWS ? (int)(m - r0) : GF_ROWS;
            gemm_fixed_tile(x + r0 * ldx, ldx, k, rows, w + c0, n, width, y + r0 * ldy + c0, ldy, accumulate);
        }
    }
}

void ss_gemm_fixed(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *y, int accumulate,
                   int threads) {
    gemm_fixed_ld(x, k, m, k, w, n, y, n, accumulate, threads);
}

/*   ss_lora_delta   y[m, n] += scale-folded LoRA deltas of a step's adapters, each on its own rows
 *
 * lin[g] is adapter g's part of this linear (platform/lora/adapter.py LoraLinear; `a` NULL: it
 * leaves the linear alone): h = x @ A_T [rows, S*r], then shard s adds h[:, s*r:(s+1)*r] @ B_s^T
 * into its own output columns start_s.. (no zero blocks between shards are read or multiplied).
 * row_group[r] is row r's adapter (-1: the base model). Each adapter's rows are gathered and go
 * through the fixed-order GEMM, so a row's delta is computed from its own row and its own
 * adapter only: the same bits alone, beside base rows or beside other adapters, and no
 * adapter's columns are computed for another adapter's rows (the masked form, every adapter on
 * every row, costs the number of adapters in the step times as much).
 * Returns 0, or -1 when the scratch could not be allocated. */
#define SS_LORA_SHARDS 3
typedef struct ss_lora {
    const float *a;                  /* A_T [k, width], width = shards * rank */
    int64_t width, rank, shards;
    const float *b[SS_LORA_SHARDS];  /* shard s: (scale B_s)^T [rank, size[s]], row-major */
    int64_t start[SS_LORA_SHARDS], size[SS_LORA_SHARDS];
} ss_lora;

/* adapter l's delta on its `count` rows (`rows`, in order), added into y. All rows of the call:
 * x and y are used as they are. Else the rows are gathered into xg, shrunk into h, each shard
 * expanded into yg and added into y: the one add the accumulating GEMM makes, so the same bits.
 * Scratch: xg [count, k], h [count, width], yg [count, n]. */
static void lora_group(const float *x, int64_t m, int64_t k, const ss_lora *l, const int64_t *rows, int64_t count,
                       int64_t n, float *y, float *xg, float *h, float *yg, int threads) {
    int whole = count == m;
    if (!whole)
        for (int64_t i = 0; i < count; i++) memcpy(xg + i * k, x + rows[i] * k, sizeof(float) * k);
    ss_gemm_fixed(whole ? x : xg, count, k, l->a, l->width, h, 0, threads);
    for (int64_t s = 0; s < l->shards; s++) {
        int64_t c0 = l->start[s], c1 = l->start[s] + l->size[s];
        gemm_fixed_ld(h + s * l->rank, l->width, count, l->rank, l->b[s], l->size[s], (whole ? y : yg) + c0, n, whole,
                      threads);
        if (!whole)
            for (int64_t i = 0; i < count; i++) {
                float *yr = y + rows[i] * n;
                const float *d = yg + i * n;
                for (int64_t c = c0; c < c1; c++) yr[c] += d[c];
            }
    }
}

int ss_lora_delta(const float *x, int64_t m, int64_t k, const ss_lora *lin, int64_t groups, const int64_t *row_group,
                  int64_t n, float *y, int threads) {
    int64_t width = 0;
    for (int64_t g = 0; g < groups; g++)
        if (lin[g].a && lin[g].width > width) width = lin[g].width;
    if (!width) return 0;
    /* several adapters: they run side by side on the threads, each on its own rows of y with its
     * own scratch and one thread (a row's bits are the same); one adapter: its GEMMs take them */
    int ok = 1, split = groups > 1 && m > 1, inner = split ? 1 : threads;
#pragma omp parallel num_threads(threads) if (split)
    {
        int64_t *rows = malloc(sizeof(int64_t) * m);
        float *xg = malloc(sizeof(float) * m * k), *h = malloc(sizeof(float) * m * width);
        float *yg = malloc(sizeof(float) * m * n);
        int mine = rows && xg && h && yg;
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < groups; g++) {
            if (!lin[g].a || !mine) continue;
            int64_t count = 0;
            for (int64_t r = 0; r < m; r++)
                if (row_group[r] == g) rows[count++] = r;
            if (count) lora_group(x, m, k, lin + g, rows, count, n, y, xg, h, yg, inner);
        }
        if (!mine) {
#pragma omp atomic write
            ok = 0;
        }
        free(rows), free(xg), free(h), free(yg);
    }
    return ok ? 0 : -1;
}
