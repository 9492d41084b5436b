/* One decode token of a Llama-family model in one call: every layer's norm, fused q/k/v product,
 * q/k norm, rotary, KV write, attention, o product, norm, gate/up product, silu * up, down
 * product, residual adds; then the final norm and the logits. Float32 throughout, the same
 * arithmetic as the torch layers (up to the order of float32 additions); products through
 * qmatvec (quantized or F32 rows). Driven by redlite/layers/cpu_decode.py. */
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
    int32_t q8, pad;          /* q8: 8-bit activations for quantized products (qmatmul_q8x) */
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

static void product(const mat_t *m, const float *x, int n, float *y, int q8) {
    for (int p = 0; p < m->n_parts && q8; p++) q8 = m->parts[p].fmt != F32;
    if (q8) qmatmul_q8x(m->parts, m->n_parts, x, 1, n, y, m->rows);
    else qmatvec(m->parts, m->n_parts, x, 1, n, y, m->rows, 0);
    if (m->bias)
        for (int i = 0; i < m->rows; i++) y[i] += m->bias[i];
}

static void rotate(float *x, const float *cos, const float *sin, int rot) {
    int half = rot / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* softmax(q K^T / sqrt(D)) V over cache rows lo..pos of one head */
static void attend(const float *q, const float *keys, const float *values, int64_t lo, int64_t pos, int d,
                   float *scores, float *out) {
    float scale = 1.f / sqrtf((float)d), top = -INFINITY, sum = 0.f;
    for (int64_t j = lo; j <= pos; j++) {
        const float *k = keys + j * d;
        float s = 0.f;
        for (int i = 0; i < d; i++) s += q[i] * k[i];
        scores[j - lo] = s * scale;
        top = fmaxf(top, scores[j - lo]);
    }
    for (int64_t j = lo; j <= pos; j++) { scores[j - lo] = expf(scores[j - lo] - top); sum += scores[j - lo]; }
    for (int i = 0; i < d; i++) out[i] = 0.f;
    for (int64_t j = lo; j <= pos; j++) {
        const float *v = values + j * d;
        float p = scores[j - lo] / sum;
        for (int i = 0; i < d; i++) out[i] += p * v[i];
    }
}

typedef struct { const float *qkv; const float *kv; float *out, *scores; int64_t lo, pos, max_tokens; int h, g, d; }
    head_job;

static void head_task(void *arg, int64_t begin, int64_t end) {
    const head_job *j = (const head_job *)arg;
    for (int64_t i = begin; i < end; i++) {
        int64_t kvh = i / (j->h / j->g);
        attend(j->qkv + i * j->d, j->kv + kvh * j->max_tokens * j->d, j->kv + (j->g + kvh) * j->max_tokens * j->d,
               j->lo, j->pos, j->d, j->scores + i * (j->pos + 1), j->out + i * j->d);
    }
}

static void attention(const model_t *m, const layer_t *l, float *qkv, int64_t pos, float *kv, int64_t max_tokens,
                      float *out, float *scores) {
    int h = m->n_heads, g = m->n_kv, d = m->head_dim;
    const float *cos = m->cos + pos * m->rot_dim, *sin = m->sin + pos * m->rot_dim;
    for (int i = 0; i < h + g; i++) {
        float *head = qkv + i * d;
        if (l->qk_norm) rms_norm(head, l->qk_norm + i * d, d, m->qk_eps, head);
        rotate(head, cos, sin, m->rot_dim);
    }
    for (int i = 0; i < g; i++) {  /* k, v of this token into the cache at pos */
        memcpy(kv + (i * max_tokens + pos) * d, qkv + (h + i) * d, sizeof(float) * d);
        memcpy(kv + ((g + i) * max_tokens + pos) * d, qkv + (h + g + i) * d, sizeof(float) * d);
    }
    head_job job = {qkv, kv, out, scores, l->window > 0 && pos + 1 > l->window ? pos + 1 - l->window : 0, pos,
                    max_tokens, h, g, d};
    pool_run(head_task, &job, h, 1);
}

/* Feed `token` at position `pos`; kv: the cache [layers, 2, KV, max_tokens, D]; logits: [vocab]. */
void decode_step(const model_t *m, int64_t token, int64_t pos, float *kv, int64_t max_tokens, float *logits) {
    int hid = m->hidden, qkv_rows = (m->n_heads + 2 * m->n_kv) * m->head_dim, att = m->n_heads * m->head_dim;
    size_t floats = 3 * (size_t)hid + qkv_rows + att + 3 * (size_t)m->inter + (size_t)m->n_heads * (pos + 1);
    float *x = (float *)malloc(sizeof(float) * floats);
    float *xn = x + hid, *tmp = xn + hid, *qkv = tmp + hid, *ao = qkv + qkv_rows, *gu = ao + att;
    float *act = gu + 2 * m->inter, *scores = act + m->inter;
    const part_t *e = m->embed;
    if (e->fmt == F32) memcpy(x, e->data + token * e->row_bytes, sizeof(float) * hid);
    else {
        extern void dequant_rows(const part_t *, const int64_t *, int64_t, int, float *);
        dequant_rows(e, &token, 1, hid, x);
    }
    int64_t layer_floats = 2 * (int64_t)m->n_kv * max_tokens * m->head_dim;
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *l = m->layers + i;
        rms_norm(x, l->attn_norm, hid, m->eps, xn);
        product(&l->qkv, xn, hid, qkv, m->q8);
        attention(m, l, qkv, pos, kv + i * layer_floats, max_tokens, ao, scores);
        product(&l->o, ao, att, tmp, m->q8);
        for (int j = 0; j < hid; j++) x[j] += tmp[j];
        rms_norm(x, l->ffn_norm, hid, m->eps, xn);
        product(&l->gate_up, xn, hid, gu, m->q8);
        for (int j = 0; j < m->inter; j++) { float a = gu[j]; act[j] = a / (1.f + expf(-a)) * gu[m->inter + j]; }
        product(&l->down, act, m->inter, tmp, m->q8);
        for (int j = 0; j < hid; j++) x[j] += tmp[j];
    }
    rms_norm(x, m->final_norm, hid, m->eps, xn);
    product(&m->lm_head, xn, hid, logits, m->q8);
    free(x);
}
