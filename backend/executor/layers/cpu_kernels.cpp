// Block-quantized linear layers for x86 CPUs (AVX-512 VNNI, AVX-VNNI or AVX2): y = x @ W.T.
//
// W is stored as blocks of 32 weights along a row, each block with a scale d and a minimum m
// (w = d * u + m, u unsigned): 4-bit u (GGUF Q4_0/Q4_1) or 8-bit u (Q8_0 shifted by 128). The
// activations are rounded to int8 per block of 32 (scale s = amax / 127, as llama.cpp's Q8_0), and a
// block's products are summed in int32 (exact), S. One arithmetic defines every output, whatever the
// path, the build or the step's row count:
//
//     acc = 0; for each block b in order: acc = fma(S_b, d_b * s_b, acc); acc = fma(m_b, s_b * sum(q_b), acc)
//
// so a row's result is bit-identical alone (decode), among a few rows, or in a prefill tile of
// hundreds, and a prefix-cache hit (which changes a step's row count) changes no token. The paths only
// put different things across the vector lanes: the decode path (a few activation rows) puts kLanes
// output rows across them and reduces each block's integer products to one lane; the prefill path
// (cpu_kernels_prefill.h) puts kLanes activation rows across them. Each lane runs the sequence above.
// A batch-1 decode step reads every weight once, so reading 4.5 bits per weight and doing the
// products in integers is what makes it fast; a prefill is arithmetic, and the integer sums per block
// leave one float conversion and two fused multiply-adds per 32 products.
//
// Layout, per output row: 4-bit weights as 32-byte groups, one per pair of blocks (byte j holds
// weight j of the pair in its low nibble and weight 32 + j in its high nibble); 8-bit weights as
// they are; d and m as float16 [rows, K / 32]. K must be a multiple of 64.
//
// One source, built once per instruction set the CPU has (cpu_kernels.py): the compiler's target
// picks cpu_kernels_avx512.h or cpu_kernels_avx2.h for the inner loops, and CACHEGW_OPS names the
// op namespace (cachegw_avx512, cachegw_avxvnni, cachegw_avx2), so several builds load side by side.
// -ffp-contract=off keeps the compiler from fusing any other multiply and add.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPrefetch = 2048;  // bytes ahead of the weights being read

// The activations as the decode path reads them: int8 rows, each block's scale, the block's sum of
// rounded values and that sum times the scale (the term of the blocks' minimums).
struct Activations {
  std::vector<int8_t> q;       // [rows, k]
  std::vector<float> scales;   // [rows, nb]
  std::vector<float> sums;     // [rows, nb]: scale * isums
  std::vector<int32_t> isums;  // [rows, nb]
};

// The activations as the prefill kernel reads them (cpu_kernels_prefill.h): rows across the vector
// lanes, 4 bytes of one row per lane, one scale per block of 32; `tiles` groups of kLanes rows
// (the last padded with zeros).
struct Columns {
  int64_t tiles;
  std::vector<int8_t> q;      // [tiles][k / 4][kLanes][4]
  std::vector<float> scales;  // [tiles][nb][kLanes]
  std::vector<float> sums;    // [tiles][nb][kLanes]: scale * the block's sum of rounded values
  std::vector<int32_t> isums; // [tiles][nb][kLanes]: the block's sum of rounded values
};

// KV cache rows (layers/kv_quant.py): float32 rows of D values, or int8 rows of D values then their
// float16 scale (absmax / 127). The attention kernels read int8 rows' integers and apply the scale
// to the row's score and softmax weight (kv_scale: 1 for float32 rows).
inline float kv_scale(const float*, int64_t) { return 1.0f; }
inline float kv_scale(const int8_t* row, int64_t d) {
  at::Half h;
  std::memcpy(&h, row + d, sizeof h);
  return static_cast<float>(h);
}
// A cache row's elements: D, or D + 2 for int8 (the scale's bytes).
inline int64_t kv_width(const at::Tensor& cache, int64_t d) { return cache.scalar_type() == at::kChar ? d + 2 : d; }
// Store one row of D floats as the cache keeps it: a copy, or as kv_quant.encode quantizes it (scale
// = max(absmax / 127, 1e-8) in float32, each value divided by it and rounded half to even, the scale
// stored as float16), byte for byte.
inline void kv_store(const float* x, float* dst, int64_t d) { std::memcpy(dst, x, d * sizeof(float)); }
inline void kv_store(const float* x, int8_t* dst, int64_t d) {
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = std::max(amax / 127.0f, 1e-8f);
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(x[i] / s));
  const at::Half h(s);
  std::memcpy(dst + d, &h, sizeof h);
}

// The K and V caches an attention op reads for heads of `d` values: equal shapes, contiguous, float32
// [blocks, block size, KV heads, D] or int8 [..., D + 2]; `d` a multiple of 16 up to 256.
inline void check_kv_caches(const at::Tensor& k, const at::Tensor& v, int64_t d) {
  TORCH_CHECK(k.dim() == 4 && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kChar) && k.is_contiguous() &&
                  v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && v.is_contiguous(),
              "caches must be contiguous float32 [blocks, block size, KV heads, D] or int8 [..., D + 2]");
  TORCH_CHECK(k.size(3) == kv_width(k, d) && d % 16 == 0 && d <= 256, "head size must be a multiple of 16 up to 256");
}

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "cpu_kernels_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "cpu_kernels_avx2.h"
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "cpu_kernels_prefill.h"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) || \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace {

// Each row rounded per block of 32 by round_block, the one rounding of every path.
Activations quantize(const float* x, int64_t rows, int64_t k) {
  const int64_t nb = k / kBlock;
  Activations a{std::vector<int8_t>(rows * k), std::vector<float>(rows * nb), std::vector<float>(rows * nb),
                std::vector<int32_t>(rows * nb)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = r * nb + b;
      int32_t sum = 0;
      a.scales[at] = round_block(x + r * k + b * kBlock, a.q.data() + r * k + b * kBlock, sum);
      a.isums[at] = sum;
      a.sums[at] = a.scales[at] * static_cast<float>(sum);
    }
  }
  return a;
}

// One tile of kLanes output rows times every activation row, kDecodeCols of them at a time.
template <int Bits>
inline void decode_rows(const uint8_t* w, int64_t row_bytes, const float* dt, const float* mt, const Activations& a,
                        int64_t k, int64_t n, int64_t j, int64_t count, int64_t rows, float* out) {
  int64_t c = 0;
  for (; c + kDecodeCols <= rows; c += kDecodeCols) decode_tile<Bits, kDecodeCols>(w, row_bytes, dt, mt, a, k, n, j, count, c, out);
  switch (rows - c) {
    case 3: decode_tile<Bits, 3>(w, row_bytes, dt, mt, a, k, n, j, count, c, out); break;
    case 2: decode_tile<Bits, 2>(w, row_bytes, dt, mt, a, k, n, j, count, c, out); break;
    case 1: decode_tile<Bits, 1>(w, row_bytes, dt, mt, a, k, n, j, count, c, out); break;
    default: break;
  }
}

template <int Bits>
at::Tensor block_linear_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m) {
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t nb = k / kBlock, row_bytes = Bits == 4 ? k / 2 : k;
  TORCH_CHECK(w.size(1) == row_bytes, "weight bytes per row ", w.size(1), " != ", row_bytes);
  if (rows >= kPrefillFrom) return prefill_linear<Bits>(x, w, d, m);
  const Activations a = quantize(x.data_ptr<float>(), rows, k);
  at::Tensor y = at::empty({rows, n}, x.options());
  float* out = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  constexpr int64_t L = kLanes;
  // enough work per task to pay for waking a thread: about 64k weight-activation products
  const int64_t grain = std::max<int64_t>(1, 65536 / (k * std::max<int64_t>(rows, 1) * L));
  at::parallel_for(0, (n + L - 1) / L, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> rowwise(L * nb), dt(nb * L), mt(nb * L);
    std::vector<uint8_t> padded;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j = t * L, count = std::min<int64_t>(L, n - j);
      // d and m as [nb][L]: a block's values for the tile's rows in one vector (zeros past count);
      // gathered where rows follow the tile (a gather reads 2 bytes past its half), else one by one
      for (auto [src, dst] : {std::pair{dp, dt.data()}, std::pair{mp, mt.data()}}) {
        if (j + L < n) {
          tile_halves(src + j * nb, nb, dst);
          continue;
        }
        std::fill(rowwise.begin(), rowwise.end(), 0.0f);
        halves_to_floats(src + j * nb, count * nb, rowwise.data());
        for (int64_t r = 0; r < L; ++r)
          for (int64_t b = 0; b < nb; ++b) dst[b * L + r] = rowwise[r * nb + b];
      }
      const uint8_t* wt = wp + j * row_bytes;
      if (count < L) {  // the last tile: its rows and zeros, so every lane reads real memory
        padded.assign(L * row_bytes, 0);
        std::memcpy(padded.data(), wt, count * row_bytes);
        wt = padded.data();
      }
      decode_rows<Bits>(wt, row_bytes, dt.data(), mt.data(), a, k, n, j, count, rows, out);
    }
  });
  return y;
}

template <typename T>
at::Tensor paged_decode_attention_typed(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                        int64_t window) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), width = block_tables.size(1);
  const int64_t group = heads / kv_heads, kv_row = k_cache.size(3), row_stride = kv_heads * kv_row;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const T* kp = static_cast<const T*>(k_cache.data_ptr());
  const T* vp = static_cast<const T*>(v_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end_task) {
    std::vector<float> scores(width * block_size);
    for (int64_t task = begin; task < end_task; ++task) {
      const int64_t i = task / heads, h = task % heads, kvh = h / group;
      const int64_t end = std::min<int64_t>(lens[i], width * block_size);
      const int64_t start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      if (end <= start) {
        std::fill(op + task * d, op + (task + 1) * d, 0.0f);
        continue;
      }
      attend_one<T>(qp + task * d, kp + kvh * kv_row, vp + kvh * kv_row, tables + i * width, start, end, block_size,
                    row_stride, static_cast<float>(scale), scores.data(), op + task * d, d);
    }
  });
  return out;
}

at::Tensor paged_decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                       int64_t window) {
  if (k_cache.scalar_type() == at::kChar)
    return paged_decode_attention_typed<int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, window);
  return paged_decode_attention_typed<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, window);
}
}  // namespace
#else
namespace {
constexpr const char* kIsa = "none";
template <int Bits>
at::Tensor block_linear_impl(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "cachegw's CPU kernels were built without AVX2 or AVX-512");
}
at::Tensor paged_decode_attention_impl(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, double, int64_t) {
  TORCH_CHECK(false, "cachegw's CPU kernels were built without AVX2 or AVX-512");
}
}  // namespace
#endif
#include "cpu_kernels_decode.h"
#include "cpu_kernels_modules.h"

namespace {

// Decode attention straight from the paged cache: q [n, H, D], caches [blocks, block size, KVH, D]
// float32, block_tables [n, W] int32, seq_lens [n] int32 (context length including this token);
// window > 0 keeps the last `window` positions. Reads each key and value once, no gathered copy.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32 [n, H, D]");
  check_kv_caches(k_cache, v_cache, q.size(2));
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.size(0) == q.size(0),
              "block_tables must be contiguous int32 [n, W]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt && seq_lens.size(0) == q.size(0),
              "seq_lens must be int32 [n]");
  return paged_decode_attention_impl(q, k_cache, v_cache, block_tables, seq_lens, scale, window);
}

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

// One decode step of every layer (cpu_kernels_decode.h): x [B, hidden] float32 embeddings, positions
// and slots [B] int64, block_tables [B, W] and seq_lens [B] int32, caches K and V per layer.
at::Tensor decode_step_op(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slots,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, at::TensorList weights,
                          at::TensorList caches, const at::Tensor& final_norm, at::IntArrayRef ints, int64_t heads,
                          int64_t kv_heads, double eps, double scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [B, hidden]");
  const int64_t rows = x.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == rows &&
                  slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows,
              "positions and slots must be int64 [B]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.size(0) == rows && seq_lens.scalar_type() == at::kInt && seq_lens.numel() == rows,
              "block_tables must be contiguous int32 [B, W], seq_lens int32 [B]");
  TORCH_CHECK(!caches.empty() && caches.size() % 2 == 0, "caches: K and V of every layer");
  const int64_t d = caches[0].size(3) - (caches[0].scalar_type() == at::kChar ? 2 : 0);
  for (size_t i = 0; i < caches.size(); i += 2) {
    check_kv_caches(caches[i], caches[i + 1], d);
    TORCH_CHECK(caches[i].sizes() == caches[0].sizes() && caches[i].scalar_type() == caches[0].scalar_type() &&
                    caches[i].size(2) == kv_heads,
                "every layer's caches must be alike, with kv_heads KV heads");
  }
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(x.size(1) % 64 == 0 && heads * d % 64 == 0, "hidden and heads x head size must be multiples of 64");
  return decode_step(x, positions, slots, block_tables, seq_lens, weights, caches, final_norm, ints, heads, kv_heads,
                     eps, scale);
}

std::string isa() { return kIsa; }

}  // namespace

#ifndef CACHEGW_OPS
#define CACHEGW_OPS cachegw
#endif
// one more level, so CACHEGW_OPS is expanded before TORCH_LIBRARY pastes it into names
#define CACHEGW_LIBRARY(ns, lib) TORCH_LIBRARY(ns, lib)
#define CACHEGW_LIBRARY_IMPL(ns, key, lib) TORCH_LIBRARY_IMPL(ns, key, lib)

CACHEGW_LIBRARY(CACHEGW_OPS, lib) {
  lib.def("block_linear(Tensor x, Tensor w, Tensor d, Tensor m, int bits) -> Tensor");
  lib.def("isa() -> str", &isa);
  lib.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window) -> Tensor");
  lib.def(
      "decode_step(Tensor x, Tensor positions, Tensor slots, Tensor block_tables, Tensor seq_lens, "
      "Tensor[] weights, Tensor[] caches, Tensor final_norm, int[] ints, int heads, int kv_heads, float eps, "
      "float scale) -> Tensor");
  lib.def("rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> Tensor[]");
  lib.def("silu_mul(Tensor gate_up) -> Tensor");
  lib.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int window) -> Tensor");
}

CACHEGW_LIBRARY_IMPL(CACHEGW_OPS, CPU, lib) {
  lib.impl("block_linear", &block_linear);
  lib.impl("paged_decode_attention", &paged_decode_attention);
  lib.impl("decode_step", &decode_step_op);
  lib.impl("rms_norm", &rms_norm_op);
  lib.impl("silu_mul", &silu_mul_op);
  lib.impl("paged_attention", &paged_attention_op);
}
