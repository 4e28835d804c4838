// The AVX-512 attention parts of cpu_kernels.cpp (included by cpu_kernels_avx512.h, inside its
// namespace): one query row against the paged cache (attend_one: the decode kernel), a row's query heads
// of one KV head together (attend_group) and several rows of a prefill chunk together (attend_rows), all
// with the decode kernel's bits.

#pragma once

// e^x for x <= 0 (softmax after subtracting the max): 2^n * e^r with |r| <= ln2 / 2, e^r by its
// Taylor series to degree 6 (relative error ~1e-7), 2^n applied by scalef.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 values of a cache row as floats: float32 rows as they are, int8 rows' integers (their scale is
// applied to the row's score and weight instead: kv_scale).
inline __m512 kv16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 kv16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The cache slot of position `at` of a sequence through its block table.
inline int64_t slot_of(const int32_t* table, int64_t at, int64_t block_size) {
  return static_cast<int64_t>(table[at / block_size]) * block_size + at % block_size;
}

// scores[0, len) <- exp(score - best) in place; returns 1 / their sum (summed 16 at a time, in order).
inline float exp_in_place(float* scores, int64_t len, float best) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += 16) {
    const __mmask16 m = len - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - i)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + i), _mm512_set1_ps(best)));
    _mm512_mask_storeu_ps(scores + i, m, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
  }
  return 1.0f / _mm512_reduce_add_ps(total);
}

// One query row against its sequence's keys in the paged cache: scores, softmax, weighted values.
// D is a multiple of 16 and at most 256. T: float (float32 cache) or int8_t (int8 rows of D values then
// their float16 scale, layers/kv_quant.py): a key's score is its integers' dot product times its scale,
// a value's weight its probability times its scale.
template <typename T>
void attend_one(const float* q, const T* kc, const T* vc, const int32_t* table, int64_t start, int64_t end,
                int64_t block_size, int64_t row_stride, float scale, float* scores, float* out, int64_t d) {
  const int64_t nv = d / 16;
  __m512 qv[16];
  for (int64_t j = 0; j < nv; ++j) qv[j] = _mm512_mul_ps(_mm512_loadu_ps(q + j * 16), _mm512_set1_ps(scale));
  float best = -INFINITY;
  for (int64_t t = start; t < end; ++t) {
    const T* k = kc + slot_of(table, t, block_size) * row_stride;
    __m512 acc = _mm512_mul_ps(qv[0], kv16(k));
    for (int64_t j = 1; j < nv; ++j) acc = _mm512_fmadd_ps(qv[j], kv16(k + j * 16), acc);
    const float sc = _mm512_reduce_add_ps(acc) * kv_scale(k, d);
    scores[t - start] = sc;
    best = std::max(best, sc);
  }
  const float inv = exp_in_place(scores, end - start, best);
  __m512 o[16];
  for (int64_t j = 0; j < nv; ++j) o[j] = _mm512_setzero_ps();
  for (int64_t t = start; t < end; ++t) {
    const T* v = vc + slot_of(table, t, block_size) * row_stride;
    const __m512 w = _mm512_set1_ps(scores[t - start] * kv_scale(v, d));
    for (int64_t j = 0; j < nv; ++j) o[j] = _mm512_fmadd_ps(w, kv16(v + j * 16), o[j]);
  }
  for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(out + j * 16, _mm512_mul_ps(o[j], _mm512_set1_ps(inv)));
}

// _mm512_reduce_add_ps of 16 vectors at once, by its own tree (lanes i + 8, then i + 4, i + 2, i + 1),
// so each result has its bits: lane 4c + m holds the sum of a[4m + c].
inline __m512 reduce16(const __m512* a) {
  __m512 p[8], u[4];
  for (int m = 0; m < 8; ++m)
    p[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44), _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * j], p[2 * j + 1], 0x88), _mm512_shuffle_f32x4(p[2 * j], p[2 * j + 1], 0xDD));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xEE));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], 0x44), _mm512_shuffle_ps(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(w0, w1, 0x88), _mm512_shuffle_ps(w0, w1, 0xDD));
}

// The scores of one query head (qv: its NV vectors, scaled) against 16 keys, in reduce16's lane order.
template <int NV>
inline __m512 score16(const __m512* qv, const float* const* k16) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) {
    acc[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k16[i]));
    for (int j = 1; j < NV; ++j) acc[i] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(k16[i] + j * 16), acc[i]);
  }
  return reduce16(acc);
}

// The 16 keys from position t on, in reduce16's lane order.
inline void keys16(const float* kc, const int32_t* table, int64_t t, int64_t block_size, int64_t row_stride,
                   const float** k16) {
  for (int i = 0; i < 16; ++i) k16[i] = kc + slot_of(table, t + 4 * (i % 4) + i / 4, block_size) * row_stride;
}

// G query heads of one row that share a KV head (NV * 16 = D), each computed by attend_one's own
// sequence of operations (so the same bits), with each key and value read once for all G and G
// independent chains in flight: a prefill chunk's rows (cpu_kernels_modules.h). scores: G * span.
template <int G, int NV>
void attend_group(const float* q, const float* kc, const float* vc, const int32_t* table, int64_t start, int64_t end,
                  int64_t block_size, int64_t row_stride, float scale, float* scores, int64_t span, float* out) {
  constexpr int64_t d = NV * 16;
  __m512 qv[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) qv[g][j] = _mm512_mul_ps(_mm512_loadu_ps(q + g * d + j * 16), _mm512_set1_ps(scale));
  float best[G];
  for (int g = 0; g < G; ++g) best[g] = -INFINITY;
  int64_t t = start;
  for (; t + 16 <= end; t += 16) {  // 16 keys at once: their sums reduced together
    const float* k16[16];
    keys16(kc, table, t, block_size, row_stride, k16);
    for (int g = 0; g < G; ++g) {
      const __m512 sc = score16<NV>(qv[g], k16);
      _mm512_storeu_ps(scores + g * span + t - start, sc);
      best[g] = std::max(best[g], _mm512_reduce_max_ps(sc));
    }
  }
  for (; t < end; ++t) {
    const float* k = kc + slot_of(table, t, block_size) * row_stride;
    __m512 kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = _mm512_loadu_ps(k + j * 16);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(qv[g][j], kv[j], acc);
      const float sc = _mm512_reduce_add_ps(acc);
      scores[g * span + t - start] = sc;
      best[g] = std::max(best[g], sc);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = exp_in_place(scores + g * span, end - start, best[g]);
  __m512 o[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) o[g][j] = _mm512_setzero_ps();
  for (int64_t t = start; t < end; ++t) {
    const float* v = vc + slot_of(table, t, block_size) * row_stride;
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = _mm512_loadu_ps(v + j * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * span + t - start]);
      for (int j = 0; j < NV; ++j) o[g][j] = _mm512_fmadd_ps(w, vv[j], o[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + g * d + j * 16, _mm512_mul_ps(o[g][j], _mm512_set1_ps(inv[g])));
}

// Up to kRowBlock consecutive rows of one causal chunk (row r sees keys [0, ends[r]), ends ascending; no
// window), G query heads each that share a KV head: every row computed by attend_group's own operations
// (a key's score does not depend on whether it was reduced in a tile of 16 or alone; the max is exact;
// each row's exponentials, sums and value accumulation keep their order), so the same bits, with each
// tile of 16 keys and values read once for all the rows instead of once a row. q and out: row r at
// r * stride; scores: rows * G * span floats; o_buf: rows * G * D floats.
constexpr int64_t kRowBlock = 8;
template <int G, int NV>
void attend_rows(const float* q, float* out, int64_t stride, int64_t rows, const int64_t* ends, const float* kc,
                 const float* vc, const int32_t* table, int64_t block_size, int64_t row_stride, float scale,
                 float* scores, int64_t span, float* o_buf) {
  constexpr int64_t d = NV * 16;
  const int64_t last = ends[rows - 1];
  float best[kRowBlock][G];
  for (int64_t r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) best[r][g] = -INFINITY;
  for (int64_t t = 0; t + 16 <= last; t += 16) {  // tiles of 16 keys, each row's where the row has all 16
    const float* k16[16];
    keys16(kc, table, t, block_size, row_stride, k16);
    for (int64_t r = 0; r < rows; ++r) {
      if (t + 16 > ends[r]) continue;
      for (int g = 0; g < G; ++g) {
        __m512 qv[NV];
        for (int j = 0; j < NV; ++j) qv[j] = _mm512_mul_ps(_mm512_loadu_ps(q + r * stride + g * d + j * 16), _mm512_set1_ps(scale));
        const __m512 sc = score16<NV>(qv, k16);
        _mm512_storeu_ps(scores + (r * G + g) * span + t, sc);
        best[r][g] = std::max(best[r][g], _mm512_reduce_max_ps(sc));
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // each row's last keys, one by one, as attend_group's tail
    for (int64_t t = ends[r] / 16 * 16; t < ends[r]; ++t) {
      const float* k = kc + slot_of(table, t, block_size) * row_stride;
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(q + r * stride + g * d), _mm512_set1_ps(scale)),
                                   _mm512_loadu_ps(k));
        for (int j = 1; j < NV; ++j)
          acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(q + r * stride + g * d + j * 16), _mm512_set1_ps(scale)),
                                _mm512_loadu_ps(k + j * 16), acc);
        const float sc = _mm512_reduce_add_ps(acc);
        scores[(r * G + g) * span + t] = sc;
        best[r][g] = std::max(best[r][g], sc);
      }
    }
  }
  float inv[kRowBlock][G];
  for (int64_t r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) inv[r][g] = exp_in_place(scores + (r * G + g) * span, ends[r], best[r][g]);
  std::fill(o_buf, o_buf + rows * G * d, 0.0f);
  for (int64_t t0 = 0; t0 < last; t0 += 16) {  // values a tile at a time, each row's sums in key order
    const float* v16[16];
    const int64_t tile = std::min<int64_t>(16, last - t0);
    for (int64_t i = 0; i < tile; ++i) v16[i] = vc + slot_of(table, t0 + i, block_size) * row_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min<int64_t>(tile, ends[r] - t0);
      if (n <= 0) continue;
      __m512 o[G][NV];
      float* ob = o_buf + r * G * d;
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) o[g][j] = _mm512_loadu_ps(ob + g * d + j * 16);
      for (int64_t i = 0; i < n; ++i) {
        __m512 vv[NV];
        for (int j = 0; j < NV; ++j) vv[j] = _mm512_loadu_ps(v16[i] + j * 16);
        for (int g = 0; g < G; ++g) {
          const __m512 w = _mm512_set1_ps(scores[(r * G + g) * span + t0 + i]);
          for (int j = 0; j < NV; ++j) o[g][j] = _mm512_fmadd_ps(w, vv[j], o[g][j]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(ob + g * d + j * 16, o[g][j]);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NV; ++j)
        _mm512_storeu_ps(out + r * stride + g * d + j * 16,
                         _mm512_mul_ps(_mm512_loadu_ps(o_buf + (r * G + g) * d + j * 16), _mm512_set1_ps(inv[r][g])));
}

using AttendRows = void (*)(const float*, float*, int64_t, int64_t, const int64_t*, const float*, const float*,
                            const int32_t*, int64_t, int64_t, float, float*, int64_t, float*);
using AttendGroup = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int64_t, int64_t,
                             int64_t, float, float*, int64_t, float*);
template <int G, int NV>
struct GroupKernel {
  static constexpr AttendGroup fn = &attend_group<G, NV>;
};
template <int G, int NV>
struct RowsKernel {
  static constexpr AttendRows fn = &attend_rows<G, NV>;
};

// K<G, NV>::fn for `group` query heads of one KV head (up to MaxG) and head size 16 * NV, else nullptr.
template <template <int, int> class K, int NV, int MaxG, int G = 1>
auto kernel_for(int64_t group) {
  using Fn = std::remove_const_t<decltype(K<1, NV>::fn)>;
  if constexpr (G > MaxG) {
    return Fn{nullptr};
  } else {
    return group == G ? K<G, NV>::fn : kernel_for<K, NV, MaxG, G + 1>(group);
  }
}
template <template <int, int> class K, int MaxG>
auto kernel_for(int64_t group, int64_t d) {
  return d == 64 ? kernel_for<K, 4, MaxG>(group) : d == 128 ? kernel_for<K, 8, MaxG>(group) : nullptr;
}

// attend_group for this shape, or nullptr (then attend_one per head); attend_rows for it (its value
// accumulators in registers: up to 4 heads a KV head), or nullptr (then a row at a time).
inline AttendGroup attend_group_for(int64_t group, int64_t d) { return kernel_for<GroupKernel, 8>(group, d); }
inline AttendRows attend_rows_for(int64_t group, int64_t d) { return kernel_for<RowsKernel, 4>(group, d); }
