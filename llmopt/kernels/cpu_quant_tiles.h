// The tiles of llmopt/kernels/cpu_quant.cpp (see its header): decoders, one tile per format, and
// the loop that splits output rows over OpenMP threads. Included by cpu_quant.cpp only.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace llmopt_cpu_tiles {

// software prefetch distance, in tiles of rows: the hardware prefetchers do not follow NR interleaved
// row streams (a 2-thread GEMV read ~8 GB/s from memory without, ~15 with; 1, 4, 8 measured no better)
constexpr int64_t PF = 2;
// float linears of at most this many rows (8 at most) take f32_rows, a weight row at a time;
// set by llmopt_cpu::tiles_config (llmopt/defaults.py: CPU_F32_STREAM_MAX_ROWS)
inline int64_t f32_stream_rows = 8;
// M > 1: output rows per cache block (a multiple of 4; 32 float rows of 1536 columns are 192 KB, in L2)
constexpr int64_t RB = 32;
// 16-bit weights streamed a row at a time for one row of x: L2 prefetch this many bytes ahead (the
// hardware prefetchers alone read 14-16 GB/s of them where float32 streams at 21-24; 4, 8, 12 and
// 16 KB ahead measured 18, 19-20, 19-20, 20-21 GB/s on the SmolLM2 shapes: noise between the last)
constexpr int64_t PF16 = 12288;

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// The float kernels' decoders: D::at(row, c) gives the 8 values at column c of a row (codes before
// scale and zero, or floats), D::rowb(K) a row's bytes. Formats of B bytes an element take Bytes<B>.
template <int64_t B_>
struct Bytes {
    static constexpr int64_t B = B_;
    static inline int64_t rowb(int64_t K) { return K * B_; }
    static inline int64_t byte(int64_t c) { return c * B_; }   // column c's offset in its row
};

// 8 codes at column c of a row, as floats (before scale and zero)
struct I8 : Bytes<1> {
    static inline __m256 at(const uint8_t* row, int64_t c) {
        __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
};

struct F32 : Bytes<4> {  // float weights (the fused decode layer's unquantized linears): scale 1, one group
    static inline __m256 at(const uint8_t* row, int64_t c) {
        return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + c);
    }
    static inline float one(const uint8_t* row, int64_t c) { return reinterpret_cast<const float*>(row)[c]; }
    static inline void put(const float* x, uint8_t* row, int64_t n) {   // (the KV cache's writes)
        std::copy(x, x + n, reinterpret_cast<float*>(row));
    }
};

// 16-bit float weights, widened exactly to float32 in the loop (f32 accumulation, as F32 sums)
struct BF16 : Bytes<2> {   // bfloat16: the high half of a float32
    static inline __m256 at(const uint8_t* row, int64_t c) {
        __m256i i = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(i, 16));
    }
    static inline float one(const uint8_t* row, int64_t c) {
        uint32_t u = uint32_t(reinterpret_cast<const uint16_t*>(row)[c]) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    // float32 -> bfloat16, rounded to nearest even as torch rounds finite values
    static inline void put(const float* x, uint8_t* row, int64_t n) {
        uint16_t* o = reinterpret_cast<uint16_t*>(row);
        for (int64_t i = 0; i < n; ++i) {
            uint32_t u;
            std::memcpy(&u, x + i, 4);
            o[i] = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        }
    }
};

struct F16 : Bytes<2> {   // IEEE half (F16C, which every AVX2 CPU has)
    static inline __m256 at(const uint8_t* row, int64_t c) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c)));
    }
    static inline float one(const uint8_t* row, int64_t c) { return _cvtsh_ss(reinterpret_cast<const uint16_t*>(row)[c]); }
    static inline void put(const float* x, uint8_t* row, int64_t n) {   // rounded to nearest even
        uint16_t* o = reinterpret_cast<uint16_t*>(row);
        for (int64_t i = 0; i < n; ++i) o[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
    }
};

struct F8 : Bytes<1> {   // e4m3fn bits -> float32 exactly: moved up into f16 bits (value * 2^-8), widened by F16C,
              // times 256. (Building the float32 bits and scaling by 2^120 made the format's subnormals,
              // common in a K/V cache, float32 denormals: a microcode assist each, 0.58x the speed.)
    static inline __m256 at(const uint8_t* row, int64_t c) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                       _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
        return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
    }
};

// 4-bit codes indexing 16 float values (FP4 E2M1, NF4, bitsandbytes' FP4: llmopt/layers/formats/fp4.py,
// whose tables these are, bit for bit) in the int4 layout: per 64-column block b, byte 32b + j holds
// column 64b + j (low nibble) and 64b + 32 + j (high). 8 columns never straddle the halves (c % 8 == 0):
// one load, one shift or mask, and the table as two 8-float halves picked by the code's bit 3.
template <class T>
struct N4 {
    static inline int64_t rowb(int64_t K) { return K / 2; }
    static inline int64_t byte(int64_t c) { return c / 2; }
    static inline __m256 at(const uint8_t* row, int64_t c) {
        const int64_t j = c & 63;
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (c >> 6) * 32 + (j & 31))));
        v = j < 32 ? _mm256_and_si256(v, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(v, 4);
        const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(T::v), v);
        const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(T::v + 8), v);
        return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
    }
};
struct TE2M1 {   // sign, 2 exponent bits, 1 mantissa bit
    static constexpr float v[16] = {0x0p+0f, 0x1p-1f, 0x1p+0f, 0x1.8p+0f, 0x1p+1f, 0x1.8p+1f, 0x1p+2f, 0x1.8p+2f,
                                    -0x0p+0f, -0x1p-1f, -0x1p+0f, -0x1.8p+0f, -0x1p+1f, -0x1.8p+1f, -0x1p+2f, -0x1.8p+2f};
};
struct TNF4 {   // bitsandbytes' NormalFloat4
    static constexpr float v[16] = {-0x1p+0f, -0x1.647362p-1f, -0x1.0cd66p-1f, -0x1.94654p-2f, -0x1.23449ap-2f,
                                    -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0x0p+0f, 0x1.45f5fep-4f, 0x1.4995c6p-3f,
                                    0x1.f809bap-3f, 0x1.5a0674p-2f, 0x1.c3497p-2f, 0x1.200f56p-1f, 0x1.722766p-1f,
                                    0x1p+0f};
};
struct TFP4B {   // bitsandbytes' FP4: (0, 0.0625, 8, 12, 4, 6, 2, 3) / 12, bit 3 the sign
    static constexpr float v[16] = {0x0p+0f, 0x1.555556p-8f, 0x1.555556p-1f, 0x1p+0f, 0x1.555556p-2f, 0x1p-1f,
                                    0x1.555556p-3f, 0x1p-2f, -0x0p+0f, -0x1.555556p-8f, -0x1.555556p-1f, -0x1p+0f,
                                    -0x1.555556p-2f, -0x1p-1f, -0x1.555556p-3f, -0x1p-2f};
};

// 5- and 6-bit codes (GGUF's Q5_x, Q5_K, Q6_K), held at their bits: per 64-column block, the int4
// layout's 32 bytes of nibbles (low nibble column j, high nibble column 32 + j), then 8P bytes of
// their high P = bits - 4 bits: column c's are field c / 8P (P bits at bit P (c / 8P)) of byte
// c % 8P. 32 + 8P bytes a block: 5 or 6 bits a code. So any 8 (P = 1) or 16 (P = 2) consecutive
// columns have theirs in one field of consecutive bytes: one 64-bit shift and a mask decode them.
template <int P>
constexpr int64_t hb_block = 32 + 8 * P;

// the 32 codes (bytes) of 32-column block b of an HB<P> row, less `off` (a zero code taken off: signed)
template <int P>
inline __m256i hb_codes(const uint8_t* row, int64_t b, int off) {
    const uint8_t* blk = row + (b >> 1) * hb_block<P>;
    const int64_t h = b & 1;
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
    v = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    __m256i hi;
    if constexpr (P == 1) {   // 64-bit lane L (columns 8L..8L+7 of the half): bit 4h + L of the 8 bytes
        uint64_t u;
        std::memcpy(&u, blk + 32, 8);
        hi = _mm256_srlv_epi64(_mm256_set1_epi64x((long long)u), _mm256_setr_epi64x(4 * h, 4 * h + 1, 4 * h + 2, 4 * h + 3));
        hi = _mm256_and_si256(hi, _mm256_set1_epi8(1));
    } else {                  // 128-bit lane l (16 columns): bits 2 (2h + l) of the 16 bytes
        hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32)));
        hi = _mm256_srlv_epi64(hi, _mm256_setr_epi64x(4 * h, 4 * h, 4 * h + 2, 4 * h + 2));
        hi = _mm256_and_si256(hi, _mm256_set1_epi8(3));
    }
    v = _mm256_or_si256(v, _mm256_slli_epi16(hi, 4));   // (bits 0-1 of each byte to 4-5: no carry across)
    return off ? _mm256_sub_epi8(v, _mm256_set1_epi8((char)off)) : v;
}

// codes k * 8 .. k * 8 + 7 of a block's 32 (hb_codes, unsigned) as floats
inline __m256 widen8(__m256i q, int k) {
    const __m128i h = k < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((k & 1) ? _mm_srli_si128(h, 8) : h));
}

template <int P>
struct HB {   // the float panels' decoder (SrcQ8) of the HB<P> layout
    static inline int64_t rowb(int64_t K) { return K / 64 * hb_block<P>; }
    static inline __m256 at(const uint8_t* row, int64_t c) {   // c a multiple of 8
        return widen8(hb_codes<P>(row, c >> 5, 0), int((c >> 3) & 3));
    }
};

// A K-quant's group scales (or scaled zeros) as its GGUF holds them: per row, G sub-scales (a byte
// each: Q4_K/Q5_K's 6-bit scales and mins, Q6_K's signed 8-bit scales) then G >> shift fp16
// super-block scales (d, dmin); group g's value d[g >> shift] * sub[g], exact in float32 as the
// file's products are.
struct KScales {
    const uint8_t* p = nullptr;
    int64_t row = 0, G = 0;    // bytes a row: G + 2 (G >> shift)
    int shift = 0;
    bool sgn = false;          // signed sub-scales (Q6_K)
};

struct Args {
    const float* x; int64_t M, K, N, gs, G;
    const float* s; int64_t s_stride;   // scales: row n, group g at s[n * s_stride + g]
    const float* sz;                    // scale * zero [N, G] or nullptr (see zc, kz)
    const float* xsum;                  // per-group sums of x [M, G] (with a zero point)
    float* y;
    int64_t ldy;                        // y's row stride (N, or wider when y is a slice of columns)
    bool half = false;                  // s and sz hold fp16 bits (a GGUF's d and m as stored): read
                                        // through scale_at / szero_at, or widened (run_tiles)
    float zc = 0.f;                     // with sz null, an implied zero code: sz = zc * s per group, as
                                        // llama.cpp derives Q4_0's 8d and Q5_0's 16d (held as the file: d only)
    KScales ks, kz;                     // with ks.p / kz.p set: the scales / scaled zeros as a K-quant
                                        // holds them (s / sz unused), read through Widened only
    int64_t s_row0 = 0;                 // s and sz hold rows from this one on (Widened's buffers)
};

// whether a has a zero-point term (stored, or implied by zc)
inline bool has_zero(const Args& a) { return a.sz != nullptr || a.zc != 0.f || a.kz.p != nullptr; }

// the scale and scaled zero of row n, group g: float32, or fp16 widened as read, an implied zero as
// zc x the scale. K-quant scales (ks, kz) are never read here: every kernel takes them through
// Widened's buffers (a call into a K-quant reader inside the float tiles' loops kept their
// accumulators out of registers: 0.09 -> 0.12 ms for a 3072 x 576 Q4_1 layer)
inline float scale_at(const Args& a, int64_t n, int64_t g) {
    const int64_t i = (n - a.s_row0) * a.s_stride + g;
    return a.half ? _cvtsh_ss(reinterpret_cast<const uint16_t*>(a.s)[i]) : a.s[i];
}
inline float szero_at(const Args& a, int64_t n, int64_t g) {
    if (a.sz == nullptr) return a.zc * scale_at(a, n, g);
    const int64_t i = (n - a.s_row0) * a.G + g;
    return a.half ? _cvtsh_ss(reinterpret_cast<const uint16_t*>(a.sz)[i]) : a.sz[i];
}

// n fp16 values widened to float32 into out, 8 a time by F16C
inline void widen_half(const uint16_t* h, int64_t n, float* out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    for (; i < n; ++i) out[i] = _cvtsh_ss(h[i]);
}

// row n of a K-quant's scales multiplied out into out [G], 8 a time (a super-block is 8 or 16 groups)
inline void widen_k(const KScales& k, int64_t n, float* out) {
    const uint8_t* r = k.p + n * k.row;
    const int64_t per = int64_t(1) << k.shift;
    for (int64_t b = 0; b < (k.G >> k.shift); ++b) {
        uint16_t h;
        std::memcpy(&h, r + k.G + 2 * b, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
        for (int64_t j = 0; j < per; j += 8) {
            const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + b * per + j));
            const __m256i i = k.sgn ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
            _mm256_storeu_ps(out + b * per + j, _mm256_mul_ps(_mm256_cvtepi32_ps(i), d));
        }
    }
}

// Scales read through per-thread buffers: K-quant sub-scales, implied zeros (zc * s) and, where asked,
// fp16 scales made float32 a few rows at a time (buffers that stay in L1); rows(a, c0, c1) gives Args
// that read rows c0..c1 of them as plain float32 (the same values: results are bit for bit the same).
struct Widened {
    std::vector<float> s, z;
    static bool needed(const Args& a, bool half) {
        return a.ks.p != nullptr || a.kz.p != nullptr || (a.sz == nullptr && a.zc != 0.f) || (half && a.half);
    }
    Args rows(const Args& a, int64_t c0, int64_t c1) {
        const int64_t G = a.G, cnt = (c1 - c0) * G;
        s.resize(cnt);
        if (a.ks.p != nullptr) {
            for (int64_t n = c0; n < c1; ++n) widen_k(a.ks, n, s.data() + (n - c0) * G);
        } else if (a.half) {
            widen_half(reinterpret_cast<const uint16_t*>(a.s) + c0 * G, cnt, s.data());
        } else {
            std::memcpy(s.data(), a.s + c0 * G, cnt * sizeof(float));
        }
        Args b = a;
        b.s = s.data();
        b.s_stride = G;
        b.half = false;
        b.ks = KScales{};
        b.s_row0 = c0;
        if (has_zero(a)) {
            z.resize(cnt);
            if (a.kz.p != nullptr) {
                for (int64_t n = c0; n < c1; ++n) widen_k(a.kz, n, z.data() + (n - c0) * G);
            } else if (a.sz != nullptr && a.half) {
                widen_half(reinterpret_cast<const uint16_t*>(a.sz) + c0 * G, cnt, z.data());
            } else if (a.sz != nullptr) {
                std::memcpy(z.data(), a.sz + c0 * G, cnt * sizeof(float));
            } else {
                for (int64_t i = 0; i < cnt; ++i) z[i] = a.zc * s[i];
            }
            b.sz = z.data();
            b.kz = KScales{};
            b.zc = 0.f;
        }
        return b;
    }
};

// per-group sums of x [M, K] for the zero-point term: xsum [M, K / gs]
inline void group_sums(const float* x, int64_t M, int64_t K, int64_t gs, std::vector<float>& xsum) {
    const int64_t G = K / gs;
    xsum.assign(M * G, 0.f);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xsum[m * G + k / gs] += x[m * K + k];
}

// y[m0 + i, n0 + r] = acc[r][i] summed, minus the zero-point term sum_g sz[n, g] * xsum[m, g]
template <int NR, int MT>
inline void store(const Args& a, __m256 (&acc)[NR][MT], int64_t n0, int64_t m0) {
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MT; ++i) {
            float corr = 0.f;
            if (has_zero(a))
                for (int64_t g = 0; g < a.G; ++g) corr += szero_at(a, n0 + r, g) * a.xsum[(m0 + i) * a.G + g];
            a.y[(m0 + i) * a.ldy + n0 + r] = hsum(acc[r][i]) - corr;
        }
}

template <int NR, int MT>
inline void zero(__m256 (&v)[NR][MT]) {
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MT; ++i) v[r][i] = _mm256_setzero_ps();
}

// One float output row for MT (1-8) rows of x (decoding a few sequences, speculative verification):
// the weight row read alone, front to back, every row of x in the one pass: one sequential stream a
// thread, which the hardware prefetchers follow. On the AMD EPYC machine the float linears of a
// SmolLM2 step (540 MB) took 24-26 ms at 1 row with 4 weight rows interleaved (tile8), 12-15 ms so.
// With 2+ rows of x the stream is read more slowly and the prefetchers fall behind, so those rows
// ask for L2 4 weight rows ahead: 3 rows 21-23 -> 13-17 ms, 5 rows 30 -> 16, 8 rows 35 -> 24 (at 1 row
// the hint measured no faster). One FMA chain per x row, as tile8 sums a float row (gs = K): the
// same bits whichever path and however many rows of x (verified drafts get plain decoding's
// logits); 2 or 4 chains a row measured no faster.
// Float weights only (F32, BF16, F16: D decodes 8 of them): their scale is 1 (tile8's s * d adds
// nothing); a 16-bit row decodes to the float32 values a float32 copy would hold, so its sums are
// the float32 copy's bit for bit.
template <class D, int MT>
inline void row_f32(const Args& a, const uint8_t* w, int64_t n, int64_t m0) {
    const int64_t K = a.K;
    const uint8_t* r = w + n * K * D::B;
    const float* x = a.x + m0 * K;
    __m256 acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < K; c += 8) {
        if constexpr (MT > 1 || D::B == 2)   // (16-bit rows at one row of x: PF16 bytes ahead)
            if (((c * D::B) & 63) == 0)
                _mm_prefetch(reinterpret_cast<const char*>(r + (MT > 1 ? 4 * K * D::B : PF16) + c * D::B), _MM_HINT_T1);
        __m256 wv = D::at(r, c);
        for (int i = 0; i < MT; ++i) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * K + c), acc[i]);
    }
    for (int i = 0; i < MT; ++i) a.y[(m0 + i) * a.ldy + n] = hsum(acc[i]);
}

// Rows n0..n0+NR of the output for x rows m0..m0+MT; int8 / fp8 codes or floats, K a multiple of 8.
template <class D, int NR, int MT>
inline void tile8(const Args& a, const uint8_t* w, int64_t n0, int64_t m0) {
    const int64_t K = a.K, RB = D::rowb(K);   // bytes per row
    const uint8_t* row[NR];
    for (int r = 0; r < NR; ++r) row[r] = w + (n0 + r) * RB;
    const float* x = a.x + m0 * K;
    __m256 acc[NR][MT];
    zero(acc);
    for (int64_t g = 0, c0 = 0; c0 < K; ++g, c0 += a.gs) {
        __m256 d[NR][MT];
        zero(d);
        for (int64_t c = c0; c < c0 + a.gs; c += 8) {
            if ((D::byte(c) & 63) == 0)   // each cache line of this tile's rows, PF tiles ahead (x2 streamed GB/s)
                for (int r = 0; r < NR; ++r)
                    _mm_prefetch(reinterpret_cast<const char*>(row[r] + PF * NR * RB + D::byte(c)), _MM_HINT_T0);
            __m256 xv[MT];
            for (int i = 0; i < MT; ++i) xv[i] = _mm256_loadu_ps(x + i * K + c);
            for (int r = 0; r < NR; ++r) {
                __m256 wv = D::at(row[r], c);
                for (int i = 0; i < MT; ++i) d[r][i] = _mm256_fmadd_ps(wv, xv[i], d[r][i]);
            }
        }
        for (int r = 0; r < NR; ++r) {
            __m256 sv = _mm256_set1_ps(scale_at(a, n0 + r, g));
            for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_fmadd_ps(sv, d[r][i], acc[r][i]);
        }
    }
    store<NR, MT>(a, acc, n0, m0);
}

// int4 tiles, at the end of a group of 64-column blocks: acc += s_g * (lo + hi), or with groups of 32
// (two groups per block) acc += s_2b * lo + s_2b+1 * hi
template <int NR, int MT>
inline void add_scaled_halves(const Args& a, __m256 (&acc)[NR][MT], __m256 (&lo)[NR][MT], __m256 (&hi)[NR][MT],
                              int64_t n0, int64_t b0, int64_t g, bool two) {   // g: b0's group (no division here)
    for (int r = 0; r < NR; ++r) {
        const int64_t n = n0 + r;
        if (two) {
            __m256 sl = _mm256_set1_ps(scale_at(a, n, 2 * b0)), sh = _mm256_set1_ps(scale_at(a, n, 2 * b0 + 1));
            for (int i = 0; i < MT; ++i)
                acc[r][i] = _mm256_fmadd_ps(sh, hi[r][i], _mm256_fmadd_ps(sl, lo[r][i], acc[r][i]));
        } else {
            __m256 sv = _mm256_set1_ps(scale_at(a, n, g));
            for (int i = 0; i < MT; ++i)
                acc[r][i] = _mm256_fmadd_ps(sv, _mm256_add_ps(lo[r][i], hi[r][i]), acc[r][i]);
        }
    }
}

// int4, grouped nibble layout: per 64-column block b, byte 32b + j holds column 64b + j (low nibble)
// and 64b + 32 + j (high). Group size a multiple of 32: with 32, the halves belong to two groups.
template <int NR, int MT>
inline void tile4(const Args& a, const uint8_t* w, int64_t n0, int64_t m0) {
    const int64_t K = a.K, B = K / 64;
    const uint8_t* row[NR];
    for (int r = 0; r < NR; ++r) row[r] = w + (n0 + r) * (K / 2);
    const float* x = a.x + m0 * K;
    const bool two = a.gs == 32;
    const int64_t bpg = two ? 1 : a.gs / 64;   // blocks per group (two groups per block when gs == 32)
    const __m256i mask = _mm256_set1_epi32(0xF);
    __m256 acc[NR][MT];
    zero(acc);
    for (int64_t b0 = 0, g = 0; b0 < B; b0 += bpg, ++g) {
        __m256 lo[NR][MT], hi[NR][MT];
        zero(lo);
        zero(hi);
        for (int64_t b = b0; b < b0 + bpg; ++b)
            for (int j = 0; j < 32; j += 8) {
                if (j == 0)
                    for (int r = 0; r < NR; ++r)
                        _mm_prefetch(reinterpret_cast<const char*>(row[r] + PF * NR * (K / 2) + 32 * b), _MM_HINT_T0);
                __m256 xl[MT], xh[MT];
                for (int i = 0; i < MT; ++i) {
                    xl[i] = _mm256_loadu_ps(x + i * K + 64 * b + j);
                    xh[i] = _mm256_loadu_ps(x + i * K + 64 * b + 32 + j);
                }
                for (int r = 0; r < NR; ++r) {
                    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row[r] + 32 * b + j)));
                    __m256 wl = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
                    __m256 wh = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                    for (int i = 0; i < MT; ++i) {
                        lo[r][i] = _mm256_fmadd_ps(wl, xl[i], lo[r][i]);
                        hi[r][i] = _mm256_fmadd_ps(wh, xh[i], hi[r][i]);
                    }
                }
            }
        add_scaled_halves<NR, MT>(a, acc, lo, hi, n0, b0, g, two);
    }
    store<NR, MT>(a, acc, n0, m0);
}

// 5- and 6-bit codes (HB<P>): tile8's sums, each 32-column block's codes decoded to bytes once
// (hb_codes) and widened 8 at a time
template <int P, int NR, int MT>
inline void tile_hb(const Args& a, const uint8_t* w, int64_t n0, int64_t m0) {
    const int64_t K = a.K, RB = HB<P>::rowb(K);
    const uint8_t* row[NR];
    for (int r = 0; r < NR; ++r) row[r] = w + (n0 + r) * RB;
    const float* x = a.x + m0 * K;
    __m256 acc[NR][MT], d[NR][MT];
    zero(acc);
    zero(d);
    for (int64_t b = 0, g = 0, end = a.gs; b < K / 32; ++b) {   // end: group g's last column + 1
        if ((b & 1) == 0)
            for (int r = 0; r < NR; ++r)
                _mm_prefetch(reinterpret_cast<const char*>(row[r] + PF * NR * RB + (b >> 1) * hb_block<P>), _MM_HINT_T0);
        __m256i q[NR];
        for (int r = 0; r < NR; ++r) q[r] = hb_codes<P>(row[r], b, 0);
        for (int k = 0; k < 4; ++k) {
            const int64_t c = 32 * b + 8 * k;
            __m256 xv[MT];
            for (int i = 0; i < MT; ++i) xv[i] = _mm256_loadu_ps(x + i * K + c);
            for (int r = 0; r < NR; ++r) {
                const __m256 wv = widen8(q[r], k);
                for (int i = 0; i < MT; ++i) d[r][i] = _mm256_fmadd_ps(wv, xv[i], d[r][i]);
            }
            if (c + 8 == end) {   // the group's end
                for (int r = 0; r < NR; ++r) {
                    const __m256 sv = _mm256_set1_ps(scale_at(a, n0 + r, g));
                    for (int i = 0; i < MT; ++i) {
                        acc[r][i] = _mm256_fmadd_ps(sv, d[r][i], acc[r][i]);
                        d[r][i] = _mm256_setzero_ps();
                    }
                }
                ++g;
                end += a.gs;
            }
        }
    }
    store<NR, MT>(a, acc, n0, m0);
}

// One kernel over all rows: KERNEL<NR, MT>(args, w, n0, m0). M == 1 (decode) takes 4 output rows at a
// time (4 independent FMA chains share each x load); M == 2 two rows by two; else 1 row by up to 4.
template <int NR, int MT, class Fn>
inline void rows(const Args& a, int64_t n0, int64_t n1, int64_t m0, Fn fn) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) fn.template operator()<NR, MT>(a, n, m0);
    for (; n < n1; ++n) fn.template operator()<1, MT>(a, n, m0);
}

// body(n0, n1) on each thread's contiguous range of the N output rows, aligned to `align` rows
template <class Body>
inline void split_rows(int64_t N, Body body, int64_t align = 4) {
#pragma omp parallel
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        int t = 0, T = 1;
#endif
        int64_t per = ((N + T - 1) / T + align - 1) / align * align;
        int64_t n0 = std::min<int64_t>(N, t * per), n1 = std::min<int64_t>(N, n0 + per);
        if (n0 < n1) body(n0, n1);
    }
}

// Float weights [N, K] (D: F32, BF16, F16) for 1 to 8 rows of x: row_f32 over every output row (no
// rows: nothing)
template <class D>
inline void f32_rows(const Args& a, const uint8_t* w) {
    split_rows(a.N, [&](int64_t n0, int64_t n1) {
        auto each = [&](auto mt) {
            for (int64_t n = n0; n < n1; ++n) row_f32<D, decltype(mt)::value>(a, w, n, 0);
        };
        switch (a.M) {
            case 1: each(std::integral_constant<int, 1>{}); break;
            case 2: each(std::integral_constant<int, 2>{}); break;
            case 3: each(std::integral_constant<int, 3>{}); break;
            case 4: each(std::integral_constant<int, 4>{}); break;
            case 5: each(std::integral_constant<int, 5>{}); break;
            case 6: each(std::integral_constant<int, 6>{}); break;
            case 7: each(std::integral_constant<int, 7>{}); break;
            case 8: each(std::integral_constant<int, 8>{}); break;
            default: break;
        }
    });
}

template <class Fn>
void run_rows(const Args& a, int64_t n0, int64_t n1, Fn fn) {   // rows n0..n1 of one thread
    if (a.M == 1) {
        rows<4, 1>(a, n0, n1, 0, fn);
        return;
    }
    for (int64_t b0 = n0; b0 < n1; b0 += RB) {   // a block of RB rows stays in cache while every 4 rows of x pass over it
        const int64_t b1 = std::min(n1, b0 + RB);
        int64_t m = 0;
        for (; m + 4 <= a.M; m += 4) rows<1, 4>(a, b0, b1, m, fn);
        switch (a.M - m) {
            case 3: rows<1, 3>(a, b0, b1, m, fn); break;
            case 2: rows<2, 2>(a, b0, b1, m, fn); break;
            case 1: rows<4, 1>(a, b0, b1, m, fn); break;
            default: break;
        }
    }
}

template <class Fn>
void run(const Args& a0, Fn fn) {
    if (!Widened::needed(a0, false)) {
        split_rows(a0.N, [&](int64_t n0, int64_t n1) { run_rows(a0, n0, n1, fn); });
        return;
    }
    split_rows(a0.N, [&](int64_t n0, int64_t n1) {   // K-quant scales, implied zeros: float32 64 rows at a time
        Widened wb;
        for (int64_t c0 = n0; c0 < n1; c0 += 64) {
            const int64_t c1 = std::min(n1, c0 + 64);
            run_rows(wb.rows(a0, c0, c1), c0, c1, fn);
        }
    });
}

// Float GEMM for many rows (the decode layer's linears with float activations and the float head at
// M >= f32_panel_rows): y[M, N] (row stride ldy) = x[M, K] @ W[N, K]^T. Panels of 16 output columns:
// a K-chunk of the panel's 16 weight rows (quantized ones decoded to floats first) is transposed
// into a per-thread buffer (16 floats per k, two ymm), then 6 rows of x at a time take 12
// accumulators (BLIS's 6 x 16 register block: per k, 2 loads, 6 broadcasts, 12 FMAs). Each output
// sums k in order within a chunk of FK and adds the chunks in order: independent of M, N and threads.
constexpr int64_t FN = 16, FK = 256;

template <int MR>
inline void f32_block(const float* x, int64_t K, const float* wp, int64_t kc, float* y, int64_t ldy, int64_t nr,
                      bool add) {
    __m256 c0[MR], c1[MR];
    for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 w0 = _mm256_loadu_ps(wp + k * FN), w1 = _mm256_loadu_ps(wp + k * FN + 8);
        for (int i = 0; i < MR; ++i) {
            const __m256 xb = _mm256_set1_ps(x[i * K + k]);
            c0[i] = _mm256_fmadd_ps(xb, w0, c0[i]);
            c1[i] = _mm256_fmadd_ps(xb, w1, c1[i]);
        }
    }
    for (int i = 0; i < MR; ++i) {
        float* yr = y + i * ldy;
        if (nr == FN) {
            if (add) {
                c0[i] = _mm256_add_ps(_mm256_loadu_ps(yr), c0[i]);
                c1[i] = _mm256_add_ps(_mm256_loadu_ps(yr + 8), c1[i]);
            }
            _mm256_storeu_ps(yr, c0[i]);
            _mm256_storeu_ps(yr + 8, c1[i]);
        } else {
            float t[FN];
            _mm256_storeu_ps(t, c0[i]);
            _mm256_storeu_ps(t + 8, c1[i]);
            for (int64_t r = 0; r < nr; ++r) yr[r] = add ? yr[r] + t[r] : t[r];
        }
    }
}

// The same block with AVX-512 (where the CPU has it, f32_avx512) over two panels at once: a k's 16
// weights of each in one zmm, 6 rows of x take 12 accumulators (per k, 2 loads, 6 broadcasts, 12
// FMAs). Each lane sums its k in the same order as f32_block: the same bits, twice the FMA width.
inline bool f32_avx512 = false;   // set by tiles_config (cpu_decode.cpp)

__attribute__((target("avx512f"))) inline void f32_store16(__m512 c, float* yr, int64_t nr, bool add) {
    if (nr == FN) {
        if (add) c = _mm512_add_ps(_mm512_loadu_ps(yr), c);
        _mm512_storeu_ps(yr, c);
    } else {
        float t[FN];
        _mm512_storeu_ps(t, c);
        for (int64_t r = 0; r < nr; ++r) yr[r] = add ? yr[r] + t[r] : t[r];
    }
}

// nb: the second panel's rows (0: none; its buffer is not read)
template <int MR>
__attribute__((target("avx512f"))) void f32_block32(const float* x, int64_t K, const float* wa, const float* wb,
                                                    int64_t kc, float* y, int64_t ldy, int64_t na, int64_t nb, bool add) {
    __m512 c0[MR], c1[MR];
    for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
    if (nb > 0)
        for (int64_t k = 0; k < kc; ++k) {
            const __m512 w0 = _mm512_loadu_ps(wa + k * FN), w1 = _mm512_loadu_ps(wb + k * FN);
            for (int i = 0; i < MR; ++i) {
                const __m512 xb = _mm512_set1_ps(x[i * K + k]);
                c0[i] = _mm512_fmadd_ps(xb, w0, c0[i]);
                c1[i] = _mm512_fmadd_ps(xb, w1, c1[i]);
            }
        }
    else
        for (int64_t k = 0; k < kc; ++k) {
            const __m512 w0 = _mm512_loadu_ps(wa + k * FN);
            for (int i = 0; i < MR; ++i) c0[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k]), w0, c0[i]);
        }
    for (int i = 0; i < MR; ++i) {
        f32_store16(c0[i], y + i * ldy, na, add);
        if (nb > 0) f32_store16(c1[i], y + i * ldy + FN, nb, add);
    }
}

// rows [0, M) of a pair of panels' chunk, 6 at a time, the last few by the block of their count
template <int MR = 10>
void f32_rows32(int64_t M, const float* x, int64_t K, const float* wa, const float* wb, int64_t kc, float* y,
                int64_t ldy, int64_t na, int64_t nb, bool add) {
    if constexpr (MR == 10) {
        for (; M >= 10; M -= 10, x += 10 * K, y += 10 * ldy) f32_block32<10>(x, K, wa, wb, kc, y, ldy, na, nb, add);
    }
    if (M == MR) f32_block32<MR>(x, K, wa, wb, kc, y, ldy, na, nb, add);
    else if constexpr (MR > 1) f32_rows32<MR - 1>(M, x, K, wa, wb, kc, y, ldy, na, nb, add);
}

// an 8 x 8 transpose of 32-bit lanes in place: r[j] becomes column j (lanes are moved, never computed
// on, so integer data passes through as well)
inline void transpose8(__m256 (&r)[8]) {
    __m256 t[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {   // r[j]: column j (lane 0) / j + 4 (lane 1) of rows 0-3; r[4 + j]: rows 4-7
        t[j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x20);
        t[j + 4] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x31);
    }
    for (int j = 0; j < 8; ++j) r[j] = t[j];
}

// wp[k * 16 + r] = w[r * K + k] for r < nr (else 0), k < kc: 8 x 8 transposes where whole
inline void pack_f32(const float* w, int64_t K, int64_t nr, int64_t kc, float* wp) {
    int64_t k = 0;
    if (nr == FN)
        for (; k + 8 <= kc; k += 8)
            for (int h = 0; h < 2; ++h) {
                __m256 r[8];
                for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(w + (8 * h + i) * K + k);
                transpose8(r);
                for (int j = 0; j < 8; ++j) _mm256_storeu_ps(wp + (k + j) * FN + 8 * h, r[j]);
            }
    for (; k < kc; ++k)
        for (int64_t r = 0; r < FN; ++r) wp[k * FN + r] = r < nr ? w[r * K + k] : 0.f;
}

// the panels' weight sources: src(a, n0, nr, k0, kc, wp, tmp) fills wp as pack_f32 does
struct SrcF32 {   // float weights [N, K]
    const float* w;
    void operator()(const Args& a, int64_t n0, int64_t nr, int64_t k0, int64_t kc, float* wp, float*) const {
        pack_f32(w + n0 * a.K + k0, a.K, nr, kc, wp);
    }
};

// quantized weights decoded to floats, (code * s - sz) per group, row by row into tmp [16, FK]
template <class D>
struct SrcQ8 {   // int8 / fp8 codes [N, K], 5- and 6-bit ones (HB); 16-bit floats too (scale 1, no zero)
    const uint8_t* w;
    void operator()(const Args& a, int64_t n0, int64_t nr, int64_t k0, int64_t kc, float* wp, float* tmp) const {
        for (int64_t r = 0; r < nr; ++r) {
            const int64_t n = n0 + r;
            const uint8_t* row = w + n * D::rowb(a.K);
            for (int64_t k = k0; k < k0 + kc; k += 8) {
                const int64_t g = k / a.gs;
                __m256 v = _mm256_mul_ps(D::at(row, k), _mm256_set1_ps(scale_at(a, n, g)));
                if (has_zero(a)) v = _mm256_sub_ps(v, _mm256_set1_ps(szero_at(a, n, g)));
                _mm256_storeu_ps(tmp + r * FK + k - k0, v);
            }
        }
        pack_f32(tmp, FK, nr, kc, wp);
    }
};

struct SrcQ4 {   // the int4 layout [N, K / 2]; k0 and kc multiples of 64
    const uint8_t* w;
    void operator()(const Args& a, int64_t n0, int64_t nr, int64_t k0, int64_t kc, float* wp, float* tmp) const {
        const __m256i mask = _mm256_set1_epi32(0xF);
        for (int64_t r = 0; r < nr; ++r) {
            const int64_t n = n0 + r;
            const uint8_t* row = w + n * (a.K / 2);
            for (int64_t c = k0; c < k0 + kc; c += 64)
                for (int h = 0; h < 2; ++h) {   // low nibbles: columns c..c+31; high: c+32..c+63
                    const int64_t g = (c + 32 * h) / a.gs;
                    const __m256 sv = _mm256_set1_ps(scale_at(a, n, g));
                    const __m256 zv = _mm256_set1_ps(has_zero(a) ? szero_at(a, n, g) : 0.f);
                    for (int j = 0; j < 32; j += 8) {
                        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2 + j)));
                        v = h ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, mask);
                        _mm256_storeu_ps(tmp + r * FK + c + 32 * h + j - k0, _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), sv), zv));
                    }
                }
        }
        pack_f32(tmp, FK, nr, kc, wp);
    }
};

// y = x @ W^T over a.M rows (a.x, a.y, a.ldy), W from src a K-chunk of 16 rows at a time
template <class Src>
void f32_panels(const Args& a0, Src src) {
    const int64_t M = a0.M, K = a0.K, N = a0.N, P = (N + FN - 1) / FN;
    const bool wide = Widened::needed(a0, false);
    if (f32_avx512) {   // pairs of panels
#pragma omp parallel
        {
            std::vector<float> wa(FK * FN), wb(FK * FN), tmp(FK * FN);
            Widened wd;
#pragma omp for schedule(static)
            for (int64_t pp = 0; pp < (P + 1) / 2; ++pp) {
                const int64_t n0 = pp * 2 * FN, na = std::min<int64_t>(FN, N - n0), nb = std::min<int64_t>(FN, N - n0 - FN);
                const Args a = wide ? wd.rows(a0, n0, n0 + na + std::max<int64_t>(nb, 0)) : a0;
                for (int64_t k0 = 0; k0 < K; k0 += FK) {
                    const int64_t kc = std::min<int64_t>(FK, K - k0);
                    src(a, n0, na, k0, kc, wa.data(), tmp.data());
                    if (nb > 0) src(a, n0 + FN, nb, k0, kc, wb.data(), tmp.data());
                    f32_rows32(M, a.x + k0, K, wa.data(), wb.data(), kc, a.y + n0, a.ldy, na, nb, k0 > 0);
                }
            }
        }
        return;
    }
#pragma omp parallel
    {
        std::vector<float> wp(FK * FN), tmp(FK * FN);
        Widened wb;
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < P; ++pi) {
            const int64_t n0 = pi * FN, nr = std::min<int64_t>(FN, N - n0);
            const Args a = wide ? wb.rows(a0, n0, n0 + nr) : a0;   // (K-quant scales, implied zeros)
            for (int64_t k0 = 0; k0 < K; k0 += FK) {
                const int64_t kc = std::min<int64_t>(FK, K - k0);
                src(a, n0, nr, k0, kc, wp.data(), tmp.data());
                int64_t m = 0;
                const float* x = a.x + k0;
                float* y = a.y + n0;
                const bool add = k0 > 0;
                for (; m + 6 <= M; m += 6) f32_block<6>(x + m * K, K, wp.data(), kc, y + m * a.ldy, a.ldy, nr, add);
                switch (M - m) {
                    case 5: f32_block<5>(x + m * K, K, wp.data(), kc, y + m * a.ldy, a.ldy, nr, add); break;
                    case 4: f32_block<4>(x + m * K, K, wp.data(), kc, y + m * a.ldy, a.ldy, nr, add); break;
                    case 3: f32_block<3>(x + m * K, K, wp.data(), kc, y + m * a.ldy, a.ldy, nr, add); break;
                    case 2: f32_block<2>(x + m * K, K, wp.data(), kc, y + m * a.ldy, a.ldy, nr, add); break;
                    case 1: f32_block<1>(x + m * K, K, wp.data(), kc, y + m * a.ldy, a.ldy, nr, add); break;
                    default: break;
                }
            }
        }
    }
}

// a float buffer grown as needed, never initialized (a thread's scratch reused across calls)
struct Grown {
    std::unique_ptr<float[]> p;
    int64_t n = 0;
    float* get(int64_t m) {
        if (m > n) {
            p.reset(new float[m]);
            n = m;
        }
        return p.get();
    }
};

// The float GEMM for float32 weights at up to a few blocks of 64 rows (AVX-512), with the roles
// turned: W's rows are read as stored and broadcast a float at a time, x is the packed operand
// (xt [M / 64][K][64], transposed once per call; a k's 64 rows are 4 zmm). 6 weight rows x 4 zmm of
// rows take 24 accumulators (per k, 4 loads, 6 broadcasts, 24 FMAs) and no weight is ever
// repacked: the float panels' transposes of each streamed weight are gone. A thread takes 48
// weight rows (8 tiles) over all of K at a time, collects their outputs in a [48][64 * blocks]
// buffer and transposes it into y. Each output sums k in order within a chunk of FK and adds the
// chunks in order, as f32_panels does: the same bits. A chunk runs in passes of BK k for the unit's
// 8 tiles, a tile's partial sums kept exactly between passes, so that the pass's x stays in L1.
constexpr int64_t BM = 64;   // rows of x a block
constexpr int64_t BR = 6;    // weight rows a tile
constexpr int64_t BPF = 48;  // floats ahead that a tile prefetches its weight rows (32-64 alike on Ice Lake)

constexpr int64_t BK = 128; // k a pass: a block's 64 x 128 floats of x (32 KB) stay in L1 over a unit's tiles
constexpr int64_t BU = 8;    // tiles a thread's unit

// acc: the tile's partial sums between the passes of a chunk (first: the chunk's first pass, from
// zero); last: the chunk's last pass, its sums into yt (added to it with add), else kept in acc
template <int MV>
__attribute__((target("avx512f"))) void bcast_tile(const float* w, int64_t K, int64_t nr, const float* xt,
                                                   int64_t kc, float* acc, bool first, bool last, float* yt,
                                                   int64_t ldt, bool add) {
    const float* r[BR];
    for (int i = 0; i < BR; ++i) r[i] = w + std::min<int64_t>(i, nr - 1) * K;   // past N: the last row again
    __m512 c[BR][MV];
    for (int i = 0; i < BR; ++i)
        for (int v = 0; v < MV; ++v) c[i][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (i * 4 + v) * 16);
    int64_t k = 0;
    for (; k < kc; ++k) {
        if ((k & 15) == 0)   // a cache line of each row: the one BPF floats on asked for first
            for (int i = 0; i < BR; ++i) _mm_prefetch(reinterpret_cast<const char*>(r[i] + k + BPF), _MM_HINT_T0);
        __m512 xv[MV];
        for (int v = 0; v < MV; ++v) xv[v] = _mm512_loadu_ps(xt + k * BM + 16 * v);
        for (int i = 0; i < BR; ++i) {
            const __m512 wb = _mm512_set1_ps(r[i][k]);
            for (int v = 0; v < MV; ++v) c[i][v] = _mm512_fmadd_ps(wb, xv[v], c[i][v]);
        }
    }
    for (int i = 0; i < BR; ++i)
        for (int v = 0; v < MV; ++v) {
            if (!last) {
                _mm512_storeu_ps(acc + (i * 4 + v) * 16, c[i][v]);
                continue;
            }
            float* o = yt + i * ldt + 16 * v;
            _mm512_storeu_ps(o, add ? _mm512_add_ps(_mm512_loadu_ps(o), c[i][v]) : c[i][v]);
        }
}

// out[j * ldo + i] = in[i * ldi + j] for i < ni, j < nj: 8 x 8 blocks where whole
inline void transpose_f32(const float* in, int64_t ldi, int64_t ni, int64_t nj, float* out, int64_t ldo) {
    int64_t i = 0;
    for (; i + 8 <= ni; i += 8) {
        int64_t j = 0;
        for (; j + 8 <= nj; j += 8) {
            __m256 r[8];
            for (int q = 0; q < 8; ++q) r[q] = _mm256_loadu_ps(in + (i + q) * ldi + j);
            transpose8(r);
            for (int q = 0; q < 8; ++q) _mm256_storeu_ps(out + (j + q) * ldo + i, r[q]);
        }
        for (; j < nj; ++j)
            for (int q = 0; q < 8; ++q) out[j * ldo + i + q] = in[(i + q) * ldi + j];
    }
    for (; i < ni; ++i)
        for (int64_t j = 0; j < nj; ++j) out[j * ldo + i] = in[i * ldi + j];
}

// y = x @ W^T, W float32 [N, K] as stored; K a multiple of 8
inline void f32_bcast(const Args& a, const float* w) {
    const int64_t M = a.M, K = a.K, N = a.N, B = (M + BM - 1) / BM, ldt = B * BM;
    const int64_t units = (N + BU * BR - 1) / (BU * BR);   // 48 weight rows, all of K, by one thread
    static thread_local Grown xbuf;   // the calling thread's
    float* const xt = xbuf.get(B * K * BM);
#pragma omp parallel
    {
        const int64_t KB = (K + BM - 1) / BM;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < B * KB; ++i) {   // xt[b][k][j] = x[64b + j][k], rows past M zero; 64 k a task
            const int64_t b = i / KB, k0 = i % KB * BM, kn = std::min(BM, K - k0), rows = std::min(BM, M - b * BM);
            float* o = xt + (b * K + k0) * BM;
            transpose_f32(a.x + b * BM * K + k0, K, rows, kn, o, BM);
            if (rows < BM)
                for (int64_t k = 0; k < kn; ++k) std::fill(o + k * BM + rows, o + (k + 1) * BM, 0.f);
        }
        static thread_local Grown ubuf, abuf;   // this thread's unit of outputs [48][ldt]; partial sums
        float* const yt = ubuf.get(BU * BR * ldt);
        float* const acc = abuf.get(BU * B * BR * BM);
#pragma omp for schedule(dynamic, 1)   // units taken as threads come free: a slower core takes fewer
        for (int64_t u = 0; u < units; ++u) {
            const int64_t n0 = u * BU * BR, n1 = std::min(N, n0 + BU * BR);
            for (int64_t k0 = 0; k0 < K; k0 += FK) {   // chunks of FK, each in passes of BK
                const int64_t k1 = std::min<int64_t>(k0 + FK, K);
                for (int64_t s = k0; s < k1; s += BK) {
                    const int64_t kc = std::min<int64_t>(BK, k1 - s);
                    for (int64_t n = n0; n < n1; n += BR) {
                        const int64_t nr = std::min<int64_t>(BR, N - n);
                        for (int64_t b = 0; b < B; ++b) {
                            const float* xb = xt + (b * K + s) * BM;
                            float* yb = yt + (n - n0) * ldt + b * BM;
                            float* ab = acc + ((n - n0) / BR * B + b) * BR * BM;
                            const int64_t mv = std::min<int64_t>(4, (M - b * BM + 15) / 16);
                            const float* wn = w + n * K + s;
                            const bool first = s == k0, last = s + kc == k1, add = k0 > 0;
                            if (mv == 4) bcast_tile<4>(wn, K, nr, xb, kc, ab, first, last, yb, ldt, add);
                            else if (mv == 3) bcast_tile<3>(wn, K, nr, xb, kc, ab, first, last, yb, ldt, add);
                            else if (mv == 2) bcast_tile<2>(wn, K, nr, xb, kc, ab, first, last, yb, ldt, add);
                            else bcast_tile<1>(wn, K, nr, xb, kc, ab, first, last, yb, ldt, add);
                        }
                    }
                }
            }
            transpose_f32(yt, ldt, n1 - n0, M, a.y + n0, a.ldy);   // the unit's outputs while in L1
        }
    }
}

template <class D>
struct Fn8 {
    const uint8_t* w;
    template <int NR, int MT>
    void operator()(const Args& a, int64_t n, int64_t m) const { tile8<D, NR, MT>(a, w, n, m); }
};

template <int P>
struct FnHB {
    const uint8_t* w;
    template <int NR, int MT>
    void operator()(const Args& a, int64_t n, int64_t m) const { tile_hb<P, NR, MT>(a, w, n, m); }
};

struct Fn4 {
    const uint8_t* w;
    template <int NR, int MT>
    void operator()(const Args& a, int64_t n, int64_t m) const { tile4<NR, MT>(a, w, n, m); }
};

}  // namespace llmopt_cpu_tiles
