// An int8 matrix-vector product for a few rows, registered as a torch operator (loaded by
// runners/kernels/int8_gemv_kernel.py, which builds this file once with the system's compiler):
// - transformers_openai::int8_gemv(x [rows, in] float32, blocked [blocks, groups, 16, 4] int8, weight_sums [16 blocks]
//   int32, weight_scale [out] float32, bias?, out_features, variant) -> [rows, out] float32:
//   what int8_linear.Int8Linear computes through `torch._int_mm`, in one call: each row rounded to int8 by its own
//   scale (its largest magnitude over 127.5, rounded half to even into [-128, 127]), multiplied by the int8 weights
//   with the products summed in int32, the sum scaled back by the row's scale, then the channel's, then the bias
//   added. The integer sums are exact and the float steps are the same single roundings in the same order, so the
//   result equals the `_int_mm` path's bit for bit (tests/unit/test_int8_gemv_kernel.py holds it so).
// - transformers_openai::int8_linear(x, weight_t, weight_scale, bias?, blocked, weight_sums) -> [rows, out]: the
//   layer's whole product, `int8_gemv` for at most four rows and the `_int_mm` path for more; what compiled graphs
//   call.
//
// The weight is laid out once (int8_gemv_kernel.block_weight) in blocks of 16 output channels: blocked[b][g][j][t] =
// W[16 b + j][4 g + t], zero past the last channel and input. One group of a block is 64 bytes, the 16 channels' next
// four weights, which one VNNI instruction (`vpdpbusd`) multiplies with four bytes of a row and adds into 16 int32
// sums. That instruction takes unsigned bytes on one side: a row goes in with 128 added to each value, and
// weight_sums (128 times each channel's sum of weights) is taken off at the end.
//
// The rows go four at a time over each block (a decode step of 1-4 rows reads every weight once); the variant
// (AVX-512 VNNI, AVX-VNNI, or plain C++) is chosen when called from what the CPU reports, or forced by `variant` (the
// tests run each one this CPU has).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/round.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define INT8_GEMV_X86 1
#endif

// The rescale must round after each multiplication and the addition, as torch's separate passes do: no fused
// multiply-add. GCC contracts across statements unless told not to; clang contracts only within one expression.
#if defined(__GNUC__) && !defined(__clang__)
#define SEPARATE_ROUNDINGS __attribute__((noinline, optimize("fp-contract=off")))
#else
#define SEPARATE_ROUNDINGS __attribute__((noinline))
#endif

namespace {

constexpr int64_t kBlock = 16;  // output channels a block interleaves
constexpr int64_t kGroup = 4;   // inputs one channel's 32-bit lane holds
constexpr int64_t kMaxRows = 4;
constexpr int64_t kMaxIn = 65536;  // 255 * 127 * kMaxIn stays within int32

enum Variant : int64_t { kAuto = 0, kPlain = 1, kAvxVnni = 2, kAvx512Vnni = 3 };

// One block of 16 channels for `rows` (1-4) rows: sums[r][j] = sum_k xq[r][k] * block[k][j], xq unsigned (value+128).
template <int R>
void block_plain(const uint8_t* xq, int64_t xq_stride, const int8_t* block, int64_t groups, int32_t* sums) {
  int32_t acc[R][kBlock] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w = block + g * kBlock * kGroup;
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = xq + r * xq_stride + g * kGroup;
      for (int64_t j = 0; j < kBlock; ++j)
        for (int64_t t = 0; t < kGroup; ++t) acc[r][j] += int32_t{x[t]} * int32_t{w[j * kGroup + t]};
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kBlock; ++j) sums[r * kBlock + j] = acc[r][j];
}

#ifdef INT8_GEMV_X86
inline int32_t four_bytes(const uint8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

// Two accumulators a row (even and odd groups), so that one row still has two independent chains.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void block_avx512(const uint8_t* xq, int64_t xq_stride,
                                                                         const int8_t* block, int64_t groups,
                                                                         int32_t* sums) {
  __m512i even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_si512();
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    const int8_t* w = block + g * kBlock * kGroup;
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + kBlock * kGroup);
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = xq + r * xq_stride + g * kGroup;
      even[r] = _mm512_dpbusd_epi32(even[r], _mm512_set1_epi32(four_bytes(x)), w0);
      odd[r] = _mm512_dpbusd_epi32(odd[r], _mm512_set1_epi32(four_bytes(x + kGroup)), w1);
    }
  }
  if (g < groups) {
    const __m512i w0 = _mm512_loadu_si512(block + g * kBlock * kGroup);
    for (int r = 0; r < R; ++r)
      even[r] = _mm512_dpbusd_epi32(even[r], _mm512_set1_epi32(four_bytes(xq + r * xq_stride + g * kGroup)), w0);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_si512(sums + r * kBlock, _mm512_add_epi32(even[r], odd[r]));
}

// The block's 16 channels as two halves of 8, one accumulator each a row.
template <int R>
__attribute__((target("avx2,avxvnni"))) void block_avx_vnni(const uint8_t* xq, int64_t xq_stride, const int8_t* block,
                                                            int64_t groups, int32_t* sums) {
  __m256i low[R], high[R];
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w = block + g * kBlock * kGroup;
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlock * kGroup / 2));
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_set1_epi32(four_bytes(xq + r * xq_stride + g * kGroup));
      low[r] = _mm256_dpbusd_avx_epi32(low[r], xv, w0);
      high[r] = _mm256_dpbusd_avx_epi32(high[r], xv, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + r * kBlock), low[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + r * kBlock + 8), high[r]);
  }
}
#endif

using BlockFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int32_t*);

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
#ifdef INT8_GEMV_X86
template <int R>
struct Avx512 {
  static constexpr BlockFn fn = block_avx512<R>;
};
template <int R>
struct AvxVnni {
  static constexpr BlockFn fn = block_avx_vnni<R>;
};
#endif

bool has_variant(int64_t variant) {
  switch (variant) {
    case kPlain:
      return true;
#ifdef INT8_GEMV_X86
    case kAvxVnni:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vnni");
#endif
    default:
      return false;
  }
}

// The fastest variant this CPU runs (AVX-512 VNNI, else AVX-VNNI, else plain C++).
int64_t best_variant() {
  for (int64_t variant : {kAvx512Vnni, kAvxVnni})
    if (has_variant(variant)) return variant;
  return kPlain;
}

BlockFn block_fn(int64_t variant, int64_t rows) {
#ifdef INT8_GEMV_X86
  if (variant == kAvx512Vnni) return by_rows<Avx512>(rows);
  if (variant == kAvxVnni) return by_rows<AvxVnni>(rows);
#endif
  return by_rows<Plain>(rows);
}

// A row rounded to int8 as Int8Linear.forward rounds it, stored with 128 added (zeros, 128, past `in`); returns the
// row's scale.
float quantize_row(const float* x, int64_t in, uint8_t* xq, int64_t padded) {
  float largest = 0.0f;
  for (int64_t k = 0; k < in; ++k) largest = std::max(largest, std::fabs(x[k]));
  const float scale = std::max(largest, 1e-12f) / 127.5f;
  for (int64_t k = 0; k < in; ++k) {
    const float q = std::min(std::max(std::nearbyint(x[k] / scale), -128.0f), 127.0f);
    xq[k] = static_cast<uint8_t>(static_cast<int32_t>(q) + 128);
  }
  std::fill(xq + in, xq + padded, uint8_t{128});
  return scale;
}

// y[j] = float(sum[j] - offset[j]) * row_scale * channel_scale[j] + bias[j], each step rounded on its own.
SEPARATE_ROUNDINGS void rescale(const int32_t* sums, const int32_t* offsets, float row_scale,
                                const float* channel_scales, const float* bias, int64_t width, float* y) {
  for (int64_t j = 0; j < width; ++j) {
    float value = static_cast<float>(sums[j] - offsets[j]) * row_scale;
    value = value * channel_scales[j];
    if (bias != nullptr) value = value + bias[j];
    y[j] = value;
  }
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& blocked, const at::Tensor& weight_sums,
                     const at::Tensor& weight_scale, const c10::optional<at::Tensor>& bias, int64_t out_features,
                     int64_t variant) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [rows, in]");
  TORCH_CHECK(blocked.dim() == 4 && blocked.size(2) == kBlock && blocked.size(3) == kGroup &&
                  blocked.scalar_type() == at::kChar && blocked.is_contiguous(),
              "blocked: contiguous int8 [blocks, groups, 16, 4]");
  const int64_t in = x.size(1), blocks = blocked.size(0), groups = blocked.size(1);
  TORCH_CHECK(in > 0 && in <= kMaxIn && groups == (in + kGroup - 1) / kGroup, "x's width is the weight's inputs");
  TORCH_CHECK(out_features > 0 && (out_features + kBlock - 1) / kBlock == blocks, "out_features fill the blocks");
  TORCH_CHECK(
      weight_sums.scalar_type() == at::kInt && weight_sums.is_contiguous() && weight_sums.numel() == blocks * kBlock,
      "weight_sums: contiguous int32 [16 blocks]");
  TORCH_CHECK(
      weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() && weight_scale.numel() == out_features,
      "weight_scale: contiguous float32 [out_features]");
  if (variant == kAuto) variant = best_variant();
  TORCH_CHECK(has_variant(variant), "this CPU cannot run int8_gemv variant ", variant);
  const float* bias_data = nullptr;
  at::Tensor bias_vector;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out_features, "a float32 bias of out_features");
    bias_vector = bias->contiguous();
    bias_data = bias_vector.data_ptr<float>();
  }
  const at::Tensor input = x.contiguous();
  const int64_t rows = input.size(0), padded = groups * kGroup;
  std::vector<uint8_t> xq(static_cast<size_t>(std::max<int64_t>(rows, 1) * padded));
  std::vector<float> row_scales(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    row_scales[r] = quantize_row(input.data_ptr<float>() + r * in, in, xq.data() + r * padded, padded);
  at::Tensor out = at::empty({rows, out_features}, input.options());
  const int8_t* w_data = blocked.data_ptr<int8_t>();
  const int32_t* offsets = weight_sums.data_ptr<int32_t>();
  const float* channel_scales = weight_scale.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  // Threads share the blocks, each at least about 64 KB of weights (a small layer stays on one thread).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (padded * kBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    int32_t sums[kMaxRows * kBlock];
    for (int64_t b = first; b < last; ++b) {
      const int8_t* block = w_data + b * padded * kBlock;
      const int64_t width = std::min(kBlock, out_features - b * kBlock);
      for (int64_t row = 0; row < rows; row += kMaxRows) {  // the block stays in cache for the next four
        const int64_t group = std::min(kMaxRows, rows - row);
        block_fn(variant, group)(xq.data() + row * padded, padded, block, groups, sums);
        for (int64_t r = 0; r < group; ++r)
          rescale(sums + r * kBlock, offsets + b * kBlock, row_scales[row + r], channel_scales + b * kBlock,
                  bias_data ? bias_data + b * kBlock : nullptr, width,
                  out_data + (row + r) * out_features + b * kBlock);
      }
    }
  });
  return out;
}

// An int8 layer's whole product, both of its layouts given: the kernel above for at most four rows, else
// `_int_mm` over `weight_t` ([in, out] int8) with the row rounded and the result scaled back as Int8Linear's eager
// passes do it (the same operators, so the same bits). What a compiled graph calls: no Python between the graph and
// the product, and no pass of it rewritten by the compiler.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight_t, const at::Tensor& weight_scale,
                       const c10::optional<at::Tensor>& bias, const at::Tensor& blocked,
                       const at::Tensor& weight_sums) {
  const int64_t out_features = weight_t.size(1);
  if (x.size(0) <= kMaxRows) return int8_gemv(x, blocked, weight_sums, weight_scale, bias, out_features, kAuto);
  const at::Tensor x_scale = x.abs().amax({1}, /*keepdim=*/true).clamp_min(1e-12).div(127.5);
  const at::Tensor x_int8 = at::round(x.div(x_scale)).clamp(-128, 127).to(at::kChar);
  at::Tensor y = at::_int_mm(x_int8, weight_t).mul(x_scale).mul_(weight_scale);
  if (bias.has_value() && bias->defined()) y = y.add(*bias);
  return y;
}

// The variant `int8_gemv` runs when not told: 3 AVX-512 VNNI, 2 AVX-VNNI, 1 plain C++.
int64_t int8_gemv_variant() { return best_variant(); }

bool int8_gemv_has_variant(int64_t variant) { return has_variant(variant); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(transformers_openai, m) {
  m.def(
      "int8_gemv(Tensor x, Tensor blocked, Tensor weight_sums, Tensor weight_scale, Tensor? bias, int out_features, "
      "int variant=0) -> Tensor");
  m.def(
      "int8_linear(Tensor x, Tensor weight_t, Tensor weight_scale, Tensor? bias, Tensor blocked, Tensor weight_sums) "
      "-> Tensor");
  m.def("int8_gemv_variant() -> int", &int8_gemv_variant);
  m.def("int8_gemv_has_variant(int variant) -> bool", &int8_gemv_has_variant);
}

TORCH_LIBRARY_IMPL(transformers_openai, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int8_linear", &int8_linear);
}
