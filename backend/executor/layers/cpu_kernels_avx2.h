// The AVX2 parts of cpu_kernels.cpp (included there) for x86 CPUs without AVX-512: 8 lanes, the
// same arithmetic as the AVX-512 parts (activations in int8 groups of 4, each with its scale), so
// both variants give the same answers to rounding.
//
// With AVX-VNNI (the 256-bit dpbusd) one instruction multiplies and adds 32 unsigned weights by 32
// signed activations, 4 per lane. Plain AVX2 needs two: maddubs (pairs of u8 x s8 products into
// int16) and madd (pairs of those into int32). maddubs saturates at 32767, which 8-bit unsigned
// weights (255 x 127 x 2) would pass, so there 8-bit weights go in signed, q = u - 128 (|q| x x
// with q's sign on x stays under 128 x 127 x 2), and 128 x the activations' sum (kept per group)
// is added back in int32: the same integers as VNNI's. The float work is ordered as the AVX-512
// build's (two 8-lane halves for its 16 lanes, the same reduction tree), so every build gives the
// same bits and the engine the same tokens.

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
  Activations a{std::vector<int8_t>(rows * k), std::vector<float>(rows * k / 4), std::vector<float>(rows * nb),
                std::vector<int32_t>(kSigned8 ? rows * k / 4 : 0)};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < k; i += kBlock) {
      __m256i qi[4];
      __m256 prod[4];
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
        prod[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(qi[j]), scale);
        if constexpr (kSigned8) {  // each group's sum, times 128, in lanes 0 and 4
          const __m256i h = _mm256_hadd_epi32(qi[j], qi[j]);
          const __m256i g = _mm256_slli_epi32(_mm256_hadd_epi32(h, h), 7);
          a.x128[at / 4] = _mm256_cvtsi256_si32(g);
          a.x128[at / 4 + 1] = _mm_cvtsi128_si32(_mm256_extracti128_si256(g, 1));
        }
      }
      // as the AVX-512 build: each 16 values reduced alone, in its tree, then added
      a.sums[r * nb + i / kBlock] =
          (0.0f + hsum(_mm256_add_ps(prod[0], prod[1]))) + hsum(_mm256_add_ps(prod[2], prod[3]));
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

// n floats from p, zeros past count (count may be <= 0): the AVX-512 build's masked loads.
inline __m256 load_upto(const float* p, int64_t count) {
  if (count >= 8) return _mm256_loadu_ps(p);
  if (count <= 0) return _mm256_setzero_ps();
  const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, m);
}

// The 32 weights of one block times its 32 activations of row xq: 8 int32 lanes, as VNNI's.
template <int Bits>
inline __m256i block_dot(__m256i w, const int8_t* xq, const int32_t* x128) {
  const __m256i s = dot4<Bits>(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
  if constexpr (Bits == 8 && kSigned8)
    return _mm256_add_epi32(s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x128)));
  return s;
}

// R weight rows (from row j) times C activation rows (from row c0): out[c, j + r]. Each weight row's
// sums reduced when the row is done (16 vector registers), in the AVX-512 build's order: lo and hi
// are its lanes 0-7 and 8-15.
template <int Bits, int R, int C>
inline void tile(const uint8_t* w, const float* dw, const float* mw, const Activations& a, int64_t k, int64_t n,
                 int64_t j, int64_t c0, float* out) {
  const int64_t nb = k / kBlock, pairs = k / 64, row_bytes = Bits == 4 ? k / 2 : k;
  constexpr int U = C >= 4 ? 1 : (C >= 2 ? 2 : 4);
  for (int r = 0; r < R; ++r) {
    const uint8_t* wr = w + r * row_bytes;
    const float* d = dw + r * nb;
    __m256 lo_part[C][U], hi_part[C][U];
    for (int c = 0; c < C; ++c)
      for (int u = 0; u < U; ++u) lo_part[c][u] = hi_part[c][u] = _mm256_setzero_ps();
    auto step = [&](int64_t p, int u) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + p * Bits * 8 + kPrefetch), _MM_HINT_T0);
      __m256i lo, hi;
      load_pair<Bits>(wr, p, lo, hi);
      const __m256 d0 = _mm256_set1_ps(d[2 * p]), d1 = _mm256_set1_ps(d[2 * p + 1]);
      for (int c = 0; c < C; ++c) {
        const int8_t* xq = a.q.data() + (c0 + c) * k + p * 64;
        const float* xs = a.scales.data() + (c0 + c) * (k / 4) + p * 16;
        const int32_t* x128 = a.x128.data() + (kSigned8 ? (c0 + c) * (k / 4) + p * 16 : 0);
        const __m256i s0 = block_dot<Bits>(lo, xq, x128), s1 = block_dot<Bits>(hi, xq + 32, x128 + 8);
        lo_part[c][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, _mm256_loadu_ps(xs)), lo_part[c][u]);
        hi_part[c][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, _mm256_loadu_ps(xs + 8)), hi_part[c][u]);
      }
    };
    int64_t p = 0;
    for (; p + U <= pairs; p += U)
      for (int u = 0; u < U; ++u) step(p + u, u);
    for (; p < pairs; ++p) step(p, 0);
    const float* m = mw + r * nb;
    for (int c = 0; c < C; ++c) {
      __m256 lo = lo_part[c][0], hi = hi_part[c][0];
      for (int u = 1; u < U; ++u) {
        lo = _mm256_add_ps(lo, lo_part[c][u]);
        hi = _mm256_add_ps(hi, hi_part[c][u]);
      }
      const float* sums = a.sums.data() + (c0 + c) * nb;
      __m256 mins_lo = _mm256_setzero_ps(), mins_hi = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; b += 16) {
        mins_lo = _mm256_fmadd_ps(load_upto(m + b, nb - b), load_upto(sums + b, nb - b), mins_lo);
        mins_hi = _mm256_fmadd_ps(load_upto(m + b + 8, nb - b - 8), load_upto(sums + b + 8, nb - b - 8), mins_hi);
      }
      out[(c0 + c) * n + j + r] = hsum(_mm256_add_ps(_mm256_add_ps(hi, mins_hi), _mm256_add_ps(lo, mins_lo)));
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

// One query row against its sequence's keys in the paged cache, as the AVX-512 one and in its
// order (lo and hi: its lanes 0-7 and 8-15 of each 16 values), so both give the same bits.
void attend_one(const float* q, const float* kc, const float* vc, const int32_t* table, int64_t start, int64_t end,
                int64_t block_size, int64_t row_stride, float scale, float* scores, float* out, int64_t d) {
  const int64_t nv = d / 8;
  __m256 qv[32];
  for (int64_t j = 0; j < nv; ++j) qv[j] = _mm256_mul_ps(_mm256_loadu_ps(q + j * 8), _mm256_set1_ps(scale));
  float best = -INFINITY;
  for (int64_t t = start; t < end; ++t) {
    const int64_t row = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const float* k = kc + row * row_stride;
    __m256 lo = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k)), hi = _mm256_mul_ps(qv[1], _mm256_loadu_ps(k + 8));
    for (int64_t j = 2; j < nv; j += 2) {
      lo = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + j * 8), lo);
      hi = _mm256_fmadd_ps(qv[j + 1], _mm256_loadu_ps(k + j * 8 + 8), hi);
    }
    const float sc = hsum(_mm256_add_ps(hi, lo));
    scores[t - start] = sc;
    best = std::max(best, sc);
  }
  const int64_t len = end - start;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 total_lo = _mm256_setzero_ps(), total_hi = _mm256_setzero_ps();
  for (int64_t i = 0; i < len; i += 8) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(len - i)), lanes);
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_maskload_ps(scores + i, m), _mm256_set1_ps(best)));
    _mm256_maskstore_ps(scores + i, m, e);
    __m256& total = (i / 8) % 2 == 0 ? total_lo : total_hi;
    total = _mm256_add_ps(total, _mm256_and_ps(_mm256_castsi256_ps(m), e));
  }
  const float inv = 1.0f / hsum(_mm256_add_ps(total_hi, total_lo));
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

// --- prefill (cpu_kernels_prefill.h): 8 activation rows per vector, 4 x 1 accumulators ---
constexpr int64_t kLanes = 8, kPrefillRows = 4, kPrefillTiles = 1;

// A block of 32 activations rounded to int8 with one scale (amax / 127), returned; `sum` the sum of
// the rounded values.
inline float round_block(const float* x, int8_t* q, int32_t& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  const __m256i lo = _mm256_packs_epi32(qi[0], qi[1]), hi = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order));
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  sum = _mm_cvtsi128_si32(s);
  return amax / 127.0f;
}

// 4 weights (broadcast) times 4 activations of each of 8 rows, added to s.
template <int Bits>
inline __m256i dot_add(__m256i s, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(s, w, x);
#else
  return _mm256_add_epi32(s, dot4<Bits>(w, x));
#endif
}

// R output rows (unpacked weights wu [R][k], from output row j, `count` of them real) times T
// tiles of 8 activation rows from tile0.
template <int Bits, int R, int T>
inline void prefill_tile(const uint8_t* wu, const float* dw, const float* mw, const Columns& a, int64_t tile0,
                         int64_t k, int64_t n, int64_t j, int64_t count, int64_t rows, float* out) {
  const int64_t nb = k / kBlock, groups = k / 4;
  const int32_t* xq = reinterpret_cast<const int32_t*>(a.q.data());
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) s[r][t] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      __m256i xv[T];
      for (int t = 0; t < T; ++t)
        xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + ((tile0 + t) * groups + b * 8 + g) * kLanes));
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, wu + r * k + b * kBlock + g * 4, 4);
        const __m256i wv = _mm256_set1_epi32(word);
        for (int t = 0; t < T; ++t) s[r][t] = dot_add<Bits>(s[r][t], wv, xv[t]);
      }
    }
    for (int t = 0; t < T; ++t) {
      const int64_t at = ((tile0 + t) * nb + b) * kLanes;
      const __m256 xs = _mm256_loadu_ps(a.scales.data() + at), sums = _mm256_loadu_ps(a.sums.data() + at);
      if constexpr (Bits == 8 && kSigned8) {  // the signed products back to VNNI's: + 128 x the block's sum
        const __m256i back = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.isums.data() + at)), 7);
        for (int r = 0; r < R; ++r) s[r][t] = _mm256_add_epi32(s[r][t], back);
      }
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(dw[r * nb + b]), xs);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][t]), scale, acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(mw[r * nb + b]), sums, acc[r][t]);
      }
    }
  }
  alignas(32) float lanes[kLanes];
  for (int t = 0; t < T; ++t) {
    const int64_t first = (tile0 + t) * kLanes, real = std::min<int64_t>(kLanes, rows - first);
    for (int r = 0; r < count; ++r) {
      _mm256_store_ps(lanes, acc[r][t]);
      for (int64_t l = 0; l < real; ++l) out[(first + l) * n + j + r] = lanes[l];
    }
  }
}

}  // namespace
