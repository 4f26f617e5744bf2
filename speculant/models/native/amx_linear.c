// y[n, o] = sum_k x[n, k] w[o, k] with Intel AMX. bf16: bf16 inputs, fp32 accumulation; each output row of
// a tile accumulates its own dot products, 32 inputs per instruction, chunk after chunk in input order, so
// a row's result never depends on the other rows of the call (batch-invariant by construction).
// int8: int8 inputs (each row quantized on its own by the caller), int32 accumulation, which is exact in
// any order.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ROWS 16   // tokens per tile
#define COLS 16   // outputs per tile (a panel)
#define CHUNK 32  // inputs per tile multiply (bf16 pairs: 16 rows of 64 bytes)

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

// Ask Linux for the AMX tile state; 1 on success.
int amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

static void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = ROWS; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

// w [O, K] bf16 -> panels of 16 outputs, chunks of 32 inputs in VNNI order (pairs of inputs side by side),
// zeros past O and past K.
void amx_pack(const uint16_t *w, int64_t O, int64_t K, uint16_t *out) {
    int64_t panels = (O + COLS - 1) / COLS, chunks = (K + CHUNK - 1) / CHUNK;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < chunks; c++)
            for (int r = 0; r < CHUNK / 2; r++)
                for (int n = 0; n < COLS; n++)
                    for (int e = 0; e < 2; e++) {
                        int64_t o = p * COLS + n, k = c * CHUNK + 2 * r + e;
                        out[(((p * chunks + c) * (CHUNK / 2) + r) * COLS + n) * 2 + e] = o < O && k < K ? w[o * K + k] : 0;
                    }
}

// x [N, K] (elements of `size` bytes) copied into zeros of [blocks * 16, chunks * chunk]: every tile then
// loads whole rows and chunks; NULL when no copy is needed.
static void *staged(const void *x, int64_t N, int64_t K, int64_t chunk, int size, int64_t *stride) {
    int64_t rows = (N + ROWS - 1) / ROWS * ROWS, width = (K + chunk - 1) / chunk * chunk;
    *stride = width * size;
    if (rows == N && width == K) return NULL;
    char *buf = calloc(rows * width, size);
    for (int64_t r = 0; r < N; r++) memcpy(buf + r * width * size, (const char *)x + r * K * size, K * size);
    return buf;
}

// x [N, K] bf16, packed weights, y [N, O] fp32. Threads split the output panels (two per task).
void amx_linear(const uint16_t *x, int64_t N, int64_t K, const uint16_t *packed, int64_t O, float *y, int threads) {
    int64_t panels = (O + COLS - 1) / COLS, chunks = (K + CHUNK - 1) / CHUNK, blocks = (N + ROWS - 1) / ROWS;
    int64_t pairs = (panels + 1) / 2, stride;
    void *buf = staged(x, N, K, CHUNK, 2, &stride);
    const char *xs = buf ? buf : (const char *)x;
    #pragma omp parallel num_threads(threads)
    {
        configure();
        float cbuf[ROWS * COLS];
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < pairs; g++) {
            int64_t p0 = 2 * g, p1 = p0 + 1 < panels ? p0 + 1 : p0;
            for (int64_t b = 0; b < blocks; b++) {
                int64_t rows = N - b * ROWS < ROWS ? N - b * ROWS : ROWS;
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t c = 0; c < chunks; c++) {
                    _tile_loadd(4, xs + b * ROWS * stride + c * CHUNK * 2, stride);
                    _tile_loadd(5, packed + (p0 * chunks + c) * CHUNK * COLS, 64);
                    _tile_loadd(6, packed + (p1 * chunks + c) * CHUNK * COLS, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_dpbf16ps(1, 4, 6);
                }
                for (int t = 0; t < (p1 == p0 ? 1 : 2); t++) {
                    int64_t p = t ? p1 : p0, width = O - p * COLS < COLS ? O - p * COLS : COLS;
                    if (t == 0) _tile_stored(0, cbuf, COLS * 4); else _tile_stored(1, cbuf, COLS * 4);
                    for (int r = 0; r < rows; r++) memcpy(y + (b * ROWS + r) * O + p * COLS, cbuf + r * COLS, width * 4);
                }
            }
        }
        _tile_release();
    }
    free(buf);
}

#define CHUNK8 64  // int8 inputs per tile multiply (groups of 4: 16 rows of 64 bytes)

// w [O, K] int8 -> panels of 16 outputs, chunks of 64 inputs, groups of 4 inputs side by side; zeros pad.
void amx_pack_i8(const int8_t *w, int64_t O, int64_t K, int8_t *out) {
    int64_t panels = (O + COLS - 1) / COLS, chunks = (K + CHUNK8 - 1) / CHUNK8;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < chunks; c++)
            for (int r = 0; r < CHUNK8 / 4; r++)
                for (int n = 0; n < COLS; n++)
                    for (int e = 0; e < 4; e++) {
                        int64_t o = p * COLS + n, k = c * CHUNK8 + 4 * r + e;
                        out[(((p * chunks + c) * (CHUNK8 / 4) + r) * COLS + n) * 4 + e] = o < O && k < K ? w[o * K + k] : 0;
                    }
}

// y [N, O] fp32 = (q(x) W^T) * row scale * scales[o] + bias[o]: x [N, K] fp32, each row quantized to int8
// on its own (symmetric, scale max |x| / 127, rounded to nearest even), packed int8 weights with their
// per-output scales; bias may be NULL. The int32 sums are exact.
void amx_linear_i8(const float *x, int64_t N, int64_t K, const int8_t *packed, const float *scales,
                   const float *bias, int64_t O, float *y, int threads) {
    int64_t panels = (O + COLS - 1) / COLS, chunks = (K + CHUNK8 - 1) / CHUNK8, blocks = (N + ROWS - 1) / ROWS;
    int64_t pairs = (panels + 1) / 2, stride = chunks * CHUNK8;
    int8_t *xs = calloc(blocks * ROWS * stride, 1);
    float *row_scale = malloc(N * sizeof(float));
    for (int64_t r = 0; r < N; r++) {
        float most = 0.0f;
        for (int64_t k = 0; k < K; k++) { float a = x[r * K + k] < 0 ? -x[r * K + k] : x[r * K + k]; if (a > most) most = a; }
        float scale = most > 1e-30f ? most / 127.0f : 1e-30f;
        row_scale[r] = scale;
        for (int64_t k = 0; k < K; k++) xs[r * stride + k] = (int8_t)__builtin_rintf(x[r * K + k] / scale);
    }
    #pragma omp parallel num_threads(threads)
    {
        configure();
        int32_t cbuf[ROWS * COLS];
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < pairs; g++) {
            int64_t p0 = 2 * g, p1 = p0 + 1 < panels ? p0 + 1 : p0;
            for (int64_t b = 0; b < blocks; b++) {
                int64_t rows = N - b * ROWS < ROWS ? N - b * ROWS : ROWS;
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t c = 0; c < chunks; c++) {
                    _tile_loadd(4, xs + b * ROWS * stride + c * CHUNK8, stride);
                    _tile_loadd(5, packed + (p0 * chunks + c) * CHUNK8 * COLS, 64);
                    _tile_loadd(6, packed + (p1 * chunks + c) * CHUNK8 * COLS, 64);
                    _tile_dpbssd(0, 4, 5);
                    _tile_dpbssd(1, 4, 6);
                }
                for (int t = 0; t < (p1 == p0 ? 1 : 2); t++) {
                    int64_t p = t ? p1 : p0, width = O - p * COLS < COLS ? O - p * COLS : COLS;
                    if (t == 0) _tile_stored(0, cbuf, COLS * 4); else _tile_stored(1, cbuf, COLS * 4);
                    for (int r = 0; r < rows; r++)
                        for (int n = 0; n < width; n++) {
                            int64_t o = p * COLS + n;
                            y[(b * ROWS + r) * O + o] = (float)cbuf[r * COLS + n] * row_scale[b * ROWS + r] * scales[o]
                                                        + (bias ? bias[o] : 0.0f);
                        }
                }
            }
        }
        _tile_release();
    }
    free(xs);
    free(row_scale);
}
