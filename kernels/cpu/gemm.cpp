// The step's GEMMs on CPU: y = [bias +] x @ W for x of a few rows (the batch), float32.
//
// In the fused core's time loop every GEMM has as many rows as sequences in the batch (8 in
// the small config) against a weight matrix of a few MB, once per step and layer, and the same
// W for every step of a window. BLAS libraries tune for large operands; at 8 rows MKL reaches
// about half of one core's FMA rate. Here:
//
// - `pack_weights` copies W once per window into panels of 24 columns, each panel K x 24
//   contiguous (zero-padded past N). Read in place, a panel's rows are N floats apart: every
//   row a new page, and the hardware prefetcher does not follow.
// - `packed_mm` keeps a tile of 4 rows x 24 columns of y in 12 vector registers while k runs
//   down the panel; each k broadcasts one x per row and loads 3 vectors of W. The next 4 rows
//   read the panel again from L1/L2.
//
// GCC/Clang vector types, not intrinsics: with -mavx2 -mfma a vector of 8 floats is one
// register and `acc += a * b` one FMA; without them it still compiles. The summation order
// differs from a BLAS's in the last bits. Bench (one core of the 2-core test machine, 8 rows):
// 70-87 GFLOP/s against MKL's 41-54.

#include "kernels.h"
#include "layout.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace gpn_cpu {
namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }

constexpr int kRows = 4;      // rows of x per tile
constexpr int64_t kPanel = 24;  // columns per panel: 3 vectors

// y[r, :cols] = b + x[r, :] @ panel for r < RB, where the panel is K x 24 contiguous and
// only the first `cols` (<= 24) columns are stored.
template <int RB>
void tile(const float* x, int64_t ldx, const float* panel, const float* b, float* y, int64_t ldy, int64_t K,
          int64_t cols) {
  v8 acc[RB][3];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = splat8(0.f);
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    const v8 w0 = load8(w), w1 = load8(w + 8), w2 = load8(w + 16);
    for (int r = 0; r < RB; ++r) {
      const v8 xb = splat8(x[r * ldx + k]);
      acc[r][0] += xb * w0;
      acc[r][1] += xb * w1;
      acc[r][2] += xb * w2;
    }
  }
  for (int r = 0; r < RB; ++r) {
    float* yr = y + r * ldy;
    if (cols == kPanel) {
      for (int j = 0; j < 3; ++j) store8(yr + 8 * j, b ? acc[r][j] + load8(b + 8 * j) : acc[r][j]);
    } else {  // the last panel: past N it holds padding
      for (int64_t c = 0; c < cols; ++c) yr[c] = acc[r][c / 8][c % 8] + (b ? b[c] : 0.f);
    }
  }
}

// A tile of nr (<= kRows) rows: the last rows of a batch that is not a multiple of 4 cost
// their FMAs only.
void tile_rows(int nr, const float* x, int64_t ldx, const float* panel, const float* b, float* y, int64_t ldy, int64_t K,
               int64_t cols) {
  switch (nr) {
    case 4: return tile<4>(x, ldx, panel, b, y, ldy, K, cols);
    case 3: return tile<3>(x, ldx, panel, b, y, ldy, K, cols);
    case 2: return tile<2>(x, ldx, panel, b, y, ldy, K, cols);
    default: return tile<1>(x, ldx, panel, b, y, ldy, K, cols);
  }
}

}  // namespace

at::Tensor pack_weights(const at::Tensor& W) {
  check_cpu("pack_weights", {{"W", W}});
  TORCH_CHECK_VALUE(W.dim() == 2 && W.scalar_type() == at::kFloat, "pack_weights: expected a 2-D float32 W, got ", W.sizes(),
                    " ", W.scalar_type());
  const int64_t K = W.size(0), N = W.size(1), panels = (N + kPanel - 1) / kPanel;
  const at::Tensor packed = at::empty({panels, K, kPanel}, W.options());
  const float* src = W.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  const int64_t sk = W.stride(0), sn = W.stride(1);  // any layout: a transposed view packs as well
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k = 0; k < K; ++k) {
        float* row = dst + (p * K + k) * kPanel;
        for (int64_t c = 0; c < kPanel; ++c) {
          const int64_t n = p * kPanel + c;
          row[c] = n < N ? src[k * sk + n * sn] : 0.f;
        }
      }
  });
  return packed;
}

at::Tensor packed_mm(const at::Tensor& x_, const at::Tensor& packed, int64_t N, OptTensor bias_, OptTensor out_) {
  check_cpu("packed_mm", {{"x", x_}, {"packed", packed}, {"bias", bias_}, {"out", out_}});
  TORCH_CHECK_VALUE(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "packed_mm: expected a 2-D float32 x, got ", x_.sizes(),
                    " ", x_.scalar_type());
  const int64_t R = x_.size(0), K = x_.size(1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.is_contiguous() && packed.size(0) == panels && packed.size(1) == K &&
                        packed.size(2) == kPanel && packed.scalar_type() == at::kFloat,
                    "packed_mm: the weights are not pack_weights of a (", K, ", ", N, ") float32 matrix");
  const In x = in_rows(x_, R, K, at::kFloat);
  const at::Tensor bias = bias_.has_value() ? bias_->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK_VALUE(!bias.defined() || bias.numel() == N, "packed_mm: bias must have ", N, " elements, got ", bias.numel());
  const Out y = out_rows(out_, R, N, x_, {R, N});
  const float* xp = x.at<float>(0);
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.at<float>(0);
  // Threads only for calls worth starting them for (~2 * 2^18 FLOPs a task).
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(R * K * kPanel, 1));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kPanel, cols = std::min(kPanel, N - n);
      for (int64_t r = 0; r < R; r += kRows)
        tile_rows(int(std::min<int64_t>(kRows, R - r)), xp + r * x.s_row, x.s_row, wp + p * K * kPanel, bp ? bp + n : nullptr,
                  yp + r * y.s_row + n, y.s_row, K, cols);
    }
  });
  return y.done();
}

}  // namespace gpn_cpu
