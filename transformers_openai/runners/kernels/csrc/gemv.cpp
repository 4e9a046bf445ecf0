// A float32 matrix-vector product for a few rows, registered as a torch operator (loaded by
// runners/kernels/gemv_kernel.py, which builds this file once with the system's compiler):
// - transformers_openai::gemv(x [rows, in], blocked [blocks, in, 16], bias?, out_features, variant) -> [rows, out]:
//   y = x W^T + b with W laid out once (gemv_kernel.block_weight) in blocks of 16 output features, each block's
//   columns interleaved: blocked[b][k][j] = W[16 b + j][k], zero past the last feature. A block is one contiguous
//   stretch of memory read front to back, so the whole weight is one stream the CPU's prefetchers follow, and each
//   load of 16 weights feeds one fused multiply-add per row with no sums across lanes at the end. (No software
//   prefetch: on one sequential stream the hardware's does as well or better.)
// - transformers_openai::gemv_linear(x, weight, bias?, blocked) -> [rows, out]: a packed linear layer with both
//   layouts, `gemv` for at most four rows and oneDNN's packed product (`weight`) for more; what compiled graphs call.
//
// The rows go four at a time over each block (a decode step of 1-4 rows reads every weight once); the variant
// (AVX-512, AVX2 with FMA, or plain C++) is chosen when called from what the CPU reports, or forced by `variant` (the
// tests run each one this CPU has).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GEMV_X86 1
#endif

namespace {

constexpr int64_t kBlock = 16;  // output features a block interleaves (one AVX-512 register, two AVX2 ones)
constexpr int64_t kMaxRows = 4;

enum Variant : int64_t { kAuto = 0, kPlain = 1, kAvx2 = 2, kAvx512 = 3 };

// One block of 16 output features for `rows` (1-4) rows: out[r][j] = sum_k x[r][k] * block[k][j].
template <int R>
void block_plain(const float* x, int64_t x_stride, const float* block, int64_t in, float* out) {
  float acc[R][kBlock] = {};
  for (int64_t k = 0; k < in; ++k) {
    const float* w = block + k * kBlock;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * x_stride + k];
      for (int64_t j = 0; j < kBlock; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kBlock; ++j) out[r * kBlock + j] = acc[r][j];
}

#ifdef GEMV_X86
// Two accumulators a row (even and odd k), so that one row still has two independent chains of multiply-adds.
template <int R>
__attribute__((target("avx512f"))) void block_avx512(const float* x, int64_t x_stride, const float* block, int64_t in,
                                                     float* out) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= in; k += 2) {
    const float* w = block + k * kBlock;
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + kBlock);
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * x_stride + k]), even[r]);
      odd[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[r * x_stride + k + 1]), odd[r]);
    }
  }
  if (k < in) {
    const __m512 w0 = _mm512_loadu_ps(block + k * kBlock);
    for (int r = 0; r < R; ++r) even[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * x_stride + k]), even[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlock, _mm512_add_ps(even[r], odd[r]));
}

// The block's 16 features as two halves of 8, one accumulator each a row (at most 8 of AVX2's 16 registers).
template <int R>
__attribute__((target("avx2,fma"))) void block_avx2(const float* x, int64_t x_stride, const float* block, int64_t in,
                                                    float* out) {
  __m256 low[R], high[R];
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    const float* w = block + k * kBlock;
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + k);
      low[r] = _mm256_fmadd_ps(w0, xv, low[r]);
      high[r] = _mm256_fmadd_ps(w1, xv, high[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kBlock, low[r]);
    _mm256_storeu_ps(out + r * kBlock + 8, high[r]);
  }
}
#endif

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*);

template <template <int> class Pick>
BlockFn by_rows(int64_t rows) {
  switch (rows) {
    case 1:
      return Pick<1>::fn;
    case 2:
      return Pick<2>::fn;
    case 3:
      return Pick<3>::fn;
    default:
      return Pick<4>::fn;
  }
}

template <int R>
struct Plain {
  static constexpr BlockFn fn = block_plain<R>;
};
#ifdef GEMV_X86
template <int R>
struct Avx512 {
  static constexpr BlockFn fn = block_avx512<R>;
};
template <int R>
struct Avx2 {
  static constexpr BlockFn fn = block_avx2<R>;
};
#endif

bool has_variant(int64_t variant) {
  switch (variant) {
    case kPlain:
      return true;
#ifdef GEMV_X86
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f");
#endif
    default:
      return false;
  }
}

// The fastest variant this CPU runs (AVX-512, else AVX2 with FMA, else plain C++).
int64_t best_variant() {
  for (int64_t variant : {kAvx512, kAvx2})
    if (has_variant(variant)) return variant;
  return kPlain;
}

BlockFn block_fn(int64_t variant, int64_t rows) {
#ifdef GEMV_X86
  if (variant == kAvx512) return by_rows<Avx512>(rows);
  if (variant == kAvx2) return by_rows<Avx2>(rows);
#endif
  return by_rows<Plain>(rows);
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& blocked, const c10::optional<at::Tensor>& bias,
                int64_t out_features, int64_t variant) {
  TORCH_CHECK(x.dim() == 2 && blocked.dim() == 3 && blocked.size(2) == kBlock, "x: [rows, in]; blocked: [b, in, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && blocked.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(blocked.is_contiguous(), "a contiguous blocked weight");
  TORCH_CHECK(x.size(1) == blocked.size(1), "x's width is the weight's input features");
  TORCH_CHECK(out_features > 0 && out_features <= blocked.size(0) * kBlock, "out_features within the blocks");
  if (variant == kAuto) variant = best_variant();
  TORCH_CHECK(has_variant(variant), "this CPU cannot run gemv variant ", variant);
  const at::Tensor input = x.stride(1) == 1 ? x : x.contiguous();
  const float* bias_data = nullptr;
  at::Tensor bias_vector;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out_features, "a float32 bias of out_features");
    bias_vector = bias->contiguous();
    bias_data = bias_vector.data_ptr<float>();
  }
  const int64_t rows = input.size(0), in = input.size(1), blocks = (out_features + kBlock - 1) / kBlock;
  at::Tensor out = at::empty({rows, out_features}, input.options());
  const float* x_data = input.data_ptr<float>();
  const float* w_data = blocked.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t x_stride = input.stride(0);
  // Threads share the blocks, each at least about 256 KB of weights (a small layer stays on one thread).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, in * kBlock * 4));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    float tile[kMaxRows * kBlock];
    for (int64_t b = first; b < last; ++b) {
      const float* block = w_data + b * in * kBlock;
      const int64_t width = std::min(kBlock, out_features - b * kBlock);
      for (int64_t row = 0; row < rows; row += kMaxRows) {  // the block stays in cache for the next four
        const int64_t group = std::min(kMaxRows, rows - row);
        block_fn(variant, group)(x_data + row * x_stride, x_stride, block, in, tile);
        for (int64_t r = 0; r < group; ++r) {
          float* y = out_data + (row + r) * out_features + b * kBlock;
          for (int64_t j = 0; j < width; ++j) y[j] = tile[r * kBlock + j] + (bias_data ? bias_data[b * kBlock + j] : 0);
        }
      }
    }
  });
  return out;
}

// A packed linear layer's product, both of its layouts given: the kernel above for at most four rows, oneDNN's packed
// product (`weight`, from mkldnn::_reorder_linear_weight) for more. What a compiled graph calls: the dispatcher runs
// it from the graph's C++ without entering Python.
at::Tensor gemv_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& blocked) {
  if (x.size(0) <= kMaxRows) return gemv(x, blocked, bias, weight.size(0), kAuto);
  static const c10::OperatorHandle packed =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{
      x, weight, bias, c10::IValue("none"), c10::IValue(c10::List<c10::optional<c10::Scalar>>()), c10::IValue("")};
  packed.callBoxed(&stack);
  return stack[0].toTensor();
}

// The variant `gemv` runs when not told: 3 AVX-512, 2 AVX2 with FMA, 1 plain C++.
int64_t gemv_variant() { return best_variant(); }

bool gemv_has_variant(int64_t variant) { return has_variant(variant); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(transformers_openai, m) {
  m.def("gemv(Tensor x, Tensor blocked, Tensor? bias, int out_features, int variant=0) -> Tensor");
  m.def("gemv_linear(Tensor x, Tensor weight, Tensor? bias, Tensor blocked) -> Tensor");
  m.def("gemv_variant() -> int", &gemv_variant);
  m.def("gemv_has_variant(int variant) -> bool", &gemv_has_variant);
}

TORCH_LIBRARY_IMPL(transformers_openai, CPU, m) { m.impl("gemv", &gemv); }

// For any backend: oneDNN's packed weight is a tensor of its own (MkldnnCPU), the input a plain one.
TORCH_LIBRARY_IMPL(transformers_openai, CompositeExplicitAutograd, m) { m.impl("gemv_linear", &gemv_linear); }
