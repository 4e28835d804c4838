// A whole decode step of a Llama-shaped model in one op (included by cpu_kernels.cpp after
// block_linear_impl and paged_decode_attention_impl): every layer's norm, fused QKV projection,
// rotary, KV-cache store, paged attention, output projection, residual adds, norm and SiLU MLP,
// then the final norm.
//
// Eagerly, a batch-1 step of a small model is ~30 torch ops a layer, each a few microseconds of
// dispatch and Python: as long as the matmuls. Here Python calls once a step and the small ops are
// plain loops over the rows, so the eager engine decodes at the speed torch.compile reached, with no
// compile. Float32 activations and caches; the same arithmetic as the eager modules (RMSNorm in
// float32, rotate-half rotary, SiLU(gate) * up), so results agree to float32 rounding.

#pragma once

namespace {

// Per layer in `weights`: input norm, post-attention norm, cos, sin, then (w, d, m, bias) for the
// QKV, output, gate-up and down projections (bias: an empty tensor when there is none).
constexpr int64_t kLayerTensors = 4 + 4 * 4;
// Per layer in `ints`: the four projections' bits, then the sliding window (0: none).
constexpr int64_t kLayerInts = 5;

// x <- norm(x) * w, row by row: x * rsqrt(mean(x^2) + eps), as RMSNorm does in float32.
void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = w[i] * (xr[i] * inv);
  }
}

at::Tensor project(const at::Tensor& x, at::TensorList t, int64_t at_, int64_t bits) {
  at::Tensor y = bits == 4 ? block_linear_impl<4>(x, t[at_], t[at_ + 1], t[at_ + 2])
                           : block_linear_impl<8>(x, t[at_], t[at_ + 1], t[at_ + 2]);
  const at::Tensor& bias = t[at_ + 3];
  if (bias.numel() > 0) {
    float* yp = y.data_ptr<float>();
    const float* bp = bias.data_ptr<float>();
    const int64_t rows = y.size(0), n = y.size(1);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) yp[r * n + i] += bp[i];
  }
  return y;
}

// Rotate-half rotary of `heads` heads of size d at one row, in place.
void rotate(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i] + a * sin[i];
    }
  }
}

// e^x as the attention's exp_ps computes it (2^n * e^r, |r| <= ln2 / 2, Taylor to degree 6: relative
// error ~1e-7), written without calls so that the compiler vectorizes the loops around it.
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.4426950408889634f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX512F__)
// 16 lanes of g / (1 + exp_poly(-g)) * u, each operation as the scalar one (the same bits).
inline __m512 silu_mul16(__m512 g, __m512 u) {
  __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), g);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187e-06f)));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
#endif

// silu(gate) * up for rows of [gate | up] (each `inter` wide), into out [rows, inter].
void silu_mul(const float* gu, float* out, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* o = out + r * inter;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= inter; i += 16) _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
    for (; i < inter; ++i) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
  }
}

// The hidden states after the final norm, [B, hidden], for token embeddings `x` [B, hidden].
at::Tensor decode_step(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& slots,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, at::TensorList t,
                       at::TensorList caches, const at::Tensor& final_norm, at::IntArrayRef ints,
                       int64_t heads, int64_t kv_heads, double eps_d, double scale) {
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(t.size()) == layers * kLayerTensors && static_cast<int64_t>(ints.size()) == layers * kLayerInts,
              "decode_step: ", t.size(), " tensors and ", ints.size(), " ints for ", layers, " layers");
  const bool int8 = caches[0].scalar_type() == at::kChar;
  const int64_t rows = x_in.size(0), hidden = x_in.size(1), kv_row = caches[0].size(3), d = int8 ? kv_row - 2 : kv_row;
  const int64_t q_size = heads * d, kv_size = kv_heads * d, qkv_size = q_size + 2 * kv_size;
  const float eps = static_cast<float>(eps_d);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::Tensor x = x_in.contiguous().clone();  // the residual stream
  at::Tensor h = at::empty_like(x);
  at::Tensor q = at::empty({rows, heads, d}, x.options());
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = t.data() + l * kLayerTensors;
    const int64_t* bits = ints.data() + l * kLayerInts;
    const int64_t half = d / 2;
    rms_norm(x.data_ptr<float>(), w[0].data_ptr<float>(), h.data_ptr<float>(), rows, hidden, eps);
    at::Tensor qkv = project(h, t, l * kLayerTensors + 4, bits[0]);
    const at::Tensor& kc = caches[2 * l];
    const at::Tensor& vc = caches[2 * l + 1];
    float* qp = q.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      float* qkv_r = qkv.data_ptr<float>() + r * qkv_size;
      const float* cos = w[2].data_ptr<float>() + pos[r] * half;
      const float* sin = w[3].data_ptr<float>() + pos[r] * half;
      rotate(qkv_r, heads + kv_heads, d, cos, sin);  // q and k sit side by side
      std::memcpy(qp + r * q_size, qkv_r, q_size * sizeof(float));
      for (int64_t h = 0; h < kv_heads; ++h) {  // each KV head's row as the cache stores it
        const int64_t at = (slot[r] * kv_heads + h) * kv_row;
        if (int8) {
          kv_store(qkv_r + q_size + h * d, kc.data_ptr<int8_t>() + at, d);
          kv_store(qkv_r + q_size + kv_size + h * d, vc.data_ptr<int8_t>() + at, d);
        } else {
          kv_store(qkv_r + q_size + h * d, kc.data_ptr<float>() + at, d);
          kv_store(qkv_r + q_size + kv_size + h * d, vc.data_ptr<float>() + at, d);
        }
      }
    }
    at::Tensor o = paged_decode_attention_impl(q, kc, vc, block_tables, seq_lens, scale, bits[4]);
    at::Tensor a = project(o.view({rows, q_size}), t, l * kLayerTensors + 8, bits[1]);
    x.add_(a);
    rms_norm(x.data_ptr<float>(), w[1].data_ptr<float>(), h.data_ptr<float>(), rows, hidden, eps);
    at::Tensor gu = project(h, t, l * kLayerTensors + 12, bits[2]);
    const int64_t inter = gu.size(1) / 2;
    at::Tensor act = at::empty({rows, inter}, x.options());
    silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), rows, inter);
    x.add_(project(act, t, l * kLayerTensors + 16, bits[3]));
  }
  at::Tensor out = at::empty_like(x);
  rms_norm(x.data_ptr<float>(), final_norm.data_ptr<float>(), out.data_ptr<float>(), rows, hidden, eps);
  return out;
}

}  // namespace
