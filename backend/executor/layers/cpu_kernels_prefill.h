// The prefill path of block_linear (included by cpu_kernels.cpp after an instruction set's header,
// which gives kLanes, kPrefillRows, kPrefillTiles, round_block and prefill_tile).
//
// With many activation rows the work is arithmetic, not reading weights. Here the activation rows
// are laid out across the vector lanes: one multiply-add instruction takes 4 weights of one output
// row (broadcast) times 4 activations of each of kLanes rows, a block's 8 such steps add up in int32,
// and only then is there one conversion and two fused multiply-adds per block, output row and kLanes
// activation rows: cpu_kernels.cpp's per-lane sequence, so each row's result has the bits the decode
// path gives it alone. The weights are unpacked to bytes once per register tile of output rows and
// stay in L1 while a chunk of activation rows streams past them.

#pragma once

namespace {

// Activation rows from which the prefill path runs (below, the decode path: no weight unpacking and
// no transposed copy of the activations). Either gives a row the same bits.
constexpr int64_t kPrefillFrom = 32;
constexpr int64_t kChunk = 8;         // token-tile groups per task: 128-256 activation rows

// Each row rounded per block of 32 into the lanes layout, rows in parallel.
Columns quantize_columns(const float* x, int64_t rows, int64_t k) {
  const int64_t nb = k / kBlock, per = kLanes * kPrefillTiles;
  const int64_t tiles = (rows + per - 1) / per * kPrefillTiles;
  Columns a{tiles, std::vector<int8_t>(tiles * k * kLanes), std::vector<float>(tiles * nb * kLanes),
            std::vector<float>(tiles * nb * kLanes), std::vector<int32_t>(tiles * nb * kLanes)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    alignas(64) int8_t q[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t tile = r / kLanes, lane = r % kLanes;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t sum = 0;
        const float scale = round_block(x + r * k + b * kBlock, q, sum);
        a.scales[(tile * nb + b) * kLanes + lane] = scale;
        a.sums[(tile * nb + b) * kLanes + lane] = scale * static_cast<float>(sum);
        a.isums[(tile * nb + b) * kLanes + lane] = sum;
        int8_t* dst = a.q.data() + ((tile * (k / 4) + b * 8) * kLanes + lane) * 4;
        for (int g = 0; g < 8; ++g) std::memcpy(dst + g * kLanes * 4, q + 4 * g, 4);
      }
    }
  });
  return a;
}

// `count` rows of packed weights as one byte per weight ([R][k]); 8-bit ones as the dot product
// wants them (signed where kSigned8).
template <int Bits>
void unpack_rows(const uint8_t* w, int64_t count, int64_t k, uint8_t* out) {
  for (int64_t r = 0; r < count; ++r) {
    if constexpr (Bits == 4) {
      for (int64_t p = 0; p < k / 64; ++p) {
        const uint8_t* src = w + r * (k / 2) + p * 32;
        uint8_t* dst = out + r * k + p * 64;
        for (int i = 0; i < 32; ++i) {
          dst[i] = src[i] & 0x0F;
          dst[32 + i] = src[i] >> 4;
        }
      }
    } else {
      const uint8_t flip = kSigned8 ? 0x80 : 0;
      for (int64_t i = 0; i < k; ++i) out[r * k + i] = w[r * k + i] ^ flip;
    }
  }
}

template <int Bits>
at::Tensor prefill_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m) {
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t nb = k / kBlock, row_bytes = Bits == 4 ? k / 2 : k;
  const Columns a = quantize_columns(x.data_ptr<float>(), rows, k);
  at::Tensor y = at::empty({rows, n}, x.options());
  float* out = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  constexpr int64_t R = kPrefillRows, T = kPrefillTiles;
  const int64_t row_tiles = (n + R - 1) / R, groups = a.tiles / T, chunks = (groups + kChunk - 1) / kChunk;
  // chunk-major: a thread's tasks share their activation rows, which stay in its cache
  at::parallel_for(0, chunks * row_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> wu(R * k, 0);
    std::vector<float> dw(R * nb, 0.0f), mw(R * nb, 0.0f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task / row_tiles, j = task % row_tiles * R, count = std::min<int64_t>(R, n - j);
      unpack_rows<Bits>(wp + j * row_bytes, count, k, wu.data());
      halves_to_floats(dp + j * nb, count * nb, dw.data());
      halves_to_floats(mp + j * nb, count * nb, mw.data());
      for (int64_t g = c * kChunk; g < std::min(groups, (c + 1) * kChunk); ++g)
        prefill_tile<Bits, R, T>(wu.data(), dw.data(), mw.data(), a, g * T, k, n, j, count, rows, out);
    }
  });
  return y;
}

}  // namespace
