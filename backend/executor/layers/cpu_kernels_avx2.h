// The AVX2 parts of cpu_kernels.cpp (included there) for x86 CPUs without AVX-512: 8 lanes, the
// same arithmetic as the AVX-512 parts (activations in int8 groups of 4, each with its scale), so
// both variants give the same answers to rounding.
//
// With AVX-VNNI (the 256-bit dpbusd) one instruction multiplies and adds 32 unsigned weights by 32
// signed activations, 4 per lane. Plain AVX2 needs two: maddubs (pairs of u8 x s8 products into
// int16) and madd (pairs of those into int32). maddubs saturates at 32767, which 8-bit unsigned
// weights (255 x 127 x 2) would pass, so there 8-bit weights go in signed, q = u - 128 (|q| x x
// with q's sign on x stays under 128 x 127 x 2), and the blocks' minimums take back the 128 * d.

#pragma once

namespace {

#if defined(__AVXVNNI__)
constexpr const char* kIsa = "avxvnni";
constexpr bool kSigned8 = false;
#else
constexpr const char* kIsa = "avx2";
constexpr bool kSigned8 = true;
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// As the AVX-512 quantize: int8 in groups of 4 with scale amax / 127, and each block's sum of the
// rounded values; a block (4 vectors) at a time, packed to bytes in order.
Activations quantize(const float* x, int64_t rows, int64_t k) {
  const int64_t nb = k / kBlock;
  Activations a{std::vector<int8_t>(rows * k), std::vector<float>(rows * k / 4), std::vector<float>(rows * nb)};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < k; i += kBlock) {
      __m256i qi[4];
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        const int64_t at = r * k + i + 8 * j;
        const __m256 v = _mm256_loadu_ps(x + at);
        const __m256 av = _mm256_andnot_ps(sign, v);
        const __m256 m1 = _mm256_max_ps(av, _mm256_permute_ps(av, _MM_SHUFFLE(2, 3, 0, 1)));
        const __m256 amax = _mm256_max_ps(m1, _mm256_permute_ps(m1, _MM_SHUFFLE(1, 0, 3, 2)));
        const __m256 nonzero = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ);
        const __m256 inv = _mm256_and_ps(nonzero, _mm256_div_ps(_mm256_set1_ps(127.0f), amax));
        qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));
        const __m256 scale = _mm256_mul_ps(amax, _mm256_set1_ps(1.0f / 127.0f));
        a.scales[at / 4] = _mm256_cvtss_f32(scale);
        a.scales[at / 4 + 1] = _mm_cvtss_f32(_mm256_extractf128_ps(scale, 1));
        sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi[j]), scale, sum);
      }
      a.sums[r * nb + i / kBlock] = hsum(sum);
      const __m256i lo = _mm256_packs_epi32(qi[0], qi[1]), hi = _mm256_packs_epi32(qi[2], qi[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + r * k + i), bytes);
    }
  }
  return a;
}

void halves_to_floats(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// 32 weights times 32 activations: 8 int32 lanes, each the sum of 4 products.
template <int Bits>
inline __m256i dot4(__m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 8) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  }
#endif
}

// The weights of block pair p as two vectors of 32 bytes (blocks 2p and 2p + 1).
template <int Bits>
inline void load_pair(const uint8_t* w, int64_t p, __m256i& lo, __m256i& hi) {
  if constexpr (Bits == 4) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(b, nibble);
    hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
  } else {
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64 + 32));
    if constexpr (kSigned8) {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      lo = _mm256_xor_si256(lo, flip);
      hi = _mm256_xor_si256(hi, flip);
    }
  }
}

// R weight rows (from row j) times C activation rows (from row c0): out[c, j + r]. With 16 vector
// registers, each weight row's sums are reduced as soon as the row is done.
template <int Bits, int R, int C>
inline void tile(const uint8_t* w, const float* dw, const float* mw, const Activations& a, int64_t k, int64_t n,
                 int64_t j, int64_t c0, float* out) {
  const int64_t nb = k / kBlock, pairs = k / 64, row_bytes = Bits == 4 ? k / 2 : k;
  constexpr int U = C >= 4 ? 1 : (C >= 2 ? 2 : 4);
  for (int r = 0; r < R; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    const float* d = dw + r * nb;
    __m256 part[C][U];
    for (int c = 0; c < C; ++c)
      for (int u = 0; u < U; ++u) part[c][u] = _mm256_setzero_ps();
    auto step = [&](int64_t p, int u) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + p * Bits * 8 + kPrefetch), _MM_HINT_T0);
      __m256i lo, hi;
      load_pair<Bits>(wr, p, lo, hi);
      const __m256 d0 = _mm256_set1_ps(d[2 * p]), d1 = _mm256_set1_ps(d[2 * p + 1]);
      for (int c = 0; c < C; ++c) {
        const int8_t* xq = a.q.data() + (c0 + c) * k + p * 64;
        const float* xs = a.scales.data() + (c0 + c) * (k / 4) + p * 16;
        const __m256i s0 = dot4<Bits>(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
        const __m256i s1 = dot4<Bits>(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32)));
        part[c][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, _mm256_loadu_ps(xs)), part[c][u]);
        part[c][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, _mm256_loadu_ps(xs + 8)), part[c][u]);
      }
    };
    int64_t p = 0;
    for (; p + U <= pairs; p += U)
      for (int u = 0; u < U; ++u) step(p + u, u);
    for (; p < pairs; ++p) step(p, 0);
    const float* m = mw + r * nb;
    for (int c = 0; c < C; ++c) {
      __m256 acc = part[c][0];
      for (int u = 1; u < U; ++u) acc = _mm256_add_ps(acc, part[c][u]);
      const float* sums = a.sums.data() + (c0 + c) * nb;
      int64_t b = 0;
      for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(sums + b), acc);
      float total = hsum(acc);
      for (; b < nb; ++b) total += m[b] * sums[b];
      out[(c0 + c) * n + j + r] = total;
    }
  }
}

// e^x for x <= 0, as the AVX-512 one, with 2^n built in the exponent bits (n >= -126 here).
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// One query row against its sequence's keys in the paged cache, as the AVX-512 one.
void attend_one(const float* q, const float* kc, const float* vc, const int32_t* table, int64_t start, int64_t end,
                int64_t block_size, int64_t row_stride, float scale, float* scores, float* out, int64_t d) {
  const int64_t nv = d / 8;
  __m256 qv[32];
  for (int64_t j = 0; j < nv; ++j) qv[j] = _mm256_mul_ps(_mm256_loadu_ps(q + j * 8), _mm256_set1_ps(scale));
  float best = -INFINITY;
  for (int64_t t = start; t < end; ++t) {
    const int64_t row = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const float* k = kc + row * row_stride;
    __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
    for (int64_t j = 1; j < nv; ++j) acc = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + j * 8), acc);
    const float sc = hsum(acc);
    scores[t - start] = sc;
    best = std::max(best, sc);
  }
  const int64_t len = end - start;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < len; i += 8) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(len - i)), lanes);
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_maskload_ps(scores + i, m), _mm256_set1_ps(best)));
    _mm256_maskstore_ps(scores + i, m, e);
    total = _mm256_add_ps(total, _mm256_and_ps(_mm256_castsi256_ps(m), e));
  }
  const float inv = 1.0f / hsum(total);
  __m256 o[32];
  for (int64_t j = 0; j < nv; ++j) o[j] = _mm256_setzero_ps();
  for (int64_t t = start; t < end; ++t) {
    const int64_t row = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const float* v = vc + row * row_stride;
    const __m256 w = _mm256_set1_ps(scores[t - start]);
    for (int64_t j = 0; j < nv; ++j) o[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + j * 8), o[j]);
  }
  for (int64_t j = 0; j < nv; ++j) _mm256_storeu_ps(out + j * 8, _mm256_mul_ps(o[j], _mm256_set1_ps(inv)));
}

}  // namespace
