/* Attention of one new token per sequence over its cache, for the fused decode step
 * (decode_step.c), split into tasks the pool shares:
 *
 * a task is one (sequence, KV head, span of CHUNK cache rows). It reads each key and value row of
 * its span from memory once for all the query heads that share the KV head (grouped-query
 * attention), and leaves per query head the span's partial softmax: its largest score m, the sum
 * l of exp(score - m), and o = sum of exp(score - m) * value. The caller then merges the spans of
 * each head as flash-decoding does: out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c with M
 * the largest m_c. The arithmetic is the reference's up to the order of float32 additions (and
 * one division per head instead of one per row, and a polynomial exp within 1.3 float32
 * ulps); a sequence's result never depends on the other sequences of a batch (its spans start
 * at its own window start). The cache holds float32 or IEEE float16 values (half: the first
 * query head of a KV head widens the span's rows into a float32 buffer as it reads them, the
 * group's other heads read that buffer). */
#include <math.h>
#include <stdlib.h>

#include "gguf_blocks.h"

#define CHUNK 128  /* cache rows per task: a span's keys (or values) of one head fit in L1 */

/* every function taking `half` and `store` is inlined where they are constants: one loop per use */
#define INLINE static inline __attribute__((always_inline))

/* 8 values from element i of src (float16 when half, else float32) as float32; when store is
 * not NULL, also written to store[i] (a span widened while it is first read) */
INLINE __m256 row8(const void *src, int64_t i, int half, float *store) {
    __m256 v = half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)))
                    : _mm256_loadu_ps((const float *)src + i);
    if (store) _mm256_storeu_ps(store + i, v);
    return v;
}

INLINE float value1(const void *src, int64_t i, int half, float *store) {
    float v = half ? _cvtsh_ss(((const uint16_t *)src)[i]) : ((const float *)src)[i];
    if (store) store[i] = v;
    return v;
}

INLINE float dot(const float *q, const void *src, int64_t at, int d, int half, float *store) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), row8(src, at + i, half, store), acc);
    float s = hsum(acc);
    for (; i < d; i++) s += q[i] * value1(src, at + i, half, store);
    return s;
}

/* scores[j] = scale * q . keys[j] for the n rows of keys (src: see row8); four rows at a time
 * (independent accumulators) */
INLINE void span_scores(const float *q, const void *keys, int half, float *store, int64_t n, int d,
                        float scale, float *scores) {
    int64_t j = 0;
    if (d % 8 == 0) {
        for (; j + 4 <= n; j += 4) {
            int64_t k = j * d;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int i = 0; i < d; i += 8) {
                __m256 qv = _mm256_loadu_ps(q + i);
                a0 = _mm256_fmadd_ps(qv, row8(keys, k + i, half, store), a0);
                a1 = _mm256_fmadd_ps(qv, row8(keys, k + d + i, half, store), a1);
                a2 = _mm256_fmadd_ps(qv, row8(keys, k + 2 * d + i, half, store), a2);
                a3 = _mm256_fmadd_ps(qv, row8(keys, k + 3 * d + i, half, store), a3);
            }
            scores[j] = hsum(a0) * scale;
            scores[j + 1] = hsum(a1) * scale;
            scores[j + 2] = hsum(a2) * scale;
            scores[j + 3] = hsum(a3) * scale;
        }
    }
    for (; j < n; j++) scores[j] = dot(q, keys, j * d, d, half, store) * scale;
}

/* exp(x) of 8 values x <= 0 (inputs below -87 give exp(-87), ~1e-38): x = n ln2 + r, |r| <= ln2/2,
 * exp(r) by Cephes' expf polynomial, times 2^n built in the exponent bits */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* scores[i] = exp(scores[i] - top) for n values; returns their sum */
static float exp_shifted(float *scores, int64_t n, float top) {
    __m256 t = _mm256_set1_ps(top), acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), t));
        _mm256_storeu_ps(scores + i, p);
        acc = _mm256_add_ps(acc, p);
    }
    float sum = hsum(acc);
    if (i < n) {  /* the tail through the same polynomial, padded with zeros' lanes unused */
        float tail[8] = {0};
        memcpy(tail, scores + i, sizeof(float) * (n - i));
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), t)));
        for (int64_t k = 0; k < n - i; k++) {
            scores[i + k] = tail[k];
            sum += tail[k];
        }
    }
    return sum;
}

static float max_of(const float *x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, m);
    for (int k = 0; k < 8; k++) top = fmaxf(top, lanes[k]);
    for (; i < n; i++) top = fmaxf(top, x[i]);
    return top;
}

/* o = sum over the n rows of values (src: see row8) of p[i] * row i: when d is a multiple of 64,
 * 64 columns at a time summed in registers over all the rows; else row by row into o */
INLINE void weighted_rows(const float *p, const void *values, int half, float *store, int64_t n, int d,
                          float *o) {
    if (d % 64 != 0) {
        for (int i = 0; i < d; i++) o[i] = 0.f;
        for (int64_t r = 0; r < n; r++) {
            __m256 w = _mm256_set1_ps(p[r]);
            int i = 0;
            for (; i + 8 <= d; i += 8)
                _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, row8(values, r * d + i, half, store), _mm256_loadu_ps(o + i)));
            for (; i < d; i++) o[i] += p[r] * value1(values, r * d + i, half, store);
        }
        return;
    }
    for (int c = 0; c < d; c += 64) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t r = 0; r < n; r++) {
            int64_t v = r * d + c;
            __m256 w = _mm256_set1_ps(p[r]);
            a0 = _mm256_fmadd_ps(w, row8(values, v, half, store), a0);
            a1 = _mm256_fmadd_ps(w, row8(values, v + 8, half, store), a1);
            a2 = _mm256_fmadd_ps(w, row8(values, v + 16, half, store), a2);
            a3 = _mm256_fmadd_ps(w, row8(values, v + 24, half, store), a3);
            a4 = _mm256_fmadd_ps(w, row8(values, v + 32, half, store), a4);
            a5 = _mm256_fmadd_ps(w, row8(values, v + 40, half, store), a5);
            a6 = _mm256_fmadd_ps(w, row8(values, v + 48, half, store), a6);
            a7 = _mm256_fmadd_ps(w, row8(values, v + 56, half, store), a7);
        }
        _mm256_storeu_ps(o + c, a0);
        _mm256_storeu_ps(o + c + 8, a1);
        _mm256_storeu_ps(o + c + 16, a2);
        _mm256_storeu_ps(o + c + 24, a3);
        _mm256_storeu_ps(o + c + 32, a4);
        _mm256_storeu_ps(o + c + 40, a5);
        _mm256_storeu_ps(o + c + 48, a6);
        _mm256_storeu_ps(o + c + 56, a7);
    }
}

/* out[i] += p * v[i] */
static inline void axpy(float p, const float *v, float *out, int d) {
    int i = 0;
    __m256 pv = _mm256_set1_ps(p);
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
    for (; i < d; i++) out[i] += p * v[i];
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
    float *wide = j->half ? (float *)malloc(sizeof(float) * 2 * CHUNK * d) : NULL;
    for (int64_t task = begin; task < end; task++) {
        int t = 0;
        while (t + 1 < j->n_tok && j->first_task[t + 1] <= task) t++;
        int64_t n_spans = spans(j, t), local = task - j->first_task[t];
        int kvh = (int)(local / n_spans);
        int64_t span = local % n_spans, row0 = j->lo[t] + span * CHUNK;
        int64_t rows = j->pos[t] + 1 - row0 < CHUNK ? j->pos[t] + 1 - row0 : CHUNK;
        int64_t key_at = (kvh * j->max_tokens[t] + row0) * d, value_at = ((j->g + kvh) * j->max_tokens[t] + row0) * d;
        const uint16_t *half_kv = (const uint16_t *)j->kv[t];
        const float *keys = (const float *)j->kv[t] + key_at, *values = (const float *)j->kv[t] + value_at;
        for (int r = 0; r < rep; r++) {
            int head = kvh * rep + r;
            const float *q = j->qkv + (int64_t)t * j->qkv_rows + (int64_t)head * d;
            float *part = j->parts + (j->first_part[t] + head * n_spans + span) * (d + 2), *o = part + 2;
            /* a float16 span: its first head widens the rows as it reads them, the others read those */
            if (j->half && r == 0) span_scores(q, half_kv + key_at, 1, wide, rows, d, scale, scores);
            else span_scores(q, j->half ? wide : keys, 0, NULL, rows, d, scale, scores);
            float top = max_of(scores, rows), sum = exp_shifted(scores, rows, top);
            if (j->half && r == 0) weighted_rows(scores, half_kv + value_at, 1, wide + CHUNK * d, rows, d, o);
            else weighted_rows(scores, j->half ? wide + CHUNK * d : values, 0, NULL, rows, d, o);
            part[0] = top;
            part[1] = sum;
        }
    }
    free(wide);
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
                axpy(w, pc + 2, o, d);
            }
            for (int i = 0; i < d; i++) o[i] /= sum;
        }
    }
    free(job.parts);
    free(first_task);
}
