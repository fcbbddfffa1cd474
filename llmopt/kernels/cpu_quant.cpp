// CPU GEMV/GEMM kernels for quantized weights: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, float32
// activations and accumulation, the weight decoded inside the loop (never materialized in float).
// Built on first use by llmopt/kernels/cpu_quant.py (torch.utils.cpp_extension), registered as
// torch.ops.llmopt.* so eager code and torch.compile graphs call them the same way.
//
// Weight layouts (prepared once at load by llmopt/quant/modules*.py):
// - w8: int8 codes c [N, K]; W[n, k] = (c - z') * s with per-group s, and sz = s * z' [N, G].
// - w4: uint8 [N, K / 2], 64-column blocks: byte 32b + j holds column 64b + j in its low nibble and
//       column 64b + 32 + j in its high nibble (no interleave to undo); W = (q - z) * s, sz = s * z.
// - f8: float8 e4m3fn bytes [N, K], one scale per row (or one for all); W = f8 * s.
// With groups, sum_k x W = sum_g s_g (sum_{k in g} x_k q_k) - sum_g sz_g (sum_{k in g} x_k): the
// second term uses the per-group sums of x, computed once per call.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int MT = 4;   // rows of x per tile: each decoded weight vector is used MT times

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// 8 weights starting at column c of a row, as floats (the code only, before scale and zero).
struct DecodeI8 {
    const int8_t* row;
    inline __m256 operator()(int64_t c) const {
        __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
};

struct DecodeF8 {   // e4m3fn bits -> float32 exactly: move sign/exponent/mantissa into place, times 2^120
    const uint8_t* row;
    inline __m256 operator()(int64_t c) const {
        __m256i i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
        __m256i sign = _mm256_slli_epi32(_mm256_and_si256(i, _mm256_set1_epi32(0x80)), 24);
        __m256i em = _mm256_slli_epi32(_mm256_and_si256(i, _mm256_set1_epi32(0x7F)), 20);
        __m256 f = _mm256_castsi256_ps(_mm256_or_si256(em, sign));
        return _mm256_mul_ps(f, _mm256_set1_ps(1.329227995784916e36f));   // 2^120
    }
};

struct DecodeI4 {   // column c (a multiple of 8) of the grouped nibble layout
    const uint8_t* row;
    inline __m256 operator()(int64_t c) const {
        int64_t blk = c >> 6, j = c & 63;
        const uint8_t* p = row + blk * 32 + (j & 31);
        __m256i i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        if (j >= 32) i = _mm256_srli_epi32(i, 4);
        return _mm256_cvtepi32_ps(_mm256_and_si256(i, _mm256_set1_epi32(0xF)));
    }
};

// One output row n for rows m0..m0+mt of x. Groups of gs columns (gs a multiple of 8).
template <class D>
inline void row_tile(const D& dec, const float* x, int64_t ldx, int64_t m0, int mt, int64_t K, int64_t gs,
                     const float* s, const float* sz, const float* xsum, int64_t G, float* y, int64_t ldy,
                     int64_t n) {
    __m256 acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0, c0 = 0; c0 < K; ++g, c0 += gs) {
        __m256 d[MT];
        for (int i = 0; i < MT; ++i) d[i] = _mm256_setzero_ps();
        for (int64_t c = c0; c < c0 + gs; c += 8) {
            __m256 w = dec(c);
            for (int i = 0; i < mt; ++i)
                d[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (m0 + i) * ldx + c), d[i]);
        }
        __m256 sv = _mm256_set1_ps(s[g]);
        for (int i = 0; i < mt; ++i) acc[i] = _mm256_fmadd_ps(sv, d[i], acc[i]);
    }
    for (int i = 0; i < mt; ++i) {
        float corr = 0.f;
        if (sz != nullptr)
            for (int64_t g = 0; g < G; ++g) corr += sz[g] * xsum[(m0 + i) * G + g];
        y[(m0 + i) * ldy + n] = hsum(acc[i]) - corr;
    }
}

template <class MakeDecoder>
void gemm(const float* x, int64_t M, int64_t K, int64_t N, int64_t gs, int64_t G, const float* scales,
          int64_t s_stride, const float* szeros, float* y, MakeDecoder make) {
    std::vector<float> xsum;
    if (szeros != nullptr) {
        xsum.assign(M * G, 0.f);
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < K; ++k) xsum[m * G + k / gs] += x[m * K + k];
    }
    const float* xs = xsum.empty() ? nullptr : xsum.data();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        auto dec = make(n);
        const float* s = scales + n * s_stride;
        const float* sz = szeros ? szeros + n * G : nullptr;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            int mt = (int)std::min<int64_t>(MT, M - m0);
            row_tile(dec, x, K, m0, mt, K, gs, s, sz, xs, G, y, N, n);
        }
    }
}

void check_x(const at::Tensor& x, int64_t K) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == K,
                "x must be a contiguous float32 [M, K] tensor");
}

void check_groups(int64_t K, int64_t gs, const at::Tensor& scales, int64_t N) {
    TORCH_CHECK(gs % 8 == 0 && K % gs == 0, "group size must be a multiple of 8 dividing K");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / gs),
                "scales must be float32 [N, K / group_size]");
}

// y = x @ ((codes - z') * s)^T; codes int8 [N, K]; scales, szeros float32 [N, G] (szeros may be empty)
at::Tensor w8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   const at::Tensor& szeros, int64_t gs) {
    int64_t N = codes.size(0), K = codes.size(1), M = x.size(0);
    check_x(x, K);
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(), "codes must be contiguous int8");
    check_groups(K, gs, scales, N);
    bool z = szeros.numel() > 0;
    TORCH_CHECK(!z || (szeros.numel() == scales.numel() && szeros.is_contiguous()), "bad szeros");
    at::Tensor y = at::empty({M, N}, x.options());
    const int8_t* w = codes.data_ptr<int8_t>();
    gemm(x.data_ptr<float>(), M, K, N, gs, K / gs, scales.data_ptr<float>(), K / gs,
         z ? szeros.data_ptr<float>() : nullptr, y.data_ptr<float>(),
         [&](int64_t n) { return DecodeI8{w + n * K}; });
    return y;
}

// y = x @ ((q - z) * s)^T; packed uint8 [N, K / 2] in the grouped nibble layout (K % 64 == 0)
at::Tensor w4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   const at::Tensor& szeros, int64_t gs) {
    int64_t N = packed.size(0), K = packed.size(1) * 2, M = x.size(0);
    check_x(x, K);
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && K % 64 == 0,
                "packed must be contiguous uint8 [N, K / 2] with K a multiple of 64");
    check_groups(K, gs, scales, N);
    bool z = szeros.numel() > 0;
    TORCH_CHECK(!z || (szeros.numel() == scales.numel() && szeros.is_contiguous()), "bad szeros");
    at::Tensor y = at::empty({M, N}, x.options());
    const uint8_t* w = packed.data_ptr<uint8_t>();
    gemm(x.data_ptr<float>(), M, K, N, gs, K / gs, scales.data_ptr<float>(), K / gs,
         z ? szeros.data_ptr<float>() : nullptr, y.data_ptr<float>(),
         [&](int64_t n) { return DecodeI4{w + n * (K / 2)}; });
    return y;
}

// y = x @ (f8 * s)^T; codes: e4m3fn bytes viewed as uint8 [N, K]; scales float32 [N] or [1]
at::Tensor f8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
    int64_t N = codes.size(0), K = codes.size(1), M = x.size(0);
    check_x(x, K);
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && K % 8 == 0,
                "codes must be contiguous uint8 [N, K] with K a multiple of 8");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && (scales.numel() == N || scales.numel() == 1),
                "scales must be float32 [N] or [1]");
    at::Tensor y = at::empty({M, N}, x.options());
    const uint8_t* w = codes.data_ptr<uint8_t>();
    gemm(x.data_ptr<float>(), M, K, N, K, 1, scales.data_ptr<float>(), scales.numel() == 1 ? 0 : 1, nullptr,
         y.data_ptr<float>(), [&](int64_t n) { return DecodeF8{w + n * K}; });
    return y;
}

// rows of an int8 table times their scales: the tied embedding's lookup from the int8 head
at::Tensor w8_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales) {
    TORCH_CHECK(ids.scalar_type() == at::kLong && codes.scalar_type() == at::kChar && codes.is_contiguous(),
                "ids int64, codes contiguous int8");
    at::Tensor flat = ids.contiguous().view(-1);
    int64_t T = flat.numel(), V = codes.size(0), K = codes.size(1);
    at::Tensor y = at::empty({T, K}, scales.options());
    const int64_t* id = flat.data_ptr<int64_t>();
    const int8_t* w = codes.data_ptr<int8_t>();
    const float* s = scales.data_ptr<float>();
    float* out = y.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
        int64_t r = id[t];
        TORCH_CHECK(r >= 0 && r < V, "token id ", r, " out of range");
        for (int64_t k = 0; k < K; ++k) out[t * K + k] = (float)w[r * K + k] * s[r];
    }
    return y;
}

}  // namespace

TORCH_LIBRARY(llmopt_cpu, m) {
    m.def("w8_gemm(Tensor x, Tensor codes, Tensor scales, Tensor szeros, int gs) -> Tensor");
    m.def("w4_gemm(Tensor x, Tensor packed, Tensor scales, Tensor szeros, int gs) -> Tensor");
    m.def("f8_gemm(Tensor x, Tensor codes, Tensor scales) -> Tensor");
    m.def("w8_rows(Tensor ids, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmopt_cpu, CPU, m) {
    m.impl("w8_gemm", &w8_gemm);
    m.impl("w4_gemm", &w4_gemm);
    m.impl("f8_gemm", &f8_gemm);
    m.impl("w8_rows", &w8_rows);
}
