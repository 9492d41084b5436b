/* One decode token of a Llama-family model (or one each of several sequences: decode_batch) in
 * one call: every layer's norm, fused q/k/v product,
 * q/k norm, rotary, KV write, attention, o product, norm, gate/up product, silu * up, down
 * product, residual adds; then the final norm and the logits. Float32 throughout, the same
 * arithmetic as the torch layers (up to the order of float32 additions); products through
 * qmatvec (quantized or F32 rows). The KV cache is float32 or float16 (model_t.kv_half: keys
 * and values rounded to nearest-even as they are written, as torch's copy into a float16 cache
 * rounds them). Driven by redlite/layers/cpu_decode.py. */
#include <math.h>
#include <stdlib.h>

#include "gguf_blocks.h"

typedef struct { const part_t *parts; int32_t n_parts; int32_t rows; const float *bias; } mat_t;

typedef struct {
    mat_t qkv, o, gate_up, down;
    const float *attn_norm, *ffn_norm, *qk_norm; /* qk_norm: [H + KV, D] or NULL */
    int64_t window;                              /* 0: full attention */
} layer_t;

typedef struct {
    int32_t n_layers, hidden, inter, n_heads, n_kv, head_dim, rot_dim, vocab;
    float eps, qk_eps;
    int32_t acts;             /* activations of quantized products: 0 float32 (qmatvec), 1 8-bit
                                 (qmatmul_q8x), 2 16-bit (qmatvec_q16x) */
    int32_t kv_half;          /* the KV caches hold IEEE float16 values (else float32) */
    const layer_t *layers;
    const float *final_norm;
    mat_t lm_head;
    const part_t *embed;      /* rows of the embedding table */
    const float *cos, *sin;   /* [positions, rot_dim]: cos, and sin with its first half negated */
} model_t;

static void rms_norm(const float *x, const float *w, int n, float eps, float *y) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

void qmatmul_q8x(const part_t *parts, int n_parts, const float *x, int n_tok, int n, float *out, int64_t ldo);
void qmatvec_q16x(const part_t *parts, int n_parts, const float *x, int n_tok, int n, float *out, int64_t ldo);

/* y[t] = W x[t] (+ bias) for n_tok rows; each row computed exactly as alone (the kernels
 * treat rows independently); acts: see model_t */
static void product(const mat_t *m, const float *x, int n_tok, int n, float *y, int acts) {
    for (int p = 0; p < m->n_parts && acts; p++) acts = m->parts[p].fmt != F32 ? acts : 0;
    if (acts == 1) qmatmul_q8x(m->parts, m->n_parts, x, n_tok, n, y, m->rows);
    else if (acts == 2) qmatvec_q16x(m->parts, m->n_parts, x, n_tok, n, y, m->rows);
    else qmatvec(m->parts, m->n_parts, x, n_tok, n, y, m->rows, 0);
    if (m->bias)
        for (int t = 0; t < n_tok; t++)
            for (int i = 0; i < m->rows; i++) y[(int64_t)t * m->rows + i] += m->bias[i];
}

static void rotate(float *x, const float *cos, const float *sin, int rot) {
    int half = rot / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

void decode_attention(const float *qkv, int qkv_rows, void *const *kv, const int64_t *max_tokens,
                      const int64_t *lo, const int64_t *pos, int n_tok, int h, int g, int d, int half,
                      float *out);

/* d values of src into a cache row dst: copied (float32), or rounded to float16 */
static void write_row(void *dst, const float *src, int d, int half) {
    if (!half) {
        memcpy(dst, src, sizeof(float) * d);
        return;
    }
    uint16_t *out = (uint16_t *)dst;
    int i = 0;
    for (; i + 8 <= d; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < d; i++) out[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

/* q/k norm, rotary and the KV write of each sequence's token, then attention of all heads of
 * all sequences on the pool (decode_attention.c); kv[t]: layer's cache of sequence t [2, KV, max_tokens[t], D] */
static void attention(const model_t *m, const layer_t *l, int n_tok, float *qkv, const int64_t *pos,
                      void *const *kv, const int64_t *max_tokens, int64_t *lo, float *out) {
    int h = m->n_heads, g = m->n_kv, d = m->head_dim, rows = (h + 2 * g) * d;
    int64_t size = m->kv_half ? 2 : 4;
    for (int t = 0; t < n_tok; t++) {
        float *q = qkv + (int64_t)t * rows;
        char *cache = (char *)kv[t];
        const float *cos = m->cos + pos[t] * m->rot_dim, *sin = m->sin + pos[t] * m->rot_dim;
        for (int i = 0; i < h + g; i++) {
            float *head = q + i * d;
            if (l->qk_norm) rms_norm(head, l->qk_norm + i * d, d, m->qk_eps, head);
            rotate(head, cos, sin, m->rot_dim);
        }
        for (int i = 0; i < g; i++) {  /* k, v of this token into the cache at pos */
            write_row(cache + (i * max_tokens[t] + pos[t]) * d * size, q + (h + i) * d, d, m->kv_half);
            write_row(cache + ((g + i) * max_tokens[t] + pos[t]) * d * size, q + (h + g + i) * d, d, m->kv_half);
        }
        lo[t] = l->window > 0 && pos[t] + 1 > l->window ? pos[t] + 1 - l->window : 0;
    }
    decode_attention(qkv, rows, kv, max_tokens, lo, pos, n_tok, h, g, d, m->kv_half, out);
}

/* Feed tokens[t] at position pos[t] of sequence t, for n_tok distinct sequences at once: the
 * products take all rows in one pass over the weights; every row is computed exactly as
 * decode_step computes it alone. kv[t]: sequence t's cache [layers, 2, KV, max_tokens[t], D];
 * logits: [n_tok, vocab]. */
void decode_batch(const model_t *m, int n_tok, const int64_t *tokens, const int64_t *pos, void *const *kv,
                  const int64_t *max_tokens, float *logits) {
    int hid = m->hidden, qkv_rows = (m->n_heads + 2 * m->n_kv) * m->head_dim, att = m->n_heads * m->head_dim;
    int64_t *lo = (int64_t *)malloc(sizeof(int64_t) * n_tok);
    size_t row = 3 * (size_t)hid + qkv_rows + att + 3 * (size_t)m->inter;
    float *x = (float *)malloc(sizeof(float) * row * n_tok);
    float *xn = x + (size_t)hid * n_tok, *tmp = xn + (size_t)hid * n_tok, *qkv = tmp + (size_t)hid * n_tok;
    float *ao = qkv + (size_t)qkv_rows * n_tok, *gu = ao + (size_t)att * n_tok;
    float *act = gu + 2 * (size_t)m->inter * n_tok;
    void **layer_kv = (void **)malloc(sizeof(void *) * n_tok);
    int64_t size = m->kv_half ? 2 : 4;
    const part_t *e = m->embed;
    if (e->fmt == F32)
        for (int t = 0; t < n_tok; t++) memcpy(x + (size_t)t * hid, e->data + tokens[t] * e->row_bytes, sizeof(float) * hid);
    else {
        extern void dequant_rows(const part_t *, const int64_t *, int64_t, int, float *);
        dequant_rows(e, tokens, n_tok, hid, x);
    }
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *l = m->layers + i;
        for (int t = 0; t < n_tok; t++) {
            rms_norm(x + (size_t)t * hid, l->attn_norm, hid, m->eps, xn + (size_t)t * hid);
            layer_kv[t] = (char *)kv[t] + i * 2 * (int64_t)m->n_kv * max_tokens[t] * m->head_dim * size;
        }
        product(&l->qkv, xn, n_tok, hid, qkv, m->acts);
        attention(m, l, n_tok, qkv, pos, layer_kv, max_tokens, lo, ao);
        product(&l->o, ao, n_tok, att, tmp, m->acts);
        for (size_t j = 0; j < (size_t)hid * n_tok; j++) x[j] += tmp[j];
        for (int t = 0; t < n_tok; t++) rms_norm(x + (size_t)t * hid, l->ffn_norm, hid, m->eps, xn + (size_t)t * hid);
        product(&l->gate_up, xn, n_tok, hid, gu, m->acts);
        for (int t = 0; t < n_tok; t++) {
            const float *g = gu + (size_t)t * 2 * m->inter;
            float *a = act + (size_t)t * m->inter;
            for (int j = 0; j < m->inter; j++) a[j] = g[j] / (1.f + expf(-g[j])) * g[m->inter + j];
        }
        product(&l->down, act, n_tok, m->inter, tmp, m->acts);
        for (size_t j = 0; j < (size_t)hid * n_tok; j++) x[j] += tmp[j];
    }
    for (int t = 0; t < n_tok; t++) rms_norm(x + (size_t)t * hid, m->final_norm, hid, m->eps, xn + (size_t)t * hid);
    product(&m->lm_head, xn, n_tok, hid, logits, m->acts);
    free(layer_kv);
    free(x);
    free(lo);
}

/* Feed `token` at position `pos`; kv: the cache [layers, 2, KV, max_tokens, D]; logits: [vocab]. */
void decode_step(const model_t *m, int64_t token, int64_t pos, void *kv, int64_t max_tokens, float *logits) {
    decode_batch(m, 1, &token, &pos, &kv, &max_tokens, logits);
}
