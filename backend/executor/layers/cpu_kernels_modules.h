// The eager modules' small ops on the fused decode step's own arithmetic (included by cpu_kernels.cpp
// after cpu_kernels_decode.h): RMSNorm with its residual add, SiLU(gate) * up, and paged attention for
// every query row of a step (decodes and prefill chunks alike).
//
// Where the fused step runs, the modules (prefill, prompt scoring, eager decode) call these instead of
// torch's ops, so one token gives the same bits in the fused step, in an eager decode and inside a
// prompt's prefill: each op computes a row by one fixed sequence whatever else shares the step. torch's
// own norms and activations do not promise that (their reductions and vector tails follow the tensor's
// size and the thread split), and its fused attention orders a row's sums by the step's query count.

#pragma once

namespace {

// out = rms_norm(x + residual) * w and the sum (the new residual), or rms_norm(x) * w without one:
// each row as the fused step's rms_norm computes it, after the same float add.
std::vector<at::Tensor> rms_norm_op(const at::Tensor& x_in, const at::Tensor& residual, const at::Tensor& w,
                                    double eps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be float32 [rows, hidden]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x_in.size(1),
              "w must be contiguous float32 [hidden]");
  const int64_t rows = x_in.size(0), n = x_in.size(1);
  at::Tensor x = x_in.contiguous();
  at::Tensor sum;
  if (residual.numel() > 0) {
    TORCH_CHECK(residual.sizes() == x_in.sizes() && residual.scalar_type() == at::kFloat,
                "residual must be float32 like x");
    sum = at::empty_like(x);
    const at::Tensor r = residual.contiguous();
    const float* xp = x.data_ptr<float>();
    const float* rp = r.data_ptr<float>();
    float* sp = sum.data_ptr<float>();
    for (int64_t i = 0; i < rows * n; ++i) sp[i] = rp[i] + xp[i];  // the fused step's x.add_(branch)
    x = sum;
  }
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t lo, int64_t hi) {
    rms_norm(xp + lo * n, w.data_ptr<float>(), op + lo * n, hi - lo, n, static_cast<float>(eps));
  });
  if (residual.numel() > 0) return {out, sum};
  return {out};
}

// silu(gate) * up for rows of [gate | up], as the fused step's MLP.
at::Tensor silu_mul_op(const at::Tensor& gu_in) {
  TORCH_CHECK(gu_in.dim() == 2 && gu_in.scalar_type() == at::kFloat && gu_in.size(1) % 2 == 0,
              "gate_up must be float32 [rows, 2 * inter]");
  const at::Tensor gu = gu_in.contiguous();
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1)), [&](int64_t lo, int64_t hi) {
    silu_mul(gp + lo * 2 * inter, op + lo * inter, hi - lo, inter);
  });
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) || \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Every query row of a step against the paged cache, each as the decode kernel computes a decode
// (attend_one over the keys at positions [start, its own position]): q [T, H, D]; sequence s holds rows
// query_start_loc[s] .. [s + 1], the last of them at position seq_lens[s] - 1. The K/V of the step are
// in the caches already. Rows (on AVX-512 without a window, blocks of kRowBlock consecutive rows that read
// each key tile once: attend_rows) are handed to threads in pairs from both ends of each sequence, so a
// causal prefill's short and long rows share the work evenly, one KV head after another.
at::Tensor paged_attention_op(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, double scale, int64_t window) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "q must be float32 [T, H, D]");
  check_kv_caches(k_cache, v_cache, q_in.size(2));
  TORCH_CHECK(q_in.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [S, W]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == block_tables.size(0) &&
                  query_start_loc.scalar_type() == at::kInt && query_start_loc.numel() == seq_lens.numel() + 1,
              "seq_lens int32 [S], query_start_loc int32 [S + 1]");
  const at::Tensor q = q_in.contiguous();
  const int64_t heads = q.size(1), d = q.size(2), seqs = seq_lens.numel();
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), width = block_tables.size(1);
  const int64_t group = heads / kv_heads, kv_row = k_cache.size(3), row_stride = kv_heads * kv_row;
  const bool int8 = k_cache.scalar_type() == at::kChar;
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[seqs] == q.size(0), "query_start_loc must end at the step's row count");
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  // a row's query heads of one KV head together where this build has the grouped kernel (the same bits;
  // float32 caches only), and without a window kRowBlock consecutive rows together (attend_rows)
  const AttendGroup grouped = int8 ? nullptr : attend_group_for(group, d);
  const AttendRows blocked = grouped != nullptr && window <= 0 ? attend_rows_for(group, d) : nullptr;
  const int64_t block = blocked != nullptr ? kRowBlock : 1;
  // (first row, rows, sequence): blocks of consecutive rows, the first and last of a sequence, then the
  // second and the second last..., so a causal prefill's short and long rows share the work evenly
  struct Unit {
    int64_t row, rows, seq;
  };
  std::vector<Unit> order;
  order.reserve(q.size(0));
  for (int64_t s = 0; s < seqs; ++s) {
    std::vector<Unit> units;
    for (int64_t lo = starts[s]; lo < starts[s + 1]; lo += block) units.push_back({lo, std::min(block, starts[s + 1] - lo), s});
    for (size_t a = 0, b = units.size(); a < b; ++a) {
      order.push_back(units[a]);
      if (--b != a) order.push_back(units[b]);
    }
  }
  const int64_t per_row = grouped != nullptr ? kv_heads : heads;
  const int64_t tasks = static_cast<int64_t>(order.size()) * per_row;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end_task) {
    const int64_t span = width * block_size;
    std::vector<float> scores(block * (grouped != nullptr ? group : 1) * span), o_buf(block * group * d);
    for (int64_t task = begin; task < end_task; ++task) {
      // one KV head's rows after another: a thread's keys and values stay in its cache
      const int64_t units_n = static_cast<int64_t>(order.size());
      const Unit unit = order[task % units_n];
      const int64_t row = unit.row, s = unit.seq, part = task / units_n;
      if (unit.rows > 1) {  // attend_rows (no window: every row's keys start at 0)
        int64_t ends[kRowBlock];
        for (int64_t r = 0; r < unit.rows; ++r)
          ends[r] = std::min<int64_t>(lens[s] - (starts[s + 1] - 1 - (row + r)), span);
        const int64_t at = row * heads + part * group;
        blocked(qp + at * d, op + at * d, heads * d, unit.rows, ends, k_cache.data_ptr<float>() + part * d,
                v_cache.data_ptr<float>() + part * d, tables + s * width, block_size, row_stride,
                static_cast<float>(scale), scores.data(), span, o_buf.data());
        continue;
      }
      // this row's context: the sequence's, less the rows after it in the chunk
      const int64_t end = std::min<int64_t>(lens[s] - (starts[s + 1] - 1 - row), span);
      const int64_t start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      const int64_t first = grouped != nullptr ? part * group : part, count = grouped != nullptr ? group : 1;
      const int64_t at = row * heads + first, kvh = first / group;
      if (end <= start) {
        std::fill(op + at * d, op + (at + count) * d, 0.0f);
        continue;
      }
      const float sc = static_cast<float>(scale);
      if (int8)
        attend_one(qp + at * d, k_cache.data_ptr<int8_t>() + kvh * kv_row, v_cache.data_ptr<int8_t>() + kvh * kv_row,
                   tables + s * width, start, end, block_size, row_stride, sc, scores.data(), op + at * d, d);
      else if (grouped != nullptr)
        grouped(qp + at * d, k_cache.data_ptr<float>() + kvh * d, v_cache.data_ptr<float>() + kvh * d,
                tables + s * width, start, end, block_size, row_stride, sc, scores.data(), span, op + at * d);
      else
        attend_one(qp + at * d, k_cache.data_ptr<float>() + kvh * d, v_cache.data_ptr<float>() + kvh * d,
                   tables + s * width, start, end, block_size, row_stride, sc, scores.data(), op + at * d, d);
    }
  });
  return out;
}
#else
at::Tensor paged_attention_op(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, double, int64_t) {
  TORCH_CHECK(false, "cachegw's CPU kernels were built without AVX2 or AVX-512");
}
#endif

}  // namespace
