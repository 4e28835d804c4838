// The AVX-512 VNNI parts of cpu_kernels.cpp (included there): 16 lanes, one VNNI instruction
// multiplies and adds 64 unsigned weights by 64 signed activations, 4 per lane.

#pragma once

namespace {

constexpr const char* kIsa = "avx512";
constexpr bool kSigned8 = false;  // 8-bit weights go in unsigned (u = q + 128)

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

// A tile's float16 values as [nb][16] floats: dst[b * 16 + r] = src[r * nb + b]. One gather a block
// (4 bytes read at each half: the caller guarantees the tile is not the tensor's last rows).
void tile_halves(const at::Half* src, int64_t nb, float* dst) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(nb)));
  for (int64_t b = 0; b < nb; ++b) {
    const __m512i g = _mm512_i32gather_epi32(rows, reinterpret_cast<const int*>(src + b), 2);
    _mm512_storeu_ps(dst + b * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
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

// --- decode (a few activation rows): 16 output rows across the lanes, up to 4 activation rows at once ---
constexpr int64_t kLanes = 16, kDecodeCols = 4;

// Integer partial sums of two weight rows' products (s0: row r, s1: row r + 1; 16 lanes of 4 products,
// lanes 0-7 block 2p, 8-15 block 2p + 1) folded: per 128-bit lane [r: l0 + l2, r + 1: l0 + l2,
// r: l1 + l3, r + 1: l1 + l3].
inline __m512i fold2(__m512i s0, __m512i s1) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
}
// Two fold2s (rows r, r + 1 and r + 2, r + 3): per 128-bit lane the 4 rows' sums of its 4 lanes.
inline __m512i fold4(__m512i t01, __m512i t23) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
}
// Two fold4s (rows 0-3 and 4-7 of 8): [block 2p rows 0-3, block 2p + 1 rows 0-3, 2p rows 4-7, 2p + 1 rows 4-7].
inline __m512i fold8(__m512i u0, __m512i u1) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, 0x88), _mm512_shuffle_i32x4(u0, u1, 0xDD));
}

// 16 output rows (w: the first, row_bytes apart; dt/mt: d and m as [nb][16]) times C activation rows
// from c0: out[c0 + c, j + lane] for the first `count` lanes. Per block pair, each row's 64 products
// in one VNNI instruction, then folded across rows into one int32 per row and block (lane = row),
// then the block's two fused multiply-adds per lane, in block order.
template <int Bits, int C>
inline void decode_tile(const uint8_t* w, int64_t row_bytes, const float* dt, const float* mt, const Activations& a,
                        int64_t k, int64_t n, int64_t j, int64_t count, int64_t c0, float* out) {
  const int64_t nb = k / kBlock, pairs = k / 64;
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    // the next tile of rows follows this one: a pair step's share of it
    for (int64_t i = 0; i < kLanes * Bits * 8; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + kLanes * row_bytes + p * kLanes * Bits * 8 + i), _MM_HINT_T0);
    __m512i xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_si512(a.q.data() + (c0 + c) * k + p * 64);
    __m512i half[2][C];
    for (int h = 0; h < 2; ++h) {
      __m512i u[2][C];
      for (int qd = 0; qd < 2; ++qd) {
        __m512i t[2][C];
        for (int pr = 0; pr < 2; ++pr) {
          const int64_t r = 8 * h + 4 * qd + 2 * pr;
          const __m512i w0 = load_pair<Bits>(w + r * row_bytes, p), w1 = load_pair<Bits>(w + (r + 1) * row_bytes, p);
          for (int c = 0; c < C; ++c)
            t[pr][c] = fold2(_mm512_dpbusd_epi32(zero, w0, xv[c]), _mm512_dpbusd_epi32(zero, w1, xv[c]));
        }
        for (int c = 0; c < C; ++c) u[qd][c] = fold4(t[0][c], t[1][c]);
      }
      for (int c = 0; c < C; ++c) half[h][c] = fold8(u[0][c], u[1][c]);
    }
    for (int e = 0; e < 2; ++e) {
      const int64_t b = 2 * p + e;
      const __m512 dv = _mm512_loadu_ps(dt + b * kLanes), mv = _mm512_loadu_ps(mt + b * kLanes);
      for (int c = 0; c < C; ++c) {
        const __m512i s = e == 0 ? _mm512_shuffle_i32x4(half[0][c], half[1][c], 0x88)
                                 : _mm512_shuffle_i32x4(half[0][c], half[1][c], 0xDD);
        const int64_t at = (c0 + c) * nb + b;
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(a.scales[at])), acc[c]);
        acc[c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.sums[at]), acc[c]);
      }
    }
  }
  const __mmask16 real = count >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
  for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(out + (c0 + c) * n + j, real, acc[c]);
}

#include "cpu_kernels_avx512_attention.h"

// --- prefill (cpu_kernels_prefill.h): 16 activation rows per vector, 4 x 2 accumulators ---
constexpr int64_t kPrefillRows = 4, kPrefillTiles = 2;

// A block of 32 activations rounded to int8 with one scale (amax / 127), returned; `sum` the sum of
// the rounded values. The one rounding of every path and build (the AVX2 one gives the same bits).
inline float round_block(const float* x, int8_t* q, int32_t& sum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return amax / 127.0f;
}

// R output rows (unpacked weights wu [R][k], from output row j, `count` of them real) times T
// tiles of 16 activation rows from tile0.
template <int Bits, int R, int T>
inline void prefill_tile(const uint8_t* wu, const float* dw, const float* mw, const Columns& a, int64_t tile0,
                         int64_t k, int64_t n, int64_t j, int64_t count, int64_t rows, float* out) {
  const int64_t nb = k / kBlock, groups = k / 4;
  const int32_t* xq = reinterpret_cast<const int32_t*>(a.q.data());
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) s[r][t] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      __m512i xv[T];
      for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_si512(xq + ((tile0 + t) * groups + b * 8 + g) * kLanes);
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, wu + r * k + b * kBlock + g * 4, 4);
        const __m512i wv = _mm512_set1_epi32(word);
        for (int t = 0; t < T; ++t) s[r][t] = _mm512_dpbusd_epi32(s[r][t], wv, xv[t]);
      }
    }
    for (int t = 0; t < T; ++t) {
      const int64_t at = ((tile0 + t) * nb + b) * kLanes;
      const __m512 xs = _mm512_loadu_ps(a.scales.data() + at), sums = _mm512_loadu_ps(a.sums.data() + at);
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(dw[r * nb + b]), xs);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][t]), scale, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(mw[r * nb + b]), sums, acc[r][t]);
      }
    }
  }
  alignas(64) float lanes[kLanes];
  for (int t = 0; t < T; ++t) {
    const int64_t first = (tile0 + t) * kLanes, real = std::min<int64_t>(kLanes, rows - first);
    for (int r = 0; r < count; ++r) {
      _mm512_store_ps(lanes, acc[r][t]);
      for (int64_t l = 0; l < real; ++l) out[(first + l) * n + j + r] = lanes[l];
    }
  }
}

}  // namespace
