// One decoder layer of the lean model (models/backends/lean.py) for W new tokens, in C: RMSNorm, the q/k/v, o and
// SwiGLU (or GeGLU) projections on this ISA's matmuls of every kind, RoPE, the KV cache write and attention, one
// call from Python instead of ~80 small torch operations (at one token those cost the 0.5B drafter a third
// of its forward). Included at the end of every ISA's file, after its matmuls.
//
// Row invariance: every row is normalized, rotated and attends on its own, over exactly the keys it may see,
// in cache order; each sum runs over 16 lanes in a fixed order and then adds the lanes in a fixed order (so
// compilers vectorize it without reassociating). Row r of a W-row call therefore equals its 1-row call, and
// with -ffp-contract=off every ISA's library gives the same bits (exp too: common.h's exp_poly, not libm's).
//
// Each ISA's file defines, before including this, the loop attention spends most of its time in, with the bits
// of scalar.c's plain version: sum16(a, b, n), the sum of a[i] * b[i] over 16 lanes (lane l adds the products
// of inputs l, l + 16, ... in order), then the lanes pairwise in a fixed tree (lane l += lane l + w for w = 8, 4,
// 2, 1), then the inputs past the last 16.
#include <stdlib.h>

typedef struct {
    const uint8_t *packed;
    int64_t K, O, out;  // inputs (a multiple of 128), outputs padded to 16, outputs
    int32_t kind;       // 0: q4_k, 1: q6_k, 2: q8_b, 3: f32 (rows of K fp32), 4: q4_b, 5: q5_k, 6: q5_b
} Mat;

typedef struct {
    const float *attn_norm, *ffn_norm;
    const float *q_norm, *k_norm, *post_attn_norm, *post_ffn_norm, *q_bias, *k_bias, *v_bias;  // each may be NULL
    Mat q, k, v, o, gate, up, down;
} Layer;

// y [rows, O] = x [rows, K] times fp32 weights [O, K] (an F16, BF16 or F32 file's matrix): each output is sum16
// of its row and the input row, so its bits are the same whatever the rows, the thread or the ISA.
void matmul_f32(const float *x, int64_t rows, int64_t K, const float *w, int64_t O, float *y, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < O; o++)
        for (int64_t r = 0; r < rows; r++) y[r * O + o] = sum16(x + r * K, w + o * K, K);
}

// Rows of activations quantized once for every matrix that reads them (q, k, v; gate, up), and the rows
// themselves, zero-padded to K, for fp32 matrices.
typedef struct {
    int8_t *q;
    float *sa;
    int16_t *s32;
    int32_t *o16;
    int64_t K;
    const float *x;
    float *copy;  // x where it had to be padded (freed with the rest)
} Act;

// x [n, width] zero-padded to K inputs and quantized.
static Act quantize_input(const float *x, int64_t n, int64_t width, int64_t K, int threads) {
    Act a = {malloc(n * K), malloc(n * supers(K) * sizeof(float)), malloc(n * (K / 32) * sizeof(int16_t)),
             malloc(n * (K / 16) * sizeof(int32_t)), K, x, NULL};
    if (width != K) {
        a.x = a.copy = calloc(n * K, sizeof(float));
        for (int64_t r = 0; r < n; r++) memcpy(a.copy + r * K, x + r * width, width * sizeof(float));
    }
    quantize_rows(a.x, n, K, a.q, a.sa, a.s32, a.o16, threads);
    return a;
}

static void free_act(Act a) { free(a.q), free(a.sa), free(a.s32), free(a.o16), free(a.copy); }

// y [n, m.O] = the rows (quantized, or as they are for an fp32 matrix) times m.
static void project(const Mat *m, const Act *a, int64_t n, float *y, int threads) {
    switch (m->kind) {
        case 0: matmul_q4_k(a->q, a->sa, a->s32, a->o16, n, m->K, m->packed, m->O, y, threads); break;
        case 1: matmul_q6_k(a->q, a->sa, a->s32, a->o16, n, m->K, m->packed, m->O, y, threads); break;
        case 2: matmul_q8_b(a->q, a->sa, a->s32, a->o16, n, m->K, m->packed, m->O, y, threads); break;
        case 4: matmul_q4_b(a->q, a->sa, a->s32, a->o16, n, m->K, m->packed, m->O, y, threads); break;
        case 5: matmul_q5_k(a->q, a->sa, a->s32, a->o16, n, m->K, m->packed, m->O, y, threads); break;
        case 6: matmul_q5_b(a->q, a->sa, a->s32, a->o16, n, m->K, m->packed, m->O, y, threads); break;
        default: matmul_f32(a->x, n, m->K, (const float *)m->packed, m->O, y, threads);
    }
}

// out [d] = the sum of p[j] * v[j * d + i] over j < last where p[j] != 0, in order of j from 0: 64 outputs at a
// time, which compilers keep in registers over every j (where a loop over all d read and wrote them for each).
static inline void weighted_sum(float *out, const float *p, const float *v, int64_t last, int64_t d) {
    int64_t whole = d - d % 64;
    for (int64_t c = 0; c < whole; c += 64) {
        float acc[64] = {0};
        for (int64_t j = 0; j < last; j++) {
            if (p[j] == 0.0f) continue;
            for (int k = 0; k < 64; k++) acc[k] += p[j] * v[j * d + c + k];
        }
        memcpy(out + c, acc, sizeof acc);
    }
    for (int64_t i = whole; i < d; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < last; j++)
        for (int64_t i = whole; p[j] != 0.0f && i < d; i++) out[i] += p[j] * v[j * d + i];
}

// tanh(x) = 1 - 2 / (e^2x + 1), on exp_poly: the same bits on every ISA.
static inline float tanh_poly(float x) { return 1.0f - 2.0f / (exp_poly(2.0f * x) + 1.0f); }

// SwiGLU (Shazeer 2020): silu(gate) * up, element by element; with `gelu`, GeGLU: GELU's tanh form (Hendrycks and
// Gimpel 2016, sec. 2) in place of SiLU, as Gemma's.
static inline void glu(const float *restrict gate, const float *restrict up, float *restrict act, int64_t n, int gelu) {
    if (gelu)
        for (int64_t i = 0; i < n; i++) {
            float g = gate[i];
            act[i] = 0.5f * g * (1.0f + tanh_poly(0.7978845608f * (g + 0.044715f * g * g * g))) * up[i];
        }
    else
        for (int64_t i = 0; i < n; i++) act[i] = gate[i] / (1.0f + exp_poly(-gate[i])) * up[i];
}


static void rms_norm(const float *x, const float *w, int64_t n, int64_t width, float eps, float *y) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * width;
        float scale = 1.0f / sqrtf(sum16(xr, xr, width) / (float)width + eps);
        for (int64_t i = 0; i < width; i++) y[r * width + i] = xr[i] * scale * w[i];
    }
}

// y [n, width] += the rows of x [n, stride] (their first `width`), each RMS-normed by w first where w is given.
static void add_rows(float *y, float *x, const float *w, int64_t n, int64_t width, int64_t stride, float eps) {
    for (int64_t r = 0; r < n; r++) {
        if (w) rms_norm(x + r * stride, w, 1, width, eps, x + r * stride);
        for (int64_t i = 0; i < width; i++) y[r * width + i] += x[r * stride + i];
    }
}

// RoPE (Su et al. 2021, eq. 34) on `heads` vectors of d at v: neox pairs i with i + d/2, else 2i with 2i + 1.
static void rotate(float *v, int64_t heads, int64_t d, const float *cos, const float *sin, int neox) {
    for (int64_t h = 0; h < heads; h++) {
        float *x = v + h * d;
        for (int64_t i = 0; i < d / 2; i++) {
            int64_t ia = neox ? i : 2 * i, ib = neox ? i + d / 2 : 2 * i + 1;
            float a = x[ia], b = x[ib];
            x[ia] = a * cos[i] - b * sin[i];
            x[ib] = b * cos[i] + a * sin[i];
        }
    }
}

// x [n, hidden] (the residual stream, updated in place) through one layer. The rows may belong to several
// sequences, each with a cache of its own: row i is rotated by position pos[i], writes its key and value at
// position slot[i] of its cache (keys[i] + offset, values[i] + offset: this layer's [kv_heads, capacity, d])
// and sees that cache's positions j < seen[i] where masks[i][j] (masks[i] NULL: every j < seen[i]). Scores are
// q.k times `scale`, soft-capped where `softcap` is not 0 (Gemma 2); `gelu`: GeGLU where SwiGLU has SiLU.
void lean_layer(const Layer *L, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t d, float eps, int neox,
                float *x, int64_t n, const float *cos, const float *sin, const int64_t *pos, const int64_t *slot,
                const int64_t *seen, const uint8_t *const *masks, float *const *keys, float *const *values,
                int64_t offset, int64_t capacity, float scale, int threads, float softcap, int gelu) {
    int64_t group = heads / kv_heads, inter = L->gate.out;
    float *h = malloc(n * hidden * sizeof(float)), *attended = malloc(n * heads * d * sizeof(float));
    float *q = malloc(n * L->q.O * sizeof(float)), *k = malloc(n * L->k.O * sizeof(float));
    float *v = malloc(n * L->v.O * sizeof(float)), *o = malloc(n * L->o.O * sizeof(float));
    rms_norm(x, L->attn_norm, n, hidden, eps, h);
    Act a = quantize_input(h, n, hidden, L->q.K, threads);  // q, k and v read the same inputs
    project(&L->q, &a, n, q, threads);
    project(&L->k, &a, n, k, threads);
    project(&L->v, &a, n, v, threads);
    free_act(a);
    for (int64_t r = 0; r < n; r++) {
        float *qr = q + r * L->q.O, *kr = k + r * L->k.O, *vr = v + r * L->v.O;
        for (int64_t i = 0; L->q_bias && i < heads * d; i++) qr[i] += L->q_bias[i];
        for (int64_t i = 0; L->k_bias && i < kv_heads * d; i++) kr[i] += L->k_bias[i];
        for (int64_t i = 0; L->v_bias && i < kv_heads * d; i++) vr[i] += L->v_bias[i];
        if (L->q_norm) rms_norm(qr, L->q_norm, heads, d, eps, qr);  // Qwen3, Gemma 3: each head's q and k normed
        if (L->k_norm) rms_norm(kr, L->k_norm, kv_heads, d, eps, kr);
        rotate(qr, heads, d, cos + pos[r] * (d / 2), sin + pos[r] * (d / 2), neox);
        rotate(kr, kv_heads, d, cos + pos[r] * (d / 2), sin + pos[r] * (d / 2), neox);
        for (int64_t g = 0; g < kv_heads; g++) {
            memcpy(keys[r] + offset + (g * capacity + slot[r]) * d, kr + g * d, d * sizeof(float));
            memcpy(values[r] + offset + (g * capacity + slot[r]) * d, vr + g * d, d * sizeof(float));
        }
    }
    // Attention, per row and kv head: each cached key and value is read once for the `group` query heads
    // that share it (GQA); a query head's sums run over the keys in cache order.
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++)
        for (int64_t g = 0; g < kv_heads; g++) {
            const float *kc = keys[r] + offset + g * capacity * d, *vc = values[r] + offset + g * capacity * d;
            const uint8_t *visible = masks[r];
            int64_t last = seen[r];
            float *scores = malloc(group * last * sizeof(float)), top[group], total[group];
            for (int64_t h = 0; h < group; h++) top[h] = -INFINITY, total[h] = 0.0f;
            for (int64_t j = 0; j < last; j++)
                for (int64_t h = 0; h < group; h++) {
                    const float *qh = q + r * L->q.O + (g * group + h) * d;
                    float s = visible && !visible[j] ? -INFINITY : sum16(qh, kc + j * d, d) * scale;
                    if (softcap != 0.0f && s != -INFINITY) s = softcap * tanh_poly(s / softcap);  // Gemma 2
                    scores[h * last + j] = s;
                    top[h] = s > top[h] ? s : top[h];
                }
            float *out = attended + (r * heads + g * group) * d;  // the group's heads, one after another
            for (int64_t h = 0; h < group; h++) {
                float *p = scores + h * last;
                for (int64_t j = 0; j < last; j++) p[j] = exp_poly(p[j] - top[h]);  // 0 where masked
                for (int64_t j = 0; j < last; j++) total[h] += p[j];
                weighted_sum(out + h * d, p, vc, last, d);
                for (int64_t i = 0; i < d; i++) out[h * d + i] /= total[h];
            }
            free(scores);
        }
    a = quantize_input(attended, n, heads * d, L->o.K, threads);
    project(&L->o, &a, n, o, threads);
    free_act(a);
    add_rows(x, o, L->post_attn_norm, n, hidden, L->o.O, eps);
    free(q), free(k), free(v), free(o), free(attended);
    float *gate = malloc(n * L->gate.O * sizeof(float)), *up = malloc(n * L->up.O * sizeof(float));
    float *act = malloc(n * inter * sizeof(float)), *down = malloc(n * L->down.O * sizeof(float));
    rms_norm(x, L->ffn_norm, n, hidden, eps, h);
    a = quantize_input(h, n, hidden, L->gate.K, threads);
    project(&L->gate, &a, n, gate, threads);
    project(&L->up, &a, n, up, threads);
    free_act(a);
    int64_t chunks = (inter + 255) / 256;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < chunks; c++)
            glu(gate + r * L->gate.O + c * 256, up + r * L->up.O + c * 256, act + r * inter + c * 256,
                inter - c * 256 < 256 ? inter - c * 256 : 256, gelu);
    a = quantize_input(act, n, inter, L->down.K, threads);
    project(&L->down, &a, n, down, threads);
    free_act(a);
    add_rows(x, down, L->post_ffn_norm, n, hidden, L->down.O, eps);
    free(gate), free(up), free(act), free(down), free(h);
}
