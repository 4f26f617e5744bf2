// The reference: plain C, one output at a time, the arithmetic of common.h spelled out. Every ISA's
// kernel must equal it bit for bit (tests/test_kernels.py).
#include "common.h"

// q4_k, and q5_k (`five`): its blocks' high bits beside the nibbles.
static inline void k_rows(const int five, int64_t rows, const int8_t *qa, const float *sa, const int16_t *s32,
                          int64_t K, const uint8_t *panel, float *y, int64_t O) {
    const int64_t super = five ? Q5K_SUPER : Q4K_SUPER, block = five ? Q5K_BLOCK : Q4K_BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < PANEL; j++) {
            float acc = 0.0f;
            for (int64_t s = 0; s < supers(K); s++) {
                const uint8_t *sp = panel + s * super;
                uint16_t dh, mh;
                memcpy(&dh, sp + 2 * j, 2);
                memcpy(&mh, sp + 32 + 2 * j, 2);
                float d = half_to_float(dh), dmin = half_to_float(mh), sb = 0.0f;
                int32_t mins = 0;
                for (int b = 0; b < blocks_in(s, K, 8); b++) {
                    const uint8_t *bp = sp + 64 + b * block;
                    int64_t kb = s * 8 + b;
                    const int8_t *a = qa + r * K + kb * 32;
                    int32_t dot = 0;
                    for (int c = 0; c < 4; c++)
                        for (int t = 0; t < 4; t++) {
                            uint8_t byte = bp[32 + c * 64 + j * 4 + t];
                            uint8_t high = five ? bp[288 + j * 4 + t] >> (2 * c) : 0;  // bits 2c and 2c + 1
                            dot += ((byte & 0xF) | (high & 1) << 4) * a[4 * c + t] +
                                   ((byte >> 4) | (high & 2) << 3) * a[16 + 4 * c + t];
                        }
                    sb = fmaf((float)dot, d * (float)bp[j], sb);
                    mins += bp[16 + j] * s32[r * (K / 32) + kb];
                }
                sb = fmaf(-dmin, (float)mins, sb);
                acc = fmaf(sb, sa[r * supers(K) + s], acc);
            }
            y[r * O + j] = acc;
        }
}

#define q4k_rows(rows, qa, sa, s32, o16, K, panel, y, O) k_rows(0, rows, qa, sa, s32, K, panel, y, O)
#define q5k_rows(rows, qa, sa, s32, o16, K, panel, y, O) k_rows(1, rows, qa, sa, s32, K, panel, y, O)

static void q6k_rows(int64_t rows, const int8_t *qa, const float *sa, const int16_t *s32, const int32_t *o16,
                     int64_t K, const uint8_t *panel, float *y, int64_t O) {
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < PANEL; j++) {
            float acc = 0.0f;
            for (int64_t s = 0; s < supers(K); s++) {
                const uint8_t *sp = panel + s * Q6K_SUPER;
                uint16_t dh;
                memcpy(&dh, sp + 2 * j, 2);
                float d = half_to_float(dh), sb = 0.0f;
                for (int b = 0; b < blocks_in(s, K, 16); b++) {
                    const uint8_t *bp = sp + 32 + b * Q6K_BLOCK;
                    int64_t k16 = s * 16 + b;
                    const int8_t *a = qa + r * K + k16 * 16;
                    int32_t dot = o16[r * (K / 16) + k16];
                    for (int g = 0; g < 4; g++)
                        for (int t = 0; t < 4; t++) {
                            uint8_t lo = bp[16 + (g & 1) * 64 + j * 4 + t];
                            int q = ((g < 2 ? lo : lo >> 4) & 0xF) | (((bp[144 + j * 4 + t] >> (2 * g)) & 3) << 4);
                            dot += q * a[4 * g + t];
                        }
                    sb = fmaf((float)dot, d * (float)(int8_t)bp[j], sb);
                }
                acc = fmaf(sb, sa[r * supers(K) + s], acc);
            }
            y[r * O + j] = acc;
        }
}

// q8_b, q4_b and q5_b (`bits` 8, 4, 5): blocks of 32 whose weights are d*q + m, d and m per output (fp32 and f16), q
// a byte less 128 or a nibble in q4_k's layout (with q5_k's high bits).
static inline void blocks32_rows(const int bits, int64_t rows, const int8_t *qa, const float *sa,
                                 const int16_t *s32, int64_t K, const uint8_t *panel, float *y, int64_t O) {
    const int64_t block = bits == 4 ? Q4B_BLOCK : bits == 5 ? Q5B_BLOCK : Q8B_BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < PANEL; j++) {
            float acc = 0.0f;
            for (int64_t s = 0; s < supers(K); s++) {
                float sb = 0.0f;
                for (int b = 0; b < blocks_in(s, K, 8); b++) {
                    const uint8_t *bp = panel + (s * 8 + b) * block;
                    int64_t kb = s * 8 + b;
                    const int8_t *a = qa + r * K + kb * 32;
                    float d, m;
                    int32_t dot = 0;
                    if (bits < 8) {
                        uint16_t dh, mh;
                        memcpy(&dh, bp + 2 * j, 2);
                        memcpy(&mh, bp + 32 + 2 * j, 2);
                        d = half_to_float(dh), m = half_to_float(mh);
                        for (int c = 0; c < 4; c++)
                            for (int t = 0; t < 4; t++) {
                                uint8_t byte = bp[64 + c * 64 + j * 4 + t];
                                uint8_t high = bits == 5 ? bp[320 + j * 4 + t] >> (2 * c) : 0;  // bits 2c, 2c + 1
                                dot += ((byte & 0xF) | (high & 1) << 4) * a[4 * c + t] +
                                       ((byte >> 4) | (high & 2) << 3) * a[16 + 4 * c + t];
                            }
                    } else {
                        memcpy(&d, bp + 4 * j, 4);
                        memcpy(&m, bp + 64 + 4 * j, 4);
                        for (int g = 0; g < 8; g++)
                            for (int t = 0; t < 4; t++) dot += ((int32_t)bp[128 + g * 64 + j * 4 + t] - 128) * a[4 * g + t];
                    }
                    sb = fmaf((float)dot, d, sb);
                    sb = fmaf((float)s32[r * (K / 32) + kb], m, sb);
                }
                acc = fmaf(sb, sa[r * supers(K) + s], acc);
            }
            y[r * O + j] = acc;
        }
}

#define q8b_rows(rows, qa, sa, s32, o16, K, panel, y, O) blocks32_rows(8, rows, qa, sa, s32, K, panel, y, O)
#define q4b_rows(rows, qa, sa, s32, o16, K, panel, y, O) blocks32_rows(4, rows, qa, sa, s32, K, panel, y, O)
#define q5b_rows(rows, qa, sa, s32, o16, K, panel, y, O) blocks32_rows(5, rows, qa, sa, s32, K, panel, y, O)

MATMUL(matmul_q4_k, Q4K_SUPER, Q4K_TAIL, 8, q4k_rows)
MATMUL(matmul_q6_k, Q6K_SUPER, Q6K_TAIL, 8, q6k_rows)
MATMUL(matmul_q8_b, Q8B_SUPER, Q8B_TAIL, 8, q8b_rows)
MATMUL(matmul_q4_b, Q4B_SUPER, Q4B_TAIL, 8, q4b_rows)
MATMUL(matmul_q5_k, Q5K_SUPER, Q5K_TAIL, 8, q5k_rows)
MATMUL(matmul_q5_b, Q5B_SUPER, Q5B_TAIL, 8, q5b_rows)

// layer.h's sum of products, as its bits are defined.
static inline float sum16(const float *a, const float *b, int64_t n) {
    float lanes[16] = {0}, tail = 0.0f;
    int64_t whole = n - n % 16;
    for (int64_t i = 0; i < whole; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += a[i + l] * b[i + l];
    for (int w = 8; w >= 1; w /= 2)  // the lanes pairwise, in a fixed tree
        for (int l = 0; l < w; l++) lanes[l] += lanes[l + w];
    for (int64_t i = whole; i < n; i++) tail += a[i] * b[i];
    return lanes[0] + tail;
}

#include "layer.h"
