/* Attention of one new token per sequence over its cache, for the fused decode step
 * (decode_step.c), split into tasks the pool shares:
 *
 * a task is one (sequence, KV head, span of CHUNK cache rows). It reads each key and value row of
 * its span from memory once for all the query heads that share the KV head (grouped-query
 * attention), and leaves per query head the span's partial softmax: its largest score m, the sum
 * l of exp(score - m), and o = sum of exp(score - m) * value. The caller then merges the spans of
 * each head as flash-decoding does: out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c with M
 * the largest m_c. The arithmetic is the reference's up to the order of float32 additions (and
 * one division per head instead of one per row); a sequence's result never depends on the
 * other sequences of a batch (its spans start at its own window start). The cache holds float32
 * or IEEE float16 values (half: each row widened with F16C as it is read). */
#include <math.h>
#include <stdlib.h>

#include "gguf_blocks.h"

#define CHUNK 128  /* cache rows per task: a span's keys (or values) of one head fit in L1 */

/* 8 cache values from p (float16 when half, else float32) as float32 */
static inline __m256 load8(const void *p, int64_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

static inline float value_at(const void *p, int64_t i, int half) {
    return half ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float dot(const float *a, const void *b, int d, int half) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b, i, half), acc);
    float s = hsum(acc);
    for (; i < d; i++) s += a[i] * value_at(b, i, half);
    return s;
}

/* scores[j] = scale * q . keys[j] for n rows; four rows at a time (independent accumulators) */
static void span_scores(const float *q, const void *keys, int64_t n, int d, float scale, float *scores,
                        int half) {
    int64_t j = 0;
    if (d % 8 == 0) {
        for (; j + 4 <= n; j += 4) {
            int64_t k = j * d;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int i = 0; i < d; i += 8) {
                __m256 qv = _mm256_loadu_ps(q + i);
                a0 = _mm256_fmadd_ps(qv, load8(keys, k + i, half), a0);
                a1 = _mm256_fmadd_ps(qv, load8(keys, k + d + i, half), a1);
                a2 = _mm256_fmadd_ps(qv, load8(keys, k + 2 * d + i, half), a2);
                a3 = _mm256_fmadd_ps(qv, load8(keys, k + 3 * d + i, half), a3);
            }
            scores[j] = hsum(a0) * scale;
            scores[j + 1] = hsum(a1) * scale;
            scores[j + 2] = hsum(a2) * scale;
            scores[j + 3] = hsum(a3) * scale;
        }
    }
    for (; j < n; j++) scores[j] = dot(q, half ? (const void *)((const uint16_t *)keys + j * d)
                                              : (const void *)((const float *)keys + j * d), d, half) * scale;
}

/* out[i] += p * v[i] (v: float16 when half, else float32) */
static inline void axpy(float p, const void *v, float *out, int d, int half) {
    int i = 0;
    __m256 pv = _mm256_set1_ps(p);
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, load8(v, i, half), _mm256_loadu_ps(out + i)));
    for (; i < d; i++) out[i] += p * value_at(v, i, half);
}

typedef struct {
    const float *qkv; void *const *kv;
    const int64_t *lo, *pos, *max_tokens, *first_task, *first_part;
    float *parts;  /* per (sequence, head, span): m, l, o[d] */
    int n_tok, h, g, d, qkv_rows, half;
} attn_job;

static int64_t spans(const attn_job *j, int t) { return (j->pos[t] - j->lo[t] + CHUNK) / CHUNK; }

static void span_task(void *arg, int64_t begin, int64_t end) {
    const attn_job *j = (const attn_job *)arg;
    int rep = j->h / j->g, d = j->d;
    float scale = 1.f / sqrtf((float)d), scores[CHUNK];
    for (int64_t task = begin; task < end; task++) {
        int t = 0;
        while (t + 1 < j->n_tok && j->first_task[t + 1] <= task) t++;
        int64_t n_spans = spans(j, t), local = task - j->first_task[t];
        int kvh = (int)(local / n_spans);
        int64_t span = local % n_spans, row0 = j->lo[t] + span * CHUNK;
        int64_t rows = j->pos[t] + 1 - row0 < CHUNK ? j->pos[t] + 1 - row0 : CHUNK;
        int64_t size = j->half ? 2 : 4;
        const char *keys = (const char *)j->kv[t] + (kvh * j->max_tokens[t] + row0) * d * size;
        const char *values = (const char *)j->kv[t] + ((j->g + kvh) * j->max_tokens[t] + row0) * d * size;
        for (int r = 0; r < rep; r++) {
            int head = kvh * rep + r;
            const float *q = j->qkv + (int64_t)t * j->qkv_rows + (int64_t)head * d;
            float *part = j->parts + (j->first_part[t] + head * n_spans + span) * (d + 2), *o = part + 2;
            span_scores(q, keys, rows, d, scale, scores, j->half);
            float top = -INFINITY, sum = 0.f;
            for (int64_t i = 0; i < rows; i++) top = fmaxf(top, scores[i]);
            for (int i = 0; i < d; i++) o[i] = 0.f;
            for (int64_t i = 0; i < rows; i++) {
                float p = expf(scores[i] - top);
                sum += p;
                axpy(p, values + i * d * size, o, d, j->half);
            }
            part[0] = top;
            part[1] = sum;
        }
    }
}

/* out[t, head, :] = softmax(q K^T / sqrt(d)) V over cache rows lo[t]..pos[t] of sequence t, for
 * every query head; qkv: [n_tok, qkv_rows] (q of h heads first); kv[t]: the layer's cache of
 * sequence t [2, g, max_tokens[t], d], float16 when half, else float32. */
void decode_attention(const float *qkv, int qkv_rows, void *const *kv, const int64_t *max_tokens,
                      const int64_t *lo, const int64_t *pos, int n_tok, int h, int g, int d, int half,
                      float *out) {
    int64_t *first_task = (int64_t *)malloc(sizeof(int64_t) * 2 * n_tok), *first_part = first_task + n_tok;
    attn_job job = {qkv, kv, lo, pos, max_tokens, first_task, first_part, NULL, n_tok, h, g, d, qkv_rows, half};
    int64_t tasks = 0, parts = 0;
    for (int t = 0; t < n_tok; t++) {
        first_task[t] = tasks;
        first_part[t] = parts;
        tasks += g * spans(&job, t);
        parts += h * spans(&job, t);
    }
    job.parts = (float *)malloc(sizeof(float) * parts * (d + 2));
    pool_run(span_task, &job, tasks, 1);
    for (int t = 0; t < n_tok; t++) {
        int64_t n_spans = spans(&job, t);
        for (int head = 0; head < h; head++) {
            const float *part = job.parts + (first_part[t] + head * n_spans) * (d + 2);
            float *o = out + ((int64_t)t * h + head) * d, top = -INFINITY, sum = 0.f;
            for (int64_t c = 0; c < n_spans; c++) top = fmaxf(top, part[c * (d + 2)]);
            for (int i = 0; i < d; i++) o[i] = 0.f;
            for (int64_t c = 0; c < n_spans; c++) {
                const float *pc = part + c * (d + 2);
                float w = expf(pc[0] - top);
                sum += w * pc[1];
                axpy(w, pc + 2, o, d, 0);
            }
            for (int i = 0; i < d; i++) o[i] /= sum;
        }
    }
    free(job.parts);
    free(first_task);
}
