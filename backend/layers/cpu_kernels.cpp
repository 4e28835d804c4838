// Block-quantized linear layers for x86 CPUs with AVX-512 VNNI: y = x @ W.T.
//
// W is stored as blocks of 32 weights along a row, each block with a scale d and a minimum m
// (w = d * u + m, u unsigned): 4-bit u (GGUF Q4_0/Q4_1) or 8-bit u (Q8_0 shifted by 128). The
// activations are rounded to int8 in groups of 4, each with its scale s, so a block's contribution
// is d * sum over its groups of s * sum(u * q) + m * (the block's sum of rounded activations): one
// VNNI instruction multiplies and adds 64 unsigned weights by 64 signed activations, 4 per lane. A batch-1 decode step reads every weight once, so
// reading 4.5 bits per weight and doing the products in integers is what makes it fast.
//
// Layout, per output row: 4-bit weights as 32-byte groups, one per pair of blocks (byte j holds
// weight j of the pair in its low nibble and weight 32 + j in its high nibble); 8-bit weights as
// they are; d and m as float16 [rows, K / 32]. K must be a multiple of 64.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPrefetch = 2048;  // bytes ahead of the weights being read

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kVnni = true;

// Rounds the activations to int8 in groups of 4, each group with its own scale (amax / 127), and
// sums each block of 32 of the rounded values (for the blocks' minimums: the product's error is then
// sum(w * (rounded x - x)), with the centred weights, not the shifted ones). A VNNI lane adds the products of one
// group, so a scale per group costs the inner loop nothing over a scale per block, and an outlier
// coarsens only its 3 neighbours' rounding instead of its block's 31.
void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* scales, float* sums) {
  const int64_t nb = k / kBlock;
  std::fill(sums, sums + rows * nb, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < k; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + r * k + i);
      const __m512 a = _mm512_abs_ps(v);
      const __m512 m1 = _mm512_max_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
      const __m512 amax = _mm512_max_ps(m1, _mm512_permute_ps(m1, _MM_SHUFFLE(1, 0, 3, 2)));
      const __mmask16 nonzero = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
      const __m512 inv = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(127.0f), amax);
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * k + i), _mm512_cvtsepi32_epi8(qi));
      const __m512 scale = _mm512_mul_ps(amax, _mm512_set1_ps(1.0f / 127.0f));
      _mm_storeu_ps(scales + (r * k + i) / 4, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, scale)));
      sums[r * nb + i / kBlock] += _mm512_reduce_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(qi), scale));
    }
  }
}

// float16 -> float32 for n values.
void halves_to_floats(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256i h = _mm256_maskz_loadu_epi16(tail, src + i);
    _mm512_mask_storeu_ps(dst + i, tail, _mm512_cvtph_ps(h));
  }
}

// The 64 unsigned weights of block pair p, as bytes.
template <int Bits>
inline __m512i load_pair(const uint8_t* w, int64_t p) {
  if constexpr (Bits == 4) {
    // the 32 bytes in both halves, the upper half shifted down a nibble, then the low nibbles
    const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)));
    return _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFFFF0000, both, 4), _mm512_set1_epi8(0x0F));
  } else {
    return _mm512_loadu_si512(w + p * 64);
  }
}

// The activations as the kernel reads them: int8 rows, one scale per group of 4 (for a pair of
// blocks, the 16 lanes of one vector) and each block's sum.
struct Activations {
  std::vector<int8_t> q;       // [rows, k]
  std::vector<float> scales;   // [rows, k / 4]
  std::vector<float> sums;     // [rows, nb]
};

Activations quantize(const float* x, int64_t rows, int64_t k) {
  Activations a{std::vector<int8_t>(rows * k), std::vector<float>(rows * k / 4), std::vector<float>(rows * k / kBlock)};
  quantize_rows(x, rows, k, a.q.data(), a.scales.data(), a.sums.data());
  return a;
}

// R weight rows (from row j) times C activation rows (from row c0): out[c, j + r].
template <int Bits, int R, int C>
inline void tile(const uint8_t* w, const float* dw, const float* mw, const Activations& a, int64_t k, int64_t n,
                 int64_t j, int64_t c0, float* out) {
  const int64_t nb = k / kBlock, pairs = k / 64, row_bytes = Bits == 4 ? k / 2 : k;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  // Row by row, so the weights stream through memory in order; U partial sums per activation row
  // keep U * C independent chains of multiply-adds in flight.
  constexpr int U = C >= 4 ? 1 : (C >= 2 ? 2 : 4);
  for (int r = 0; r < R; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    const float* d = dw + r * nb;
    __m512 part[C][U];
    for (int c = 0; c < C; ++c)
      for (int u = 0; u < U; ++u) part[c][u] = _mm512_setzero_ps();
    auto step = [&](int64_t p, int u) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + p * Bits * 8 + kPrefetch), _MM_HINT_T0);
      const __m512i wv = load_pair<Bits>(wr, p);
      const __m512 dv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d[2 * p]), _mm512_set1_ps(d[2 * p + 1]));
      for (int c = 0; c < C; ++c) {
        const __m512i xv = _mm512_loadu_si512(a.q.data() + (c0 + c) * k + p * 64);
        const __m512 xs = _mm512_loadu_ps(a.scales.data() + (c0 + c) * (k / 4) + p * 16);
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
        part[c][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, xs), part[c][u]);
      }
    };
    int64_t p = 0;
    for (; p + U <= pairs; p += U)
      for (int u = 0; u < U; ++u) step(p + u, u);
    for (; p < pairs; ++p) step(p, 0);
    for (int c = 0; c < C; ++c) {
      acc[r][c] = part[c][0];
      for (int u = 1; u < U; ++u) acc[r][c] = _mm512_add_ps(acc[r][c], part[c][u]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const float* sums = a.sums.data() + (c0 + c) * nb;
    for (int r = 0; r < R; ++r) {
      __m512 mins = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 m = nb - b >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (nb - b)) - 1);
        mins = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, mw + r * nb + b), _mm512_maskz_loadu_ps(m, sums + b), mins);
      }
      out[(c0 + c) * n + j + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][c], mins));
    }
  }
}

template <int Bits, int R>
inline void rows_tile(const uint8_t* w, const float* dw, const float* mw, const Activations& a, int64_t k, int64_t n,
                      int64_t j, int64_t rows, float* out) {
  int64_t c = 0;
  for (; c + 4 <= rows; c += 4) tile<Bits, R, 4>(w, dw, mw, a, k, n, j, c, out);
  switch (rows - c) {
    case 3: tile<Bits, R, 3>(w, dw, mw, a, k, n, j, c, out); break;
    case 2: tile<Bits, R, 2>(w, dw, mw, a, k, n, j, c, out); break;
    case 1: tile<Bits, R, 1>(w, dw, mw, a, k, n, j, c, out); break;
    default: break;
  }
}

template <int Bits>
at::Tensor block_linear_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m) {
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t nb = k / kBlock, row_bytes = Bits == 4 ? k / 2 : k;
  TORCH_CHECK(w.size(1) == row_bytes, "weight bytes per row ", w.size(1), " != ", row_bytes);
  const Activations a = quantize(x.data_ptr<float>(), rows, k);
  at::Tensor y = at::empty({rows, n}, x.options());
  float* out = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  constexpr int64_t R = 4;
  // enough work per task to pay for waking a thread: about 64k weight-activation products
  const int64_t grain = std::max<int64_t>(1, 65536 / (k * std::max<int64_t>(rows, 1) * R));
  at::parallel_for(0, (n + R - 1) / R, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> dw(R * nb), mw(R * nb);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j = t * R, r = std::min<int64_t>(R, n - j);
      halves_to_floats(dp + j * nb, r * nb, dw.data());
      halves_to_floats(mp + j * nb, r * nb, mw.data());
      const uint8_t* wr = wp + j * row_bytes;
      if (r == R) {
        rows_tile<Bits, 4>(wr, dw.data(), mw.data(), a, k, n, j, rows, out);
      } else {
        for (int64_t i = 0; i < r; ++i)
          rows_tile<Bits, 1>(wr + i * row_bytes, dw.data() + i * nb, mw.data() + i * nb, a, k, n, j + i, rows, out);
      }
    }
  });
  return y;
}
#else
constexpr bool kVnni = false;
template <int Bits>
at::Tensor block_linear_impl(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "cachegw's CPU kernels were built without AVX-512 VNNI");
}
#endif

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                        int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [rows, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.is_contiguous() && m.is_contiguous(),
              "d and m must be contiguous float16");
  TORCH_CHECK(x.size(1) % 64 == 0, "K must be a multiple of 64, not ", x.size(1));
  TORCH_CHECK(d.size(0) == w.size(0) && d.size(1) == x.size(1) / kBlock && m.sizes() == d.sizes(),
              "d and m must be [rows of w, K / 32]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  return bits == 4 ? block_linear_impl<4>(x, w, d, m) : block_linear_impl<8>(x, w, d, m);
}

bool has_vnni() { return kVnni; }

}  // namespace

TORCH_LIBRARY(cachegw, lib) {
  lib.def("block_linear(Tensor x, Tensor w, Tensor d, Tensor m, int bits) -> Tensor");
  lib.def("has_vnni() -> bool", &has_vnni);
}

TORCH_LIBRARY_IMPL(cachegw, CPU, lib) { lib.impl("block_linear", &block_linear); }
