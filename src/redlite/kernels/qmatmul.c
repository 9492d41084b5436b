/* GGUF block formats on CPU: rows dequantized to float32, and y = W x with x quantized to
 * 8 bits per 32-value block (as llama.cpp does: qmatmul_q8), for Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
 * Q6_K. AVX2 + FMA + F16C; rows spread over the thread pool (pool.c). The float32-activation products are in
 * qmatvec.c. Built and loaded by redlite/kernels/native.py. */
#include <math.h>
#include <stdlib.h>

#include "gguf_blocks.h"

typedef struct { int8_t q[32]; float d; float s; } xq8; /* s = d * sum(q) */

int block_bytes(int fmt) {  /* bytes per block of block_values(fmt) values */
    switch (fmt) {
    case Q4_0: return 18; case Q4_1: return 20; case Q8_0: return 34;
    case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210; case F32: return 128;
    }
    return 0;
}
int block_values(int fmt) { return fmt >= Q4_K ? 256 : 32; }

/* ---- dequantization (reference for everything else) ---- */

static void dequant_row(int fmt, const uint8_t *w, int n, float *y) {
    if (fmt == F32) { memcpy(y, w, sizeof(float) * n); return; }
    for (int b = 0; b < n / block_values(fmt); b++) {
        if (fmt == Q4_0 || fmt == Q4_1) {
            float d = h2f(w), m = fmt == Q4_1 ? h2f(w + 2) : -8.f * d;
            const uint8_t *q = w + (fmt == Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) { y[i] = (q[i] & 15) * d + m; y[i + 16] = (q[i] >> 4) * d + m; }
        } else if (fmt == Q8_0) {
            float d = h2f(w);
            for (int i = 0; i < 32; i++) y[i] = (int8_t)w[2 + i] * d;
        } else if (fmt == Q4_K || fmt == Q5_K) {
            float d = h2f(w), dmin = h2f(w + 2), sc, m;
            const uint8_t *s = w + 4, *qh = w + 16, *q = w + (fmt == Q5_K ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                scale_min_k4(j, s, &sc, &m);
                for (int l = 0; l < 32; l++) {
                    int c = (q[32 * (j / 2) + l] >> (4 * (j & 1))) & 15;
                    if (fmt == Q5_K) c |= ((qh[l] >> j) & 1) << 4;
                    y[32 * j + l] = d * sc * c - dmin * m;
                }
            }
        } else if (fmt == Q6_K) {
            const uint8_t *ql = w, *qh = w + 128; const int8_t *sc = (const int8_t *)(w + 192);
            float d = h2f(w + 208);
            for (int k = 0; k < 8; k++) {
                int h = k / 4, t = k % 4;
                for (int l = 0; l < 32; l++) {
                    int lo = (ql[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15;
                    int c = lo | (((qh[32 * h + l] >> (2 * t)) & 3) << 4);
                    y[32 * k + l] = d * sc[2 * k + l / 16] * (c - 32);
                }
            }
        }
        w += block_bytes(fmt);
        y += block_values(fmt);
    }
}

typedef struct { const part_t *p; const int64_t *ids; int n; float *out; } rows_job;

static void rows_task(void *arg, int64_t begin, int64_t end) {
    const rows_job *j = (const rows_job *)arg;
    for (int64_t i = begin; i < end; i++) {
        int64_t row = j->ids ? j->ids[i] : i;
        dequant_row(j->p->fmt, j->p->data + row * j->p->row_bytes, j->n, j->out + i * j->n);
    }
}

/* Rows ids[i] of one part (n values each) -> out [n_ids, n] float32. */
void dequant_rows(const part_t *p, const int64_t *ids, int64_t n_ids, int n, float *out) {
    rows_job job = {p, ids, n, out};
    pool_run(rows_task, &job, n_ids, 8);
}

/* All rows of the stacked parts -> out [sum rows, n] float32. */
void dequant_parts(const part_t *parts, int n_parts, int n, float *out) {
    for (int p = 0; p < n_parts; p++) {
        rows_job job = {parts + p, NULL, n, out};
        pool_run(rows_task, &job, parts[p].rows, 16);
        out += (int64_t)parts[p].rows * n;
    }
}

/* bfloat16 bits of v, rounded to nearest even (finite v) */
static inline uint16_t bf16_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

typedef struct { const part_t *p; int n; uint16_t *out; } bf16_job;

static void bf16_task(void *arg, int64_t begin, int64_t end) {
    const bf16_job *j = (const bf16_job *)arg;
    float *row = (float *)malloc(sizeof(float) * j->n);
    for (int64_t i = begin; i < end; i++) {
        dequant_row(j->p->fmt, j->p->data + i * j->p->row_bytes, j->n, row);
        uint16_t *o = j->out + i * j->n;
        int k = 0;
        for (; k + 8 <= j->n; k += 8) {  /* the same rounding, 8 at a time */
            __m256i u = _mm256_castps_si256(_mm256_loadu_ps(row + k));
            __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
            __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
            _mm_storeu_si128((__m128i *)(o + k), packed);
        }
        for (; k < j->n; k++) o[k] = bf16_bits(row[k]);
    }
    free(row);
}

/* All rows of the stacked parts -> out [sum rows, n] bfloat16 (the float32 dequantization of
 * dequant_parts, rounded to nearest even): the weight of a prefill's bfloat16 product. */
void dequant_parts_bf16(const part_t *parts, int n_parts, int n, uint16_t *out) {
    for (int p = 0; p < n_parts; p++) {
        bf16_job job = {parts + p, n, out};
        pool_run(bf16_task, &job, parts[p].rows, 16);
        out += (int64_t)parts[p].rows * n;
    }
}

/* ---- 8-bit activations ---- */

void quantize_q8(const float *x, int n, xq8 *out) {
    for (int b = 0; b < n / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < 32; i++) { int q = (int)nearbyintf(v[i] * id); out[b].q[i] = (int8_t)q; sum += q; }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

/* ---- dot products of one weight row with 8-bit activations (nb: 32-value blocks) ---- */

static inline __m256 mul_us8(__m256i u, __m256i s) {  /* unsigned u x signed s, summed per 4 */
    __m256i p = _mm256_maddubs_epi16(u, s);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline __m256 mul_ss8(__m256i a, __m256i b) { return mul_us8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)); }
static float dot_q4_01(const uint8_t *w, const xq8 *x, int nb, int has_min) {
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f;
    int stride = has_min ? 20 : 18;
    for (int b = 0; b < nb; b++, w += stride) {
        float d = h2f(w), m = has_min ? h2f(w + 2) : -8.f * d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d), mul_us8(nibbles16(w + stride - 16), LD(x[b].q)), acc);
        off += m * x[b].s;
    }
    return hsum(acc) + off;
}

static float dot_q8_0(const uint8_t *w, const xq8 *x, int nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 34)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(w) * x[b].d), mul_ss8(LD(w + 2), LD(x[b].q)), acc);
    return hsum(acc);
}

static float dot_q45_k(const uint8_t *w, const xq8 *x, int nb, int five) {
    __m256 acc = _mm256_setzero_ps();
    float off = 0.f, sc, m;
    for (int b = 0; b < nb / 8; b++, w += five ? 176 : 144, x += 8) {
        float d = h2f(w), dmin = h2f(w + 2);
        for (int s = 0; s < 8; s++) {
            scale_min_k4(s, w + 4, &sc, &m);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc * x[s].d), mul_us8(codes_q45_k(w, five, s / 2, s & 1), LD(x[s].q)), acc);
            off += dmin * m * x[s].s;
        }
    }
    return hsum(acc) - off;
}

static float dot_q6_k(const uint8_t *w, const xq8 *x, int nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb / 8; b++, w += 210, x += 8) {
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = h2f(w + 208);
        for (int k = 0; k < 8; k++) {
            __m256i c = codes_q6_k(w, k), xq = LD(x[k].q);
            __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(xq, c));
            __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[2 * k + 1]), _mm_set1_epi16(sc[2 * k]));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[k].d), _mm256_cvtepi32_ps(_mm256_madd_epi16(p, s)), acc);
        }
    }
    return hsum(acc);
}

static inline float dot_row(int fmt, const uint8_t *w, const xq8 *x, int nb) {
    switch (fmt) {
    case Q4_0: return dot_q4_01(w, x, nb, 0);
    case Q4_1: return dot_q4_01(w, x, nb, 1);
    case Q8_0: return dot_q8_0(w, x, nb);
    case Q4_K: return dot_q45_k(w, x, nb, 0);
    case Q5_K: return dot_q45_k(w, x, nb, 1);
    case Q6_K: return dot_q6_k(w, x, nb);
    }
    return NAN;
}

typedef struct { const part_t *parts; int n_parts, n_tok, n; const xq8 *xq; float *out; int64_t ldo; } q8_job;

static void q8_task(void *arg, int64_t begin, int64_t end) {
    const q8_job *j = (const q8_job *)arg;
    int nb = j->n / 32;
    int64_t first = 0;
    for (int p = 0; p < j->n_parts; p++) {
        const part_t *pt = j->parts + p;
        int64_t lo = begin > first ? begin : first, hi = end < first + pt->rows ? end : first + pt->rows;
        for (int64_t r = lo; r < hi; r++)
            for (int t = 0; t < j->n_tok; t++)
                j->out[t * j->ldo + r] = dot_row(pt->fmt, pt->data + (r - first) * pt->row_bytes, j->xq + t * nb, nb);
        first += pt->rows;
    }
}

/* y[t, :] = W x[t, :] for the stacked parts (each x row of n values quantized to q8 once, shared
 * by every part); out row stride ldo. */
void qmatmul_q8(const part_t *parts, int n_parts, const xq8 *xq, int n_tok, int n, float *out, int64_t ldo) {
    int64_t rows = 0;
    for (int p = 0; p < n_parts; p++) rows += parts[p].rows;
    q8_job job = {parts, n_parts, n_tok, n, xq, out, ldo};
    pool_run(q8_task, &job, rows, 16);
}

void qmatmul_q8x(const part_t *parts, int n_parts, const float *x, int n_tok, int n, float *out, int64_t ldo) {
    int nb = n / 32;
    xq8 *xq = (xq8 *)aligned_alloc(64, ((sizeof(xq8) * nb * n_tok + 63) / 64) * 64);
    for (int t = 0; t < n_tok; t++) quantize_q8(x + (int64_t)t * n, n, xq + t * nb);
    qmatmul_q8(parts, n_parts, xq, n_tok, n, out, ldo);
    free(xq);
}

