/* splitserve CPU kernels: a whole decode step's layers in one call (w4a8 / w4a16 models).
 *
 *   ss_decode_layers   every decoder layer for B sequences of one new token each: the same kernels
 *                      the Python path calls (cpu_ops.c, cpu_a8.c), in the same order, on the same
 *                      buffers' values, so the bits are those of LlamaForCausalLM._forward_fused;
 *                      what goes away is ~15 Python-level calls per layer (about 3 ms of a 15 ms
 *                      single-stream step on one core).
 *
 * Per layer: qkv = W_qkv h (+ bias) -> rotate q, k and store k, v in their slots -> attention over
 * each sequence's paged context -> o = W_o attn -> h = norm(residual += o) -> gate|up = W_gu h ->
 * silu(gate) * up -> down = W_d act -> h = norm(residual += down) with the next layer's (or the
 * final) norm. `residual` enters as the embeddings and leaves as the residual stream; `out` gets h.
 *
 * LoRA (platform/lora/batch.py): where the step has adapters, each linear's output then gets its
 * adapters' deltas from ss_lora_delta (cpu_ops.c), the call LoraContext.add_delta makes on the
 * Python path, after the bias as there: the same bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void ss_rms_norm(const float *x, const float *w, float *out, int64_t t, int64_t h, float eps, int threads);
void ss_add_rms_norm(const float *x, float *res, const float *w, float *out, int64_t t, int64_t h, float eps,
                     int threads);
void ss_rope_write_kv(float *qkv, const int64_t *positions, const float *cos_cache, const float *sin_cache,
                      void *k_cache, void *v_cache, const int64_t *slots, int64_t t, int64_t nh, int64_t nkv,
                      int64_t d, int kv16, int threads);
void ss_decode_attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
                         const int64_t *context_lens, float *out, int64_t b, int64_t nh, int64_t nkv, int64_t d,
                         int64_t block_size, int64_t max_blocks, float scale, int kv16, int threads);
void ss_silu_mul(const float *gate_up, float *out, int64_t t, int64_t inter, int threads);
void ss_quantize_a8(const float *x, int64_t m, int64_t k, int digits, int8_t *q, float *dx, float *xs, int threads);
void ss_q4a8_linear(const int8_t *xq, const float *dx, const float *xs, int64_t m, int64_t k, int digits,
                    const uint8_t *w, const uint16_t *d, const uint16_t *mn, int64_t n, float *y, int threads);

typedef struct { /* one packed linear (quant/a8.py); bias NULL when the layer has none */
    const uint8_t *w;
    const uint16_t *d, *mn; /* float16 */
    const float *bias;
} ss_linear;

typedef struct {
    const float *input_norm, *post_norm;
    ss_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* float32, or float16 when dims.kv16 */
} ss_layer;

typedef struct ss_lora ss_lora; /* cpu_ops.c */
int ss_lora_delta(const float *x, int64_t m, int64_t k, const ss_lora *lin, int64_t groups, const int64_t *row_group,
                  int64_t n, float *y, int threads);

typedef struct {                   /* a step's adapters (NULL: it has none) */
    const ss_lora *const *linears; /* [layer][qkv, o, gate_up, down] -> [group] entries; NULL: no adapter's */
    int64_t groups;
    const int64_t *row_group;      /* [b]: each row's adapter group, -1 for the base model */
} ss_lora_step;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, max_blocks;
    float eps, scale;
    int digits, threads, kv16;
} ss_dims;

typedef struct { /* scratch for one call */
    int8_t *xq;
    float *dx, *xs;
} a8_buf;

/* returns 0, or -1 when the LoRA scratch could not be allocated */
static int linear(const ss_linear *l, const ss_lora *lora, const ss_lora_step *step, const float *x, int64_t b,
                  int64_t k, int64_t n, float *y, a8_buf *buf, const ss_dims *dm) {
    ss_quantize_a8(x, b, k, dm->digits, buf->xq, buf->dx, buf->xs, dm->threads);
    ss_q4a8_linear(buf->xq, buf->dx, buf->xs, b, k, dm->digits, l->w, l->d, l->mn, n, y, dm->threads);
    if (l->bias)
        for (int64_t r = 0; r < b; r++)
            for (int64_t i = 0; i < n; i++) y[r * n + i] += l->bias[i];
    return lora ? ss_lora_delta(x, b, k, lora, step->groups, step->row_group, n, y, dm->threads) : 0;
}

int ss_decode_layers(const ss_layer *layers, int64_t num_layers, const float *final_norm, const ss_dims *dm,
                     int64_t b, float *residual, float *out, const int64_t *positions, const float *cos_cache,
                     const float *sin_cache, const int64_t *slots, const int64_t *block_table,
                     const int64_t *context_lens, const ss_lora_step *lora) {
    int64_t hd = dm->hidden, nh = dm->num_heads, nkv = dm->num_kv_heads, d = dm->head_dim, inter = dm->intermediate;
    int64_t q_size = nh * d, qkv_size = (nh + 2 * nkv) * d, widest = inter > hd ? inter : hd;
    float *qkv = malloc(sizeof(float) * b * qkv_size), *q = malloc(sizeof(float) * b * q_size);
    float *attn = malloc(sizeof(float) * b * q_size), *o = malloc(sizeof(float) * b * hd);
    float *gu = malloc(sizeof(float) * b * 2 * inter), *act = malloc(sizeof(float) * b * inter);
    a8_buf buf = {malloc((size_t)(b * widest * dm->digits)), malloc(sizeof(float) * b * (widest / 32)),
                  malloc(sizeof(float) * b * (widest / 32))};
    int ok = qkv && q && attn && o && gu && act && buf.xq && buf.dx && buf.xs;
    if (ok) {
        ss_rms_norm(residual, layers[0].input_norm, out, b, hd, dm->eps, dm->threads);
        for (int64_t i = 0; i < num_layers && ok; i++) {
            const ss_layer *l = layers + i;
            const ss_lora *const *ll = lora ? lora->linears + i * 4 : NULL;
            if (linear(&l->qkv, ll ? ll[0] : NULL, lora, out, b, hd, qkv_size, qkv, &buf, dm)) ok = 0;
            ss_rope_write_kv(qkv, positions, cos_cache, sin_cache, l->k_cache, l->v_cache, slots, b, nh, nkv, d,
                             dm->kv16, dm->threads);
            for (int64_t r = 0; r < b; r++) memcpy(q + r * q_size, qkv + r * qkv_size, sizeof(float) * q_size);
            ss_decode_attention(q, l->k_cache, l->v_cache, block_table, context_lens, attn, b, nh, nkv, d,
                                dm->block_size, dm->max_blocks, dm->scale, dm->kv16, dm->threads);
            if (linear(&l->o, ll ? ll[1] : NULL, lora, attn, b, q_size, hd, o, &buf, dm)) ok = 0;
            ss_add_rms_norm(o, residual, l->post_norm, out, b, hd, dm->eps, dm->threads);
            if (linear(&l->gate_up, ll ? ll[2] : NULL, lora, out, b, hd, 2 * inter, gu, &buf, dm)) ok = 0;
            ss_silu_mul(gu, act, b, inter, dm->threads);
            if (linear(&l->down, ll ? ll[3] : NULL, lora, act, b, inter, hd, o, &buf, dm)) ok = 0;
            ss_add_rms_norm(o, residual, i + 1 < num_layers ? layers[i + 1].input_norm : final_norm, out, b, hd,
                            dm->eps, dm->threads);
        }
    }
    free(qkv), free(q), free(attn), free(o), free(gu), free(act), free(buf.xq), free(buf.dx), free(buf.xs);
    return ok ? 0 : -1;
}
