// Decode attention for a CPU, registered as torch operators (loaded by runners/kernels/paged_decode_kernel.py, which
// builds this file once with the system's compiler and keeps the library beside the compiled steps):
// - transformers_openai::paged_decode_attention: a one-token query per row over that row's K/V read in place in the
//   paged pool, block by block through the row's block table;
// - transformers_openai::cross_decode_attention: a one-token query over K/V kept whole per row, keys transposed
//   ([rows, heads, dim, positions]), as Whisper's cross-attention cache keeps them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// e^x for x <= 0 (a score minus its row's maximum) to about 2 ulp: x = n ln2 + r with |r| <= ln2/2, e^r by its
// Taylor polynomial of degree 7, 2^n written into the exponent bits. Plain arithmetic, so loops over it vectorize
// (std::exp does not without -ffast-math). Below -87, e^x is taken as e^-87 (about 1.6e-38).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: the sum's low mantissa bits hold round(x / ln2)
  const float shifted = x * 1.44269504088896341f + shifter;
  const float n = shifted - shifter;
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;  // ln2 in two parts
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  bits = (bits - 0x4B400000 + 127) << 23;  // n + 127 in the exponent field: 2^n
  float power;
  std::memcpy(&power, &bits, sizeof power);
  return p * power;
}

// Softmax numerators of `length` scores in place (e^(score - max)); returns their sum (the division comes later,
// once per output element).
inline float softmax_numerators(float* scores, int64_t length) {
  float top = -INFINITY;
#pragma omp simd reduction(max : top)
  for (int64_t pos = 0; pos < length; ++pos) top = scores[pos] > top ? scores[pos] : top;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t pos = 0; pos < length; ++pos) {
    const float e = exp_nonpositive(scores[pos] - top);
    scores[pos] = e;
    sum += e;
  }
  return sum;
}

// How far ahead of its reads a pass asks for keys or values: a few blocks, well inside the L2 cache.
constexpr int64_t kLookahead = 32 * 1024;

// Asks for one block of a head's pool (`bytes` from block `id`), a cache line at a time.
inline void prefetch(const float* pool, int64_t id, int64_t bytes) {
  const char* start = reinterpret_cast<const char*>(pool) + id * bytes;
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(start + byte);
}

// What one (row, K/V head) reads and where its scratch is.
struct Item {
  const float* query;  // [group, dim]: the query heads that share this K/V head
  const float* keys;   // this head's pool, [slots, dim]
  const float* values;
  const int64_t* table;  // the row's block ids
  int64_t length;        // tokens to attend to
  float* out;            // [group, dim]
};

// Attention of `group` query heads over one K/V head of one row, block by block. DIM > 0 fixes the head size at
// compile time (the dot products and sums unroll); 0 takes `dim`. `scores` holds `group` rows of `stride` floats,
// `acc` group * dim, `sums` group.
template <int DIM>
void attend(const Item& item, int64_t group, int64_t dim_arg, int64_t block, float scale, float* scores, int64_t stride,
            float* acc, float* sums) {
  const int64_t dim = DIM > 0 ? DIM : dim_arg;
  const int64_t length = item.length;
  // The blocks lie apart in the pool, where the hardware's prefetchers do not follow: the first `ahead` blocks of
  // keys and values are asked for at once, then each pass asks for the block `ahead` past the one it reads.
  const int64_t block_bytes = block * dim * int64_t(sizeof(float));
  const int64_t ahead = block_bytes >= kLookahead ? 1 : kLookahead / block_bytes;
  const int64_t blocks = (length + block - 1) / block;
  for (int64_t b = 0; b < blocks && b < ahead; ++b) {
    prefetch(item.keys, item.table[b], block_bytes);
    prefetch(item.values, item.table[b], block_bytes);
  }
  // Scores, four keys at a time (four independent sums).
  for (int64_t start = 0; start < length; start += block) {
    if (start / block + ahead < blocks) prefetch(item.keys, item.table[start / block + ahead], block_bytes);
    const float* key = item.keys + item.table[start / block] * block * dim;
    const int64_t count = length - start < block ? length - start : block;
    int64_t i = 0;
    for (; i + 4 <= count; i += 4, key += 4 * dim) {
      for (int64_t g = 0; g < group; ++g) {
        const float* q = item.query + g * dim;
        float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
        for (int64_t d = 0; d < dim; ++d) {
          d0 += q[d] * key[d];
          d1 += q[d] * key[dim + d];
          d2 += q[d] * key[2 * dim + d];
          d3 += q[d] * key[3 * dim + d];
        }
        float* s = scores + g * stride + start + i;
        s[0] = d0 * scale;
        s[1] = d1 * scale;
        s[2] = d2 * scale;
        s[3] = d3 * scale;
      }
    }
    for (; i < count; ++i, key += dim) {
      for (int64_t g = 0; g < group; ++g) {
        const float* q = item.query + g * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += q[d] * key[d];
        scores[g * stride + start + i] = dot * scale;
      }
    }
  }
  // Softmax numerators and their sums (the division comes at the end, once per output element).
  for (int64_t g = 0; g < group; ++g) {
    sums[g] = softmax_numerators(scores + g * stride, length);
  }
  for (int64_t i = 0; i < group * dim; ++i) acc[i] = 0.0f;
  for (int64_t start = 0; start < length; start += block) {
    if (start / block + ahead < blocks) prefetch(item.values, item.table[start / block + ahead], block_bytes);
    const float* value = item.values + item.table[start / block] * block * dim;
    const int64_t count = length - start < block ? length - start : block;
    for (int64_t i = 0; i < count; ++i, value += dim) {
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * stride + start + i];
        float* a = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += p * value[d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inverse = 1.0f / sums[g];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) item.out[g * dim + d] = acc[g * dim + d] * inverse;
  }
}

// q [rows, heads, dim]; pools [kv_heads, slots, dim]; tables [rows, width] (block ids); lengths [rows] (tokens
// each row attends to, its newest included); out [rows, heads, dim]. Query head h reads K/V head h / group.
void paged_decode_attention_f32(const float* q, const float* k_pool, const float* v_pool, const int64_t* tables,
                                const int64_t* lengths, float* out, int64_t rows, int64_t heads, int64_t kv_heads,
                                int64_t dim, int64_t slots, int64_t width, int64_t block, float scale, int threads) {
  const int64_t group = heads / kv_heads;
  const int64_t items = rows * kv_heads;
  const int64_t most = width * block;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(group * most);
    std::vector<float> acc(group * dim);
    std::vector<float> sums(group);
#pragma omp for schedule(static)
    for (int64_t index = 0; index < items; ++index) {
      const int64_t row = index / kv_heads, head = index % kv_heads;
      const int64_t offset = (row * heads + head * group) * dim;
      const Item item{q + offset,
                      k_pool + head * slots * dim,
                      v_pool + head * slots * dim,
                      tables + row * width,
                      lengths[row] < most ? lengths[row] : most,
                      out + offset};
      float *s = scores.data(), *a = acc.data(), *m = sums.data();
      switch (dim) {  // the usual head sizes unrolled
        case 16:
          attend<16>(item, group, dim, block, scale, s, most, a, m);
          break;
        case 32:
          attend<32>(item, group, dim, block, scale, s, most, a, m);
          break;
        case 64:
          attend<64>(item, group, dim, block, scale, s, most, a, m);
          break;
        case 128:
          attend<128>(item, group, dim, block, scale, s, most, a, m);
          break;
        default:
          attend<0>(item, group, dim, block, scale, s, most, a, m);
      }
    }
  }
}

// A stored element as float: float itself, or bfloat16 (its 16 bits are a float's upper half).
inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) {
  const uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Attention of one query head over one head's K/V kept whole per row with the keys transposed, `keys_t` [dim, length]
// (a dimension's values over all positions contiguous, rows `key_stride` apart) and `values` [length, dim] (rows
// `value_stride` apart): an encoder-decoder model's cross-attention K/V. The scores are `dim` passes of
// multiply-adds over contiguous positions, with no sum across a vector's lanes: on Whisper's 1,500 encoder positions
// this reads float32 K/V at 26-32 GB/s on two cores, where sdpa over keys [length, dim] reached 15-18. T is float or
// bfloat16 (then read as float, everything computed in float, the output rounded back).
template <typename T, int DIM>
void attend_transposed(const T* query, const T* keys_t, int64_t key_stride, const T* values, int64_t value_stride,
                       int64_t length, int64_t dim_arg, float scale, float* scores, float* acc, T* out) {
  const int64_t dim = DIM > 0 ? DIM : dim_arg;
  for (int64_t pos = 0; pos < length; ++pos) scores[pos] = 0.0f;
  for (int64_t d = 0; d < dim; ++d) {
    const float q = as_float(query[d]) * scale;
    const T* key = keys_t + d * key_stride;
#pragma omp simd
    for (int64_t pos = 0; pos < length; ++pos) scores[pos] += q * as_float(key[pos]);
  }
  const float sum = softmax_numerators(scores, length);
  for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;
  for (int64_t pos = 0; pos < length; ++pos) {
    const float p = scores[pos];
    const T* value = values + pos * value_stride;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += p * as_float(value[d]);
  }
  const float inverse = 1.0f / sum;
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<T>(acc[d] * inverse);
}

template <typename T>
void cross_decode_attention_typed(const at::Tensor& q, const at::Tensor& keys_t, const at::Tensor& values,
                                  at::Tensor& out, float scale) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(3), length = keys_t.size(3);
  const T *qp = q.data_ptr<T>(), *kp = keys_t.data_ptr<T>(), *vp = values.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scores(length);
    std::vector<float> acc(dim);
#pragma omp for schedule(static)
    for (int64_t index = 0; index < rows * heads; ++index) {
      const int64_t row = index / heads, head = index % heads;
      const T* k = kp + row * keys_t.stride(0) + head * keys_t.stride(1);
      const T* v = vp + row * values.stride(0) + head * values.stride(1);
      const T* qi = qp + index * dim;
      T* o = op + index * dim;
      if (dim == 64) {
        attend_transposed<T, 64>(qi, k, keys_t.stride(2), v, values.stride(2), length, dim, scale, scores.data(),
                                 acc.data(), o);
      } else {
        attend_transposed<T, 0>(qi, k, keys_t.stride(2), v, values.stride(2), length, dim, scale, scores.data(),
                                acc.data(), o);
      }
    }
  }
}

// query [rows, heads, 1, dim]; keys_t [rows, heads, dim, length]; values [rows, heads, length, dim]; each with its
// last dimension contiguous, the others at any stride; all float32 or all bfloat16. Rows and heads spread over the
// calling thread's OpenMP team.
at::Tensor cross_decode_attention(const at::Tensor& query, const at::Tensor& keys_t, const at::Tensor& values,
                                  double scale) {
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1, "query: [rows, heads, 1, dim]");
  TORCH_CHECK(keys_t.dim() == 4 && values.dim() == 4, "keys_t: [rows, heads, dim, length]; values: [..., length, dim]");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(3), length = keys_t.size(3);
  TORCH_CHECK(keys_t.size(0) == rows && keys_t.size(1) == heads && keys_t.size(2) == dim, "keys_t's shape");
  TORCH_CHECK(values.size(0) == rows && values.size(1) == heads && values.size(2) == length && values.size(3) == dim,
              "values' shape");
  const auto type = query.scalar_type();
  TORCH_CHECK(
      (type == at::kFloat || type == at::kBFloat16) && keys_t.scalar_type() == type && values.scalar_type() == type,
      "float32 or bfloat16, all three alike");
  TORCH_CHECK(keys_t.stride(3) == 1 && values.stride(3) == 1, "contiguous last dimensions");
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty_like(q);
  if (type == at::kFloat) {
    cross_decode_attention_typed<float>(q, keys_t, values, out, static_cast<float>(scale));
  } else {
    cross_decode_attention_typed<c10::BFloat16>(q, keys_t, values, out, static_cast<float>(scale));
  }
  return out;
}

// The operator torch calls: checks, the output, the thread count, then the kernel above. Registered in C++, so a
// compiled graph reaches it through the dispatcher alone (a Python operator cost a fifth of a small decode step).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                  const at::Tensor& tables, const at::Tensor& lengths, int64_t block_size,
                                  double scale) {
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1, "query: [rows, heads, 1, dim]");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes(), "pools: [kv_heads, slots, dim]");
  TORCH_CHECK(
      query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
      "float32 only");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong, "int64 tables and lengths");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "contiguous pools");
  TORCH_CHECK(query.size(1) % keys.size(0) == 0 && query.size(3) == keys.size(2), "heads and head size");
  const at::Tensor q = query.contiguous(), t = tables.contiguous(), l = lengths.contiguous();
  at::Tensor out = at::empty_like(q);
  paged_decode_attention_f32(q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
                             t.data_ptr<int64_t>(), l.data_ptr<int64_t>(), out.data_ptr<float>(), q.size(0), q.size(1),
                             keys.size(0), q.size(3), keys.size(1), t.size(1), block_size, static_cast<float>(scale),
                             at::get_num_threads());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(transformers_openai, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor keys, Tensor values, Tensor tables, Tensor lengths, "
      "int block_size, float scale) -> Tensor");
  m.def("cross_decode_attention(Tensor query, Tensor keys_t, Tensor values, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(transformers_openai, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("cross_decode_attention", &cross_decode_attention);
}
