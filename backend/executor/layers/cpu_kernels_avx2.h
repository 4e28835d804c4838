// The AVX2 parts of cpu_kernels.cpp (included there) for x86 CPUs without AVX-512: 8 lanes, the
// same arithmetic as the AVX-512 parts (cpu_kernels.cpp's per-lane sequence), so every build gives
// the same bits and the engine the same tokens.
//
// With AVX-VNNI (the 256-bit dpbusd) one instruction multiplies and adds 32 unsigned weights by 32
// signed activations, 4 per lane. Plain AVX2 needs two: maddubs (pairs of u8 x s8 products into
// int16) and madd (pairs of those into int32). maddubs saturates at 32767, which 8-bit unsigned
// weights (255 x 127 x 2) would pass, so there 8-bit weights go in signed, q = u - 128 (|q| x x
// with q's sign on x stays under 128 x 127 x 2), and 128 x the block's sum of activations is added
// back in int32: the same integers as VNNI's.

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

void halves_to_floats(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// A tile's float16 values as [nb][8] floats: dst[b * 8 + r] = src[r * nb + b]. One gather a block
// (4 bytes read at each half: the caller guarantees the tile is not the tensor's last rows).
void tile_halves(const at::Half* src, int64_t nb, float* dst) {
  const __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(nb)));
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i g = _mm256_and_si256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(src + b), rows, 2), low);
    // 8 int32 -> 8 uint16 (exact: each is under 0x10000), in order, in the low 128 bits
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(g, g), 0x08);
    _mm256_storeu_ps(dst + b * 8, _mm256_cvtph_ps(_mm256_castsi256_si128(packed)));
  }
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

// The 32 weights of block 2p + e as bytes (8-bit ones signed where kSigned8).
template <int Bits>
inline __m256i load_block(const uint8_t* w, int64_t p, int e) {
  if constexpr (Bits == 4) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    return _mm256_and_si256(e == 0 ? b : _mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64 + 32 * e));
    return kSigned8 ? _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))) : v;
  }
}

// --- decode (a few activation rows): 8 output rows across the lanes, up to 2 activation rows at once ---
constexpr int64_t kLanes = 8, kDecodeCols = 2;

// 8 vectors of int32 (one per weight row, 8 lanes each) as one: lane r = the sum of vector r's lanes.
inline __m256i reduce_rows(const __m256i (&s)[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// 8 output rows (w: the first, row_bytes apart; dt/mt: d and m as [nb][8]) times C activation rows
// from c0: out[c0 + c, j + lane] for the first `count` lanes. Per block, each row's 32 products in
// 8 int32 lanes, reduced across rows into one int32 per row (lane = row), then the block's two fused
// multiply-adds per lane, in block order: the AVX-512 build's sequence.
template <int Bits, int C>
inline void decode_tile(const uint8_t* w, int64_t row_bytes, const float* dt, const float* mt, const Activations& a,
                        int64_t k, int64_t n, int64_t j, int64_t count, int64_t c0, float* out) {
  const int64_t nb = k / kBlock, pairs = k / 64;
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t i = 0; i < kLanes * Bits * 8; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + kLanes * row_bytes + p * kLanes * Bits * 8 + i), _MM_HINT_T0);
    for (int e = 0; e < 2; ++e) {
      const int64_t b = 2 * p + e;
      const __m256 dv = _mm256_loadu_ps(dt + b * kLanes), mv = _mm256_loadu_ps(mt + b * kLanes);
      for (int c = 0; c < C; ++c) {
        const int64_t at = (c0 + c) * nb + b;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (c0 + c) * k + b * kBlock));
        __m256i s[8];
        for (int r = 0; r < 8; ++r) s[r] = dot4<Bits>(load_block<Bits>(w + r * row_bytes, p, e), xv);
        __m256i sum = reduce_rows(s);
        if constexpr (Bits == 8 && kSigned8)  // the signed products back to VNNI's: + 128 x the block's sum
          sum = _mm256_add_epi32(sum, _mm256_set1_epi32(a.isums[at] * 128));
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dv, _mm256_set1_ps(a.scales[at])), acc[c]);
        acc[c] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.sums[at]), acc[c]);
      }
    }
  }
  const __m256i real = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int c = 0; c < C; ++c) _mm256_maskstore_ps(out + (c0 + c) * n + j, real, acc[c]);
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

// 8 values of a cache row as floats (the AVX-512 build's kv16, in halves).
inline __m256 kv8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 kv8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// One query row against its sequence's keys in the paged cache, as the AVX-512 one and in its
// order (lo and hi: its lanes 0-7 and 8-15 of each 16 values), so both give the same bits; T as there.
template <typename T>
void attend_one(const float* q, const T* kc, const T* vc, const int32_t* table, int64_t start, int64_t end,
                int64_t block_size, int64_t row_stride, float scale, float* scores, float* out, int64_t d) {
  const int64_t nv = d / 8;
  __m256 qv[32];
  for (int64_t j = 0; j < nv; ++j) qv[j] = _mm256_mul_ps(_mm256_loadu_ps(q + j * 8), _mm256_set1_ps(scale));
  float best = -INFINITY;
  for (int64_t t = start; t < end; ++t) {
    const int64_t row = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const T* k = kc + row * row_stride;
    __m256 lo = _mm256_mul_ps(qv[0], kv8(k)), hi = _mm256_mul_ps(qv[1], kv8(k + 8));
    for (int64_t j = 2; j < nv; j += 2) {
      lo = _mm256_fmadd_ps(qv[j], kv8(k + j * 8), lo);
      hi = _mm256_fmadd_ps(qv[j + 1], kv8(k + j * 8 + 8), hi);
    }
    const float sc = hsum(_mm256_add_ps(hi, lo)) * kv_scale(k, d);
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
    const T* v = vc + row * row_stride;
    const __m256 w = _mm256_set1_ps(scores[t - start] * kv_scale(v, d));
    for (int64_t j = 0; j < nv; ++j) o[j] = _mm256_fmadd_ps(w, kv8(v + j * 8), o[j]);
  }
  for (int64_t j = 0; j < nv; ++j) _mm256_storeu_ps(out + j * 8, _mm256_mul_ps(o[j], _mm256_set1_ps(inv)));
}

// No grouped attention here: the modules' chunks run attend_one per head (cpu_kernels_modules.h).
using AttendGroup = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int64_t, int64_t,
                             int64_t, float, float*, int64_t, float*);
inline AttendGroup attend_group_for(int64_t, int64_t) { return nullptr; }
constexpr int64_t kRowBlock = 1;
using AttendRows = void (*)(const float*, float*, int64_t, int64_t, const int64_t*, const float*, const float*,
                            const int32_t*, int64_t, int64_t, float, float*, int64_t, float*);
inline AttendRows attend_rows_for(int64_t, int64_t) { return nullptr; }

// --- prefill (cpu_kernels_prefill.h): 8 activation rows per vector, 4 x 1 accumulators ---
constexpr int64_t kPrefillRows = 4, kPrefillTiles = 1;

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
