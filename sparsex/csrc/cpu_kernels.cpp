// Native CPU kernels for the decode hot path, built at first use by sparsex/layers/cpu_kernels.py.
//
//   decode_attention  one query row per sequence against the paged KV cache (no gather copies)
//   multi_row_attention  several query rows per sequence (prefill, sparse rows): flash-style tiles
//                     Both take an optional sliding window (a row at position i sees keys i-W+1..i;
//                     key blocks before it are not read) and logit softcapping (s -> C tanh(s / C)).
//   store_kv          this step's K and V rows into their cache slots in one call
//   rms_norm          RMSNorm; add_rms_norm fuses the residual add
//   rope              rotary embedding of q and k (HF rotate_half layout) in one call
//   silu_and_mul      SiLU(gate) * up of the MLP's fused gate_up projection
//
// Every kernel takes bfloat16 or float32 tensors and computes in float32. The elementwise kernels
// reproduce the torch reference's rounding steps (sparsex/layers/*.py): this file is compiled with
// -ffp-contract=off so `a * b - c * d` rounds each product like the separate torch ops do; FMAs
// are only used, explicitly, in the attention dot products. Bad arguments raise ValueError in
// Python (TORCH_CHECK_VALUE): checking them here costs nothing, in the Python wrappers ~10 us a
// call. Work is split over torch's intra-op threads with at::parallel_for. The includes are the
// few headers needed rather than <torch/extension.h>, which triples the build time (~30 s).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// ------------------------------------------------------------------ 16-lane float32 vectors

constexpr int64_t kLanes = 16;
using vf = float __attribute__((vector_size(64)));        // 16 x float32
using vi = int32_t __attribute__((vector_size(64)));      // 16 x int32
using vu = uint32_t __attribute__((vector_size(64)));     // 16 x uint32
using vh = uint16_t __attribute__((vector_size(32)));     // 16 x uint16 (bfloat16 bits)

inline vf splat(float x) { return vf{} + x; }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load(const c10::BFloat16* p) {                  // bfloat16 -> float32 is exact: bits << 16
#ifdef __AVX512F__
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// float32 -> bfloat16 -> float32: round to nearest even like c10::BFloat16(float); NaN stays NaN
inline vf round_bf16(vf v) {
  const vu u = (vu)v;
  const vf rounded = (vf)((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
  return (v != v) ? (vf)(vu{} + 0x7FC00000u) : rounded;
}

inline void store(c10::BFloat16* p, vf v) {
  const vh h = __builtin_convertvector((vu)round_bf16(v) >> 16, vh);
  std::memcpy(p, &h, sizeof h);
}

// Rounds float32 to the storage type and back (a no-op for float32): the torch reference's
// intermediate results that are materialised in the model dtype.
template <typename T>
inline vf round_to(vf v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return round_bf16(v);
}

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

inline vf fmadd(vf a, vf b, vf c) {                        // a * b + c, one rounding where the CPU can
#ifdef __AVX512F__
  return _mm512_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline float hsum(vf v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(v);
#else
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

// Lane i of the result = the sum of the lanes of v[i], for 16 vectors at once (~3 instructions a
// sum instead of ~8 for separate reductions).
inline vf hsum16(const vf* v) {
#ifdef __AVX512F__
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)       // a[i] 128-bit quarters: 2 x 4 partial sums of v[2i], then of v[2i+1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)       // b[i] quarter k: 4 partial sums of v[4i + k]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)       // c[i] quarter k: 2 partial sums of v[8i + k], then of v[8i + 4 + k]
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter k, lane m: the sum of v[4m + k]; the permutation puts it at lane 4m + k
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, d);
#else
  vf r;
  for (int64_t i = 0; i < kLanes; ++i) r[i] = hsum(v[i]);
  return r;
#endif
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

inline float hmax(vf v) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(v);
#else
  float m = v[0];
  for (int64_t i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
#endif
}

// exp(x) to ~1 ulp (Cephes expf): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial.
// Lanes below -87.3 (incl. -inf) give 0.
inline vf vexp(vf x) {
  const vf big = splat(12582912.0f);                       // 1.5 * 2^23: adding it rounds to an integer
  const vf xc = vmax(x, splat(-87.0f));
  const vf n = (xc * splat(1.44269504088896341f) + big) - big;
  const vf r = (xc - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  const vf e = fmadd(p, r * r, r) + splat(1.0f);
  const vf pow2n = (vf)((__builtin_convertvector(n, vi) + 127) << 23);
  return (x < splat(-87.3f)) ? vf{} : e * pow2n;
}

inline float sexp(float x) { return vexp(splat(x))[0]; }   // the same function for scalar tails

inline vf vmin(vf a, vf b) { return a < b ? a : b; }

// tanh(x) to a few ulp (Cephes tanhf): an odd polynomial for |x| <= 0.625, where 1 - 2 / (e^2|x| + 1)
// would lose the small result to cancellation; that formula above it, |x| clamped at 9 (tanh is 1.0f
// there) so exp cannot overflow.
inline vf vtanh(vf x) {
  const vf z = x < splat(0.f) ? -x : x;
  const vf t = splat(1.f) - splat(2.f) / (vexp(splat(2.f) * vmin(z, splat(9.f))) + splat(1.f));
  const vf s = x * x;
  vf p = splat(-5.70498872745e-3f);
  p = fmadd(p, s, splat(2.06390887954e-2f));
  p = fmadd(p, s, splat(-5.37397155531e-2f));
  p = fmadd(p, s, splat(1.33314422036e-1f));
  p = fmadd(p, s, splat(-3.33332819422e-1f));
  const vf small = fmadd(p * s, x, x);
  return z > splat(0.625f) ? (x < splat(0.f) ? -t : t) : small;
}

// Attention-logit softcapping (Gemma): cap * tanh(score / cap), on scores already scaled. cap > 0.
inline vf softcap(vf score, float cap) { return splat(cap) * vtanh(score / splat(cap)); }

// Calls f(T{}) with T = c10::BFloat16 or float, the tensor dtype (checked by check_float).
template <typename F>
void dispatch_float_types(at::ScalarType type, F&& f) {
  if (type == at::kBFloat16)
    f(c10::BFloat16{});
  else
    f(float{});
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat),
                    name, " must be a bfloat16 or float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

void check_same_dtype(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == like.scalar_type(), name,
                    " must be a CPU tensor of dtype ", like.scalar_type(), ", got ", t.scalar_type());
}

void check_index(const at::Tensor& t, at::ScalarType type, int64_t length, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.size(0) == length,
                    name, " must be a [", length, "] ", type, " CPU tensor, got ", t.sizes(), " ", t.scalar_type());
}

// Each thread gets at least this many elements of row-wise work (small batches stay on one thread).
constexpr int64_t kElemsPerTask = 16384;

inline int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, kElemsPerTask / std::max<int64_t>(1, row_elems));
}

// ------------------------------------------------------------------ paged decode attention

// Key dot products come 16 keys at a time as 16 vectors of lanewise partial sums (dot[t] for key
// t); hsum16 turns them into one vector of 16 scores. Compile-time sizes keep dot[] and the query in
// registers.

// From float32 rows, `stride` floats apart, with a float32 query (NV vectors). Keys m..15 get 0.
template <int64_t NV>
inline void dots_f32(const vf* q, const float* rows, int64_t stride, int64_t m, vf* dot) {
  auto one = [&](int64_t t) {
    const float* r = rows + t * stride;
    vf acc = q[0] * load(r);
#pragma GCC unroll 16
    for (int64_t j = 1; j < NV; ++j) acc = fmadd(q[j], load(r + j * kLanes), acc);
    dot[t] = acc;
  };
  if (m == kLanes) {
#pragma GCC unroll 16
    for (int64_t t = 0; t < kLanes; ++t) one(t);
  } else {
    for (int64_t t = 0; t < m; ++t) one(t);
    for (int64_t t = m; t < kLanes; ++t) dot[t] = vf{};
  }
}

#ifdef __AVX512BF16__
constexpr bool kBf16DotProducts = true;
using vbf = __m512bh;                                     // 32 x bfloat16

// From bfloat16 rows straight from the cache, `stride` elements apart, with a bfloat16 query (NV/2
// vectors of 32): vdpbf16ps adds pairs of bf16 x bf16 products (exact in float32) to float32 lanes,
// so K is never converted. Keys m..15 repeat key m-1 (their scores are masked).
template <int64_t NV>
inline void dots_bf16(const vbf* q, const c10::BFloat16* rows, int64_t stride, int64_t m, vf* dot) {
#pragma GCC unroll 16
  for (int64_t t = 0; t < kLanes; ++t) {
    const c10::BFloat16* r = rows + std::min(t, m - 1) * stride;
    __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int64_t j = 0; j < NV / 2; ++j) acc = _mm512_dpbf16_ps(acc, q[j], (vbf)_mm512_loadu_si512(r + j * 32));
    dot[t] = acc;
  }
}
#else
constexpr bool kBf16DotProducts = false;
struct vbf {};                                            // unused without AVX512-BF16
template <int64_t NV>                                     // declared for the discarded branches only
void dots_bf16(const vbf* q, const c10::BFloat16* rows, int64_t stride, int64_t m, vf* dot);
#endif

// `count` rows of one KV head in a cache block as float32: bfloat16 rows are converted into
// `scratch` ([count, D]); float32 rows are read in place. Returns the first row and sets `stride`.
template <int64_t NV>
inline const float* head_rows(const c10::BFloat16* rows, int64_t count, int64_t tok_stride, float* scratch,
                              int64_t& stride) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t j = 0; j < NV; ++j)
      store(scratch + (t * NV + j) * kLanes, load(rows + t * tok_stride + j * kLanes));
  stride = NV * kLanes;
  return scratch;
}

template <int64_t NV>
inline const float* head_rows(const float* rows, int64_t, int64_t tok_stride, float*, int64_t& stride) {
  stride = tok_stride;
  return rows;
}

// Blocks ahead of the one being read whose K/V rows a task asks for (software prefetch): a
// sequence's blocks sit anywhere in the cache, so the hardware prefetcher cannot follow it from
// one block to the next. The requests are spread over the block's work (`part` of `parts`);
// issued all at once they stall on the core's few outstanding-miss slots (measured: slower than
// no prefetch at all).
constexpr int64_t kPrefetchBlocks = 2;

// Part `part` of `parts` of `rows` rows of `row_bytes` bytes, `row_stride` bytes apart, from p on.
inline void prefetch_part(const void* p, int64_t rows, int64_t row_bytes, int64_t row_stride, int64_t part,
                          int64_t parts) {
  const int64_t row_lines = (row_bytes + 63) / 64, lines = rows * row_lines;
  for (int64_t l = lines * part / parts, e = lines * (part + 1) / parts; l < e; ++l)
    __builtin_prefetch(static_cast<const char*>(p) + l / row_lines * row_stride + l % row_lines * 64);
}

// One query head's running softmax over the blocks seen so far (online softmax, float32).
template <int64_t NV>
struct HeadState {
  vf acc[NV] = {};                                        // sum_p exp(score_p - max) * v_p
  float max = -std::numeric_limits<float>::infinity();
  float denom = 0.f;                                      // sum_p exp(score_p - max)
};

// Adds one block's `count` keys to query head `st`: `dots(t0, m, dot)` gives the dot vectors of
// keys t0..t0+m-1, `score_scale` scales their sums, `cap` > 0 softcaps the scaled scores (0: none);
// v: float32 rows `stride` apart; scores: scratch of count rounded up to 16 floats.
template <int64_t NV, typename Dots>
inline void attend_block(const Dots& dots, float score_scale, float cap, const float* v, int64_t stride,
                         int64_t count, float* scores, HeadState<NV>& st) {
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
  vf block_max = neg_inf;
  for (int64_t t0 = 0; t0 < count; t0 += kLanes) {
    const int64_t m = std::min(kLanes, count - t0);
    vf dot[kLanes];
    dots(t0, m, dot);
    vf sc = hsum16(dot) * splat(score_scale);
    if (cap > 0.f) sc = softcap(sc, cap);
    sc = (lane < static_cast<int32_t>(m)) ? sc : neg_inf;
    store(scores + t0, sc);
    block_max = vmax(block_max, sc);
  }
  const float new_max = std::max(st.max, hmax(block_max));
  const float alpha = sexp(st.max - new_max);             // rescales what was summed under the old max
  vf sum{};
  for (int64_t t0 = 0; t0 < count; t0 += kLanes) {
    const vf e = vexp(load(scores + t0) - splat(new_max));
    store(scores + t0, e);
    sum += e;
  }
  st.denom = st.denom * alpha + hsum(sum);
  st.max = new_max;
  vf a[NV];
  for (int64_t j = 0; j < NV; ++j) a[j] = st.acc[j] * splat(alpha);
  for (int64_t t = 0; t < count; ++t) {
    const vf w = splat(scores[t]);
    for (int64_t j = 0; j < NV; ++j) a[j] = fmadd(w, load(v + t * stride + j * kLanes), a[j]);
  }
  for (int64_t j = 0; j < NV; ++j) st.acc[j] = a[j];
}

// NV = head_dim / 16, a compile-time constant so a query head's vectors and its output accumulator
// stay in registers while the loops run over the keys.
template <typename T, int64_t NV>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& positions, float scale,
                           int64_t window, float cap, at::Tensor& out) {
  constexpr int64_t D = NV * kLanes;
  constexpr bool bf16_dots = kBf16DotProducts && std::is_same_v<T, c10::BFloat16> && NV % 2 == 0;
  const int64_t S = query.size(0), H = query.size(1);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH;
  const int64_t q_ts = query.stride(0), q_hs = query.stride(1);
  const int64_t tok_stride = KVH * D;                      // between consecutive tokens of a cache block
  const int64_t bt_stride = block_tables.stride(0);
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int32_t* bt_ptr = block_tables.data_ptr<int32_t>();
  const int64_t* pos_ptr = positions.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  // A task is a sequence and a range of its KV heads. All heads of a sequence when there are
  // enough sequences to keep the threads busy: it then reads each cache block as one contiguous
  // run, which the memory system streams far better than a head's strided rows. One head each
  // otherwise. Every K/V row is read once for the G query heads sharing it.
  const int64_t task_heads = S >= 4 * at::get_num_threads() ? KVH : 1;
  const int64_t tasks_per_seq = KVH / task_heads, task_q_heads = task_heads * G;
  // the rows a task reads in a block: one contiguous run (all heads) or one head's row per token
  const bool whole_blocks = task_heads == KVH;
  const int64_t pf_rows = whole_blocks ? 1 : BS, pf_row_stride = tok_stride * sizeof(T);
  const int64_t pf_row_bytes = (whole_blocks ? BS * KVH * D : D) * sizeof(T);

  at::parallel_for(0, S * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> k_scratch(BS * D), v_scratch(BS * D);     // [BS, D] one head's rows in float32
    std::vector<float> scores((BS + kLanes - 1) / kLanes * kLanes);
    std::vector<vf> q_f32(task_q_heads * NV);                    // [heads, D] queries, scaled
    std::vector<vbf> q_bf16(bf16_dots ? task_q_heads * NV / 2 : 0);   // [heads, D] queries, raw bf16
    std::vector<HeadState<NV>> state(task_q_heads);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / tasks_per_seq, h0 = task % tasks_per_seq * task_heads;
      const int64_t n = pos_ptr[s] + 1;                   // keys lo..positions[s]
      const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int32_t* table = bt_ptr + s * bt_stride;
      for (int64_t i = 0; i < task_q_heads; ++i) {
        const T* q_row = q_ptr + s * q_ts + (h0 * G + i) * q_hs;
        if constexpr (bf16_dots) {
          for (int64_t j = 0; j < NV / 2; ++j) q_bf16[i * NV / 2 + j] = (vbf)_mm512_loadu_si512(q_row + j * 32);
        } else {
          for (int64_t j = 0; j < NV; ++j) q_f32[i * NV + j] = load(q_row + j * kLanes) * splat(scale);
        }
        state[i] = HeadState<NV>{};
      }
      for (int64_t p0 = lo / BS * BS; p0 < n; p0 += BS) {      // the window's blocks only
        const int64_t skip = std::max<int64_t>(0, lo - p0);     // keys of the first block before the window
        const int64_t count = std::min(BS, n - p0) - skip;
        const int64_t base = table[p0 / BS] * BS * KVH * D + skip * tok_stride;
        const int64_t pf_pos = p0 + kPrefetchBlocks * BS;
        const int64_t pf_base = pf_pos < n ? table[pf_pos / BS] * BS * KVH * D + (whole_blocks ? 0 : h0 * D) : -1;
        for (int64_t h = h0; h < h0 + task_heads; ++h) {
          const T* k_rows = k_ptr + base + h * D;
          int64_t stride;                                 // of the float32 rows, K's and V's alike
          const float* v = head_rows<NV>(v_ptr + base + h * D, count, tok_stride, v_scratch.data(), stride);
          const float* k = nullptr;
          if constexpr (!bf16_dots) k = head_rows<NV>(k_rows, count, tok_stride, k_scratch.data(), stride);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t i = (h - h0) * G + g;
            if (pf_base >= 0) {
              prefetch_part(k_ptr + pf_base, pf_rows, pf_row_bytes, pf_row_stride, i, task_q_heads);
              prefetch_part(v_ptr + pf_base, pf_rows, pf_row_bytes, pf_row_stride, i, task_q_heads);
            }
            if constexpr (bf16_dots) {
              const auto dots = [&](int64_t t0, int64_t m, vf* dot) {
                dots_bf16<NV>(q_bf16.data() + i * NV / 2, k_rows + t0 * tok_stride, tok_stride, m, dot);
              };
              attend_block<NV>(dots, scale, cap, v, stride, count, scores.data(), state[i]);
            } else {
              const auto dots = [&](int64_t t0, int64_t m, vf* dot) {
                dots_f32<NV>(q_f32.data() + i * NV, k + t0 * stride, stride, m, dot);
              };
              attend_block<NV>(dots, 1.0f, cap, v, stride, count, scores.data(), state[i]);
            }
          }
        }
      }
      for (int64_t i = 0; i < task_q_heads; ++i) {
        const vf d = splat(state[i].denom);
        T* o_row = o_ptr + (s * H + h0 * G + i) * D;
        for (int64_t j = 0; j < NV; ++j) store(o_row + j * kLanes, state[i].acc[j] / d);
      }
    }
  });
}

// Shared checks of the attention kernels: query [N, H, D] and matching paged caches
// [num_blocks, block_size, KVH, D] of the query's dtype, H a multiple of KVH.
static void check_attention_inputs(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  check_float(query, "query");
  check_same_dtype(k_cache, query, "k_cache");
  check_same_dtype(v_cache, query, "v_cache");
  TORCH_CHECK_VALUE(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "expected query [rows, H, D] and caches [blocks, block_size, KVH, D], got ", query.sizes(),
                    ", ", k_cache.sizes(), ", ", v_cache.sizes());
  TORCH_CHECK_VALUE(k_cache.size(3) == query.size(2), "head_dim ", query.size(2), " does not match the cache's ",
                    k_cache.size(3));
  TORCH_CHECK_VALUE(k_cache.size(2) > 0 && query.size(1) % k_cache.size(2) == 0, "num_heads ", query.size(1),
                    " is not a multiple of num_kv_heads ", k_cache.size(2));
}

// The optional arguments of both attention kernels: a sliding window of `window` keys (0: none)
// and logit softcapping at `cap` (0: none).
static void check_window_and_cap(int64_t window, double cap) {
  TORCH_CHECK_VALUE(window >= 0, "sliding_window must be positive (0: none), got ", window);
  TORCH_CHECK_VALUE(cap >= 0 && std::isfinite(cap), "logits_soft_cap must be positive (0: none), got ", cap);
}

// query [S, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D]; block_tables [S, max_blocks]
// int32; positions [S] int64 (row s sees keys 0..positions[s] of its sequence, the last `window` of
// them when window > 0); cap > 0 softcaps the scaled scores. Returns [S, H, D] in the query dtype.
at::Tensor decode_attention(const at::Tensor& query_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in,
                            const at::Tensor& block_tables_in, const at::Tensor& positions_in, double scale,
                            int64_t window, double cap) {
  check_attention_inputs(query_in, k_cache_in, v_cache_in);
  check_window_and_cap(window, cap);
  const int64_t S = query_in.size(0), H = query_in.size(1), D = query_in.size(2), KVH = k_cache_in.size(2);
  TORCH_CHECK_VALUE(block_tables_in.device().is_cpu() && block_tables_in.scalar_type() == at::kInt &&
                    block_tables_in.dim() == 2 && block_tables_in.size(0) == S,
                    "block_tables must be [", S, ", max_blocks] int32, got ", block_tables_in.sizes(), " ",
                    block_tables_in.scalar_type());
  check_index(positions_in, at::kLong, S, "positions");
  const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  const at::Tensor k_cache = k_cache_in.contiguous(), v_cache = v_cache_in.contiguous();
  const at::Tensor block_tables = block_tables_in.stride(1) == 1 ? block_tables_in : block_tables_in.contiguous();
  const at::Tensor positions = positions_in.contiguous();
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  const int64_t max_keys = block_tables.size(1) * block_size;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK_VALUE(pos[s] >= 0 && pos[s] < max_keys, "position ", pos[s], " of row ", s,
                      " is outside its block table (", max_keys, " keys)");
    const int32_t* table = block_tables.data_ptr<int32_t>() + s * block_tables.stride(0);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[s] + 1 - window) : 0;   // the blocks read
    for (int64_t b = lo / block_size; b <= pos[s] / block_size; ++b)
      TORCH_CHECK_VALUE(table[b] >= 0 && table[b] < num_blocks, "block table entry ", table[b], " of row ", s,
                        " is not a block of the cache (", num_blocks, " blocks)");
  }

  at::Tensor out = at::empty({S, H, D}, query.options());
  dispatch_float_types(query.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const float sc = static_cast<float>(scale), cp = static_cast<float>(cap);
    const auto run = [&](auto nv) {
      decode_attention_impl<T, decltype(nv)::value>(query, k_cache, v_cache, block_tables, positions, sc, window,
                                                    cp, out);
    };
    switch (D) {   // the head dims cpu_kernels.py lists in ATTENTION_HEAD_DIMS
      case 16: return run(std::integral_constant<int64_t, 1>{});
      case 32: return run(std::integral_constant<int64_t, 2>{});
      case 64: return run(std::integral_constant<int64_t, 4>{});
      case 80: return run(std::integral_constant<int64_t, 5>{});
      case 96: return run(std::integral_constant<int64_t, 6>{});
      case 128: return run(std::integral_constant<int64_t, 8>{});
      case 256: return run(std::integral_constant<int64_t, 16>{});
      default: TORCH_CHECK_VALUE(false, "unsupported head_dim ", D, " (16, 32, 64, 80, 96, 128 or 256)");
    }
  });
  return out;
}

// ------------------------------------------------------------------ paged multi-row (flash) attention

// Sequences with several query rows (prefill, prefix-hit extend, chunked prefill, sparse rows).
// Phase 1 packs each (sequence, KV head)'s keys 0..n-1 once, in blocks of kKeyBlock keys, into the
// layouts the tile loops stream (zero past n): with bfloat16 dot products K as [D/2][kKeyBlock]
// pairs of dims and V as [kKeyBlock/2][D] pairs of keys (vdpbf16ps operands); in float32 K as
// [D][kKeyBlock] and V as [kKeyBlock][D]. Phase 2 runs a tile of query rows x the G query heads of a
// KV head against the key blocks up to the tile's last position with an online softmax: scores of
// one key block live in a [tile, kKeyBlock] scratch, never a [rows, keys] matrix. Only the blocks
// holding keys past the tile's first position are masked. With a sliding window of W keys, a
// sequence's keys are packed from the first block any of its rows sees, and a tile starts at the
// block of its first row's first key (position - W + 1) and skips the blocks no row's window
// reaches (gaps between sparse rows): a long prompt costs O(W) per row, not O(position); blocks
// holding keys that some of the tile's rows no longer see are masked too.
constexpr int64_t kKeyBlock = 64;
constexpr int64_t kKeyVecs = kKeyBlock / kLanes;
constexpr int64_t kTileQueries = 96;                      // query vectors (rows x G) a tile aims for
constexpr int64_t kQkRows = 6;                            // query vectors per QK micro-kernel call

template <int64_t NV>
constexpr int64_t pv_rows() { return std::max<int64_t>(1, std::min<int64_t>(6, 24 / NV)); }   // accumulators <= 24

// scores[r][0..kKeyBlock) = q[r] . k for MR query vectors (rows D apart) and one packed K block.
template <int64_t MR, int64_t NV>
inline void qk_f32(const float* q, const float* kp, float* scores) {
  constexpr int64_t D = NV * kLanes;
  vf acc[MR][kKeyVecs] = {};
  for (int64_t d = 0; d < D; ++d) {
    vf k[kKeyVecs];
    for (int64_t c = 0; c < kKeyVecs; ++c) k[c] = load(kp + d * kKeyBlock + c * kLanes);
#pragma GCC unroll 6
    for (int64_t r = 0; r < MR; ++r) {
      const vf qb = splat(q[r * D + d]);
      for (int64_t c = 0; c < kKeyVecs; ++c) acc[r][c] = fmadd(qb, k[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t c = 0; c < kKeyVecs; ++c) store(scores + r * kKeyBlock + c * kLanes, acc[r][c]);
}

// o[r] += sum_k p[r][k] v[k] for MR rows (p rows kKeyBlock apart, o rows D apart), keys 0..count-1.
template <int64_t MR, int64_t NV>
inline void pv_f32(const float* p, const float* vp, int64_t count, float* o) {
  constexpr int64_t D = NV * kLanes;
  vf acc[MR][NV];
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t c = 0; c < NV; ++c) acc[r][c] = load(o + r * D + c * kLanes);
  for (int64_t k = 0; k < count; ++k) {
    vf pb[MR];
    for (int64_t r = 0; r < MR; ++r) pb[r] = splat(p[r * kKeyBlock + k]);
    for (int64_t c = 0; c < NV; ++c) {
      const vf v = load(vp + k * D + c * kLanes);
      for (int64_t r = 0; r < MR; ++r) acc[r][c] = fmadd(pb[r], v, acc[r][c]);
    }
  }
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t c = 0; c < NV; ++c) store(o + r * D + c * kLanes, acc[r][c]);
}

// The same with bfloat16 operands (vdpbf16ps): q rows of D bf16, K packed as pairs of dims.
#ifdef __AVX512BF16__
inline vbf broadcast_pair(const c10::BFloat16* p) {      // both lanes of every 32-bit pair = p[0], p[1]
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return (vbf)_mm512_set1_epi32(static_cast<int32_t>(x));
}

template <int64_t MR, int64_t NV>
inline void qk_bf16(const c10::BFloat16* q, const c10::BFloat16* kp, float* scores) {
  constexpr int64_t D = NV * kLanes;
  __m512 acc[MR][kKeyVecs];
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t c = 0; c < kKeyVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < D / 2; ++j) {                   // dims 2j, 2j+1
    vbf k[kKeyVecs];
    for (int64_t c = 0; c < kKeyVecs; ++c) k[c] = (vbf)_mm512_loadu_si512(kp + (j * kKeyBlock + c * kLanes) * 2);
#pragma GCC unroll 6
    for (int64_t r = 0; r < MR; ++r) {
      const vbf qb = broadcast_pair(q + r * D + 2 * j);
      for (int64_t c = 0; c < kKeyVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, k[c]);
    }
  }
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t c = 0; c < kKeyVecs; ++c) _mm512_storeu_ps(scores + r * kKeyBlock + c * kLanes, acc[r][c]);
}

// pv_f32 with bfloat16 probabilities and V packed as pairs of keys; count rounds up to a pair.
template <int64_t MR, int64_t NV>
inline void pv_bf16(const c10::BFloat16* p, const c10::BFloat16* vp, int64_t count, float* o) {
  constexpr int64_t D = NV * kLanes;
  __m512 acc[MR][NV];
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + c * kLanes);
  for (int64_t kk = 0; kk < (count + 1) / 2; ++kk) {     // keys 2kk, 2kk+1 (a pad key has p = 0, v = 0)
    vbf pb[MR];
    for (int64_t r = 0; r < MR; ++r) pb[r] = broadcast_pair(p + r * kKeyBlock + 2 * kk);
    for (int64_t c = 0; c < NV; ++c) {
      const vbf v = (vbf)_mm512_loadu_si512(vp + (kk * D + c * kLanes) * 2);
      for (int64_t r = 0; r < MR; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb[r], v);
    }
  }
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * D + c * kLanes, acc[r][c]);
}
#else
template <int64_t MR, int64_t NV>                         // declared for the discarded branches only
void qk_bf16(const c10::BFloat16* q, const c10::BFloat16* kp, float* scores);
template <int64_t MR, int64_t NV>
void pv_bf16(const c10::BFloat16* p, const c10::BFloat16* vp, int64_t count, float* o);
#endif

// Calls f(r, MR) over rows 0..rows-1 in steps of MR (a compile-time constant), then single rows.
template <int64_t MR, typename F>
inline void row_steps(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) f(r, std::integral_constant<int64_t, MR>{});
  for (; r < rows; ++r) f(r, std::integral_constant<int64_t, 1>{});
}

template <typename T, int64_t NV>
void multi_row_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const int64_t* qstart, const int64_t* pos,
                              const std::vector<int64_t>& first_key, const std::vector<int64_t>& num_keys,
                              float scale, int64_t window, float cap, at::Tensor& out) {
  constexpr int64_t D = NV * kLanes;
  constexpr bool bf16_dots = kBf16DotProducts && std::is_same_v<T, c10::BFloat16>;
  using P = std::conditional_t<bf16_dots, c10::BFloat16, float>;   // packed K/V, Q and probabilities
  const int64_t S = block_tables.size(0), H = query.size(1);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t q_ts = query.stride(0), q_hs = query.stride(1), bt_stride = block_tables.stride(0);
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int32_t* bt_ptr = block_tables.data_ptr<int32_t>();
  T* o_ptr = out.data_ptr<T>();
  constexpr int64_t block_elems = kKeyBlock * D;

  // Phase 1: packed [key blocks of all sequences][KVH][kKeyBlock * D] K and V; sequence s's blocks
  // cover its key blocks from first_blk[s] (the one holding first_key[s]) on
  std::vector<int64_t> block0(S + 1, 0), first_blk(S);   // block0[s]: its first packed block
  for (int64_t s = 0; s < S; ++s) {
    first_blk[s] = first_key[s] / kKeyBlock;
    block0[s + 1] = block0[s] + (num_keys[s] + kKeyBlock - 1) / kKeyBlock - first_blk[s];
  }
  std::vector<int64_t> block_seq(block0[S]);
  for (int64_t s = 0; s < S; ++s) std::fill(block_seq.begin() + block0[s], block_seq.begin() + block0[s + 1], s);
  const std::unique_ptr<P[]> k_pack(new P[block0[S] * KVH * block_elems]);   // every element is written below
  const std::unique_ptr<P[]> v_pack(new P[block0[S] * KVH * block_elems]);
  at::parallel_for(0, block0[S] * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH, s = block_seq[b];
      const int64_t p0 = (first_blk[s] + b - block0[s]) * kKeyBlock, count = std::min(kKeyBlock, num_keys[s] - p0);
      P* kp = k_pack.get() + task * block_elems;
      P* vp = v_pack.get() + task * block_elems;
      const int32_t* table = bt_ptr + s * bt_stride;
      for (int64_t t = 0; t < kKeyBlock; ++t) {
        if (t >= count) {
          for (int64_t d = 0; d < D; ++d) {
            const int64_t ki = bf16_dots ? (d / 2 * kKeyBlock + t) * 2 + d % 2 : d * kKeyBlock + t;
            const int64_t vi = bf16_dots ? (t / 2 * D + d) * 2 + t % 2 : t * D + d;
            kp[ki] = vp[vi] = P(0.f);
          }
          continue;
        }
        const int64_t p = p0 + t, slot = table[p / BS] * BS + p % BS;
        const T* k_row = k_ptr + (slot * KVH + h) * D;
        const T* v_row = v_ptr + (slot * KVH + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          if constexpr (bf16_dots) {
            kp[(d / 2 * kKeyBlock + t) * 2 + d % 2] = k_row[d];
            vp[(t / 2 * D + d) * 2 + t % 2] = v_row[d];
          } else {
            kp[d * kKeyBlock + t] = static_cast<float>(k_row[d]);
            vp[t * D + d] = static_cast<float>(v_row[d]);
          }
        }
      }
    }
  });

  // Phase 2: tasks (sequence, KV head, row tile), the longest first (dynamic schedule)
  const int64_t tile_rows = std::max<int64_t>(1, kTileQueries / G), tile_q = tile_rows * G;
  struct Task { int64_t s, h, r0, r1, kstart, kend; };     // rows r0..r1-1 see keys kstart..kend-1 at most
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r0 = qstart[s]; r0 < qstart[s + 1]; r0 += tile_rows) {
      const int64_t r1 = std::min(qstart[s + 1], r0 + tile_rows);
      const int64_t kend = *std::max_element(pos + r0, pos + r1) + 1;
      const int64_t kstart = window > 0 ? std::max<int64_t>(0, *std::min_element(pos + r0, pos + r1) + 1 - window) : 0;
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({s, h, r0, r1, kstart, kend});
    }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    return (a.kend - a.kstart) * (a.r1 - a.r0) > (b.kend - b.kstart) * (b.r1 - b.r0);
  });
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const float score_scale = bf16_dots ? scale : 1.0f;     // float32 queries carry the scale
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
#pragma omp parallel num_threads(std::min<int64_t>(at::get_num_threads(), num_tasks))
  {
    std::vector<P> q(tile_q * D);                         // [tile_q, D] queries, row-major (rows x G)
    std::vector<float> o(tile_q * D);                     // [tile_q, D] output accumulators
    std::vector<float> scores(tile_q * kKeyBlock);        // [tile_q, kKeyBlock] one key block's scores
    std::vector<P> probs(tile_q * kKeyBlock);             // [tile_q, kKeyBlock] exp(score - max)
    std::vector<float> row_max(tile_q), denom(tile_q);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < num_tasks; ++ti) {
      const Task& task = tasks[ti];
      const int64_t M = (task.r1 - task.r0) * G;
      const int64_t mstart = *std::min_element(pos + task.r0, pos + task.r1) + 1;  // keys < mstart: all rows
      // keys < wend have left the window of some row (none without a window)
      const int64_t wend = window > 0 ? *std::max_element(pos + task.r0, pos + task.r1) + 1 - window : 0;
      for (int64_t m = 0; m < M; ++m) {
        const T* q_row = q_ptr + (task.r0 + m / G) * q_ts + (task.h * G + m % G) * q_hs;
        for (int64_t d = 0; d < D; ++d)
          q[m * D + d] = bf16_dots ? P(q_row[d]) : P(static_cast<float>(q_row[d]) * scale);
      }
      std::fill(o.begin(), o.begin() + M * D, 0.f);
      std::fill(row_max.begin(), row_max.begin() + M, -std::numeric_limits<float>::infinity());
      std::fill(denom.begin(), denom.begin() + M, 0.f);
      for (int64_t p0 = task.kstart / kKeyBlock * kKeyBlock; p0 < task.kend; p0 += kKeyBlock) {
        const bool masked = p0 + kKeyBlock > mstart || p0 < wend;
        if (masked && window > 0) {     // sparse rows far apart: skip a block between their windows
          bool seen = false;
          for (int64_t r = task.r0; r < task.r1 && !seen; ++r)
            seen = pos[r] >= p0 && pos[r] + 1 - window < p0 + kKeyBlock;
          if (!seen) continue;
        }
        const int64_t count = std::min(kKeyBlock, task.kend - p0);
        const int64_t packed = ((block0[task.s] + p0 / kKeyBlock - first_blk[task.s]) * KVH + task.h) * block_elems;
        const P* kp = k_pack.get() + packed;
        const P* vp = v_pack.get() + packed;
        row_steps<kQkRows>(M, [&](int64_t m, auto mr) {
          if constexpr (bf16_dots)
            qk_bf16<decltype(mr)::value, NV>(q.data() + m * D, kp, scores.data() + m * kKeyBlock);
          else
            qk_f32<decltype(mr)::value, NV>(q.data() + m * D, kp, scores.data() + m * kKeyBlock);
        });
        for (int64_t m = 0; m < M; ++m) {
          // the row sees keys first..visible-1 of this block
          const int64_t row_pos = pos[task.r0 + m / G];
          const int64_t visible = masked ? std::min(kKeyBlock, row_pos + 1 - p0) : kKeyBlock;
          const int64_t first = masked && window > 0 ? std::max<int64_t>(0, row_pos + 1 - window - p0) : 0;
          P* pr = probs.data() + m * kKeyBlock;
          if (visible <= first) {                         // the row's keys all lie in other blocks
            std::fill(pr, pr + kKeyBlock, P(0.f));
            continue;
          }
          float* sr = scores.data() + m * kKeyBlock;
          vf bmax = neg_inf;
          for (int64_t c = 0; c < kKeyVecs; ++c) {
            const vi key = lane + static_cast<int32_t>(c * kLanes);
            vf sc = load(sr + c * kLanes) * splat(score_scale);
            if (cap > 0.f) sc = softcap(sc, cap);
            sc = ((key >= static_cast<int32_t>(first)) & (key < static_cast<int32_t>(visible))) ? sc : neg_inf;
            store(sr + c * kLanes, sc);
            bmax = vmax(bmax, sc);
          }
          const float new_max = std::max(row_max[m], hmax(bmax));
          const float alpha = sexp(row_max[m] - new_max);
          vf sum{};
          for (int64_t c = 0; c < kKeyVecs; ++c) {
            const vf e = vexp(load(sr + c * kLanes) - splat(new_max));
            sum += e;
            store(pr + c * kLanes, e);
          }
          denom[m] = denom[m] * alpha + hsum(sum);
          row_max[m] = new_max;
          float* o_row = o.data() + m * D;
          if (alpha != 1.f)
            for (int64_t c = 0; c < NV; ++c) store(o_row + c * kLanes, load(o_row + c * kLanes) * splat(alpha));
        }
        row_steps<pv_rows<NV>()>(M, [&](int64_t m, auto mr) {
          if constexpr (bf16_dots)
            pv_bf16<decltype(mr)::value, NV>(probs.data() + m * kKeyBlock, vp, count, o.data() + m * D);
          else
            pv_f32<decltype(mr)::value, NV>(probs.data() + m * kKeyBlock, vp, count, o.data() + m * D);
        });
      }
      for (int64_t m = 0; m < M; ++m) {
        const vf inv = splat(1.f / denom[m]);
        T* o_row = o_ptr + (task.r0 + m / G) * H * D + (task.h * G + m % G) * D;
        for (int64_t c = 0; c < NV; ++c) store(o_row + c * kLanes, load(o.data() + m * D + c * kLanes) * inv);
      }
    }
  }
}

// query [T, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D]; block_tables [S, max_blocks]
// int32; query_start [S + 1] int64 (rows of sequence s: query_start[s]..query_start[s+1]-1);
// positions [T] int64 (row t sees keys 0..positions[t] of its sequence, the last `window` of them
// when window > 0); cap > 0 softcaps the scaled scores. Returns [T, H, D].
at::Tensor multi_row_attention(const at::Tensor& query_in, const at::Tensor& k_cache_in,
                               const at::Tensor& v_cache_in, const at::Tensor& block_tables_in,
                               const at::Tensor& query_start_in, const at::Tensor& positions_in, double scale,
                               int64_t window, double cap) {
  check_attention_inputs(query_in, k_cache_in, v_cache_in);
  check_window_and_cap(window, cap);
  const int64_t T = query_in.size(0), H = query_in.size(1), D = query_in.size(2), KVH = k_cache_in.size(2);
  TORCH_CHECK_VALUE(block_tables_in.device().is_cpu() && block_tables_in.scalar_type() == at::kInt &&
                    block_tables_in.dim() == 2, "block_tables must be [S, max_blocks] int32, got ",
                    block_tables_in.sizes(), " ", block_tables_in.scalar_type());
  const int64_t S = block_tables_in.size(0);
  check_index(query_start_in, at::kLong, S + 1, "query_start");
  check_index(positions_in, at::kLong, T, "positions");
  const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  const at::Tensor k_cache = k_cache_in.contiguous(), v_cache = v_cache_in.contiguous();
  const at::Tensor block_tables = block_tables_in.stride(1) == 1 ? block_tables_in : block_tables_in.contiguous();
  const at::Tensor query_start = query_start_in.contiguous(), positions = positions_in.contiguous();
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  const int64_t max_keys = block_tables.size(1) * block_size;
  const int64_t* qstart = query_start.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(qstart[0] == 0 && qstart[S] == T, "query_start must run from 0 to ", T);
  // keys first_key[s]..num_keys[s]-1 of sequence s are read (from the start of their blocks)
  std::vector<int64_t> first_key(S, 0), num_keys(S);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK_VALUE(qstart[s] <= qstart[s + 1], "query_start must be non-decreasing");
    int64_t last = -1, earliest = max_keys;
    for (int64_t t = qstart[s]; t < qstart[s + 1]; ++t) {
      TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < max_keys, "position ", pos[t], " of row ", t,
                        " is outside its block table (", max_keys, " keys)");
      last = std::max(last, pos[t]);
      earliest = std::min(earliest, pos[t]);
    }
    num_keys[s] = last + 1;
    if (window > 0 && last >= 0) first_key[s] = std::max<int64_t>(0, earliest + 1 - window);
    const int32_t* table = block_tables.data_ptr<int32_t>() + s * block_tables.stride(0);
    const int64_t read_from = std::min(first_key[s] / kKeyBlock * kKeyBlock, num_keys[s]);
    for (int64_t b = read_from / block_size; b * block_size < num_keys[s]; ++b)
      TORCH_CHECK_VALUE(table[b] >= 0 && table[b] < num_blocks, "block table entry ", table[b], " of sequence ",
                        s, " is not a block of the cache (", num_blocks, " blocks)");
  }

  at::Tensor out = at::empty({T, H, D}, query.options());
  if (T == 0) return out;
  dispatch_float_types(query.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const float sc = static_cast<float>(scale), cp = static_cast<float>(cap);
    const auto run = [&](auto nv) {
      multi_row_attention_impl<T, decltype(nv)::value>(query, k_cache, v_cache, block_tables, qstart, pos, first_key,
                                                       num_keys, sc, window, cp, out);
    };
    switch (D) {   // the head dims cpu_kernels.py lists in ATTENTION_HEAD_DIMS
      case 16: return run(std::integral_constant<int64_t, 1>{});
      case 32: return run(std::integral_constant<int64_t, 2>{});
      case 64: return run(std::integral_constant<int64_t, 4>{});
      case 80: return run(std::integral_constant<int64_t, 5>{});
      case 96: return run(std::integral_constant<int64_t, 6>{});
      case 128: return run(std::integral_constant<int64_t, 8>{});
      case 256: return run(std::integral_constant<int64_t, 16>{});
      default: TORCH_CHECK_VALUE(false, "unsupported head_dim ", D, " (16, 32, 64, 80, 96, 128 or 256)");
    }
  });
  return out;
}

// ------------------------------------------------------------------ KV store

// Copies rows [T, KVH, D] (token and head strides given, contiguous last dim) to cache slots.
template <typename T>
void store_rows(const T* src, int64_t t_stride, int64_t h_stride, const int64_t* slots, int64_t tokens,
                int64_t heads, int64_t head_dim, T* cache) {
  at::parallel_for(0, tokens, row_grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* dst = cache + slots[t] * heads * head_dim;
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(dst + h * head_dim, src + t * t_stride + h * h_stride, head_dim * sizeof(T));
    }
  });
}

// key/value [T, KVH, D] (any token/head strides, e.g. views of a fused qkv output);
// k_cache/v_cache [num_blocks, block_size, KVH, D] of the same dtype; slot_mapping [T] int64.
void store_kv(const at::Tensor& key_in, const at::Tensor& value_in, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping_in) {
  check_float(k_cache, "k_cache");
  check_same_dtype(key_in, k_cache, "key");
  check_same_dtype(value_in, k_cache, "value");
  check_same_dtype(v_cache, k_cache, "v_cache");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    v_cache.sizes() == k_cache.sizes(), "caches must be contiguous [blocks, block_size, KVH, D], got ",
                    k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t KVH = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK_VALUE(key_in.dim() == 3 && key_in.size(1) == KVH && key_in.size(2) == D &&
                    value_in.sizes() == key_in.sizes(), "key/value must be [T, ", KVH, ", ", D, "], got ",
                    key_in.sizes(), " and ", value_in.sizes());
  const int64_t T = key_in.size(0);
  check_index(slot_mapping_in, at::kLong, T, "slot_mapping");
  const at::Tensor key = key_in.stride(2) == 1 ? key_in : key_in.contiguous();
  const at::Tensor value = value_in.stride(2) == 1 ? value_in : value_in.contiguous();
  const at::Tensor slot_mapping = slot_mapping_in.contiguous();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is not in the cache (",
                      num_slots, " slots)");
  dispatch_float_types(k_cache.scalar_type(), [&](auto tag) {
    using E = decltype(tag);
    store_rows<E>(key.data_ptr<E>(), key.stride(0), key.stride(1), slots, T, KVH, D, k_cache.data_ptr<E>());
    store_rows<E>(value.data_ptr<E>(), value.stride(0), value.stride(1), slots, T, KVH, D, v_cache.data_ptr<E>());
  });
}

// ------------------------------------------------------------------ RMSNorm (+ residual add)

// Reference (layernorm.py): x = x + residual (model dtype); xf = float(x);
// out = weight * (xf * rsqrt(mean(xf^2) + eps)).to(dtype), the product rounded to the dtype.
template <typename T>
void rms_norm_impl(const T* x, const T* residual, const T* weight, T* out, T* residual_out,
                   int64_t rows, int64_t n, float eps) {
  const int64_t nv = n / kLanes * kLanes;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x + r * n;
      if (residual != nullptr) {                          // the sum, rounded, is the new residual
        T* dst = residual_out + r * n;
        const T* res = residual + r * n;
        int64_t i = 0;
        for (; i < nv; i += kLanes) store(dst + i, load(src + i) + load(res + i));
        for (; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]) + static_cast<float>(res[i]));
        src = dst;
      }
      vf sq{};
      int64_t i = 0;
      for (; i < nv; i += kLanes) {
        const vf v = load(src + i);
        sq += v * v;
      }
      float sum = hsum(sq);
      for (; i < n; ++i) sum += static_cast<float>(src[i]) * static_cast<float>(src[i]);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
      T* dst = out + r * n;
      for (i = 0; i < nv; i += kLanes)
        store(dst + i, load(weight + i) * round_to<T>(load(src + i) * splat(inv)));
      for (; i < n; ++i)
        dst[i] = static_cast<T>(static_cast<float>(weight[i]) * round_to<T>(static_cast<float>(src[i]) * inv));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm_common(const at::Tensor& x_in, const at::Tensor* residual_in,
                                                   const at::Tensor& weight_in, double eps) {
  check_float(x_in, "x");
  check_same_dtype(weight_in, x_in, "weight");
  TORCH_CHECK_VALUE(x_in.dim() >= 1 && weight_in.dim() == 1 && weight_in.size(0) == x_in.size(-1),
                    "expected x [..., hidden] and weight [hidden], got ", x_in.sizes(), " and ", weight_in.sizes());
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor residual, res_out;
  if (residual_in != nullptr) {
    check_same_dtype(*residual_in, x_in, "residual");
    TORCH_CHECK_VALUE(residual_in->sizes() == x_in.sizes(), "residual ", residual_in->sizes(),
                      " does not match x ", x_in.sizes());
    residual = residual_in->contiguous();
    res_out = at::empty_like(x);
  }
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(-1);
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(x.data_ptr<T>(), residual.defined() ? residual.data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                     out.data_ptr<T>(), residual.defined() ? res_out.data_ptr<T>() : nullptr,
                     n ? x.numel() / n : 0, n, static_cast<float>(eps));
  });
  return {out, res_out};
}

// x [..., hidden], weight [hidden] -> norm(x)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(rms_norm_common(x, nullptr, weight, eps));
}

// x, residual [..., hidden] -> (norm(x + residual), x + residual)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return rms_norm_common(x, &residual, weight, eps);
}

// ------------------------------------------------------------------ RoPE on q and k

// Reference (rotary_embedding.py `rotate`): x1, x2 = halves of x in float32;
// out = cat(x1 * c - x2 * s, x2 * c + x1 * s) rounded once to the dtype.
template <typename T>
void rope_rows(const T* src, int64_t t_stride, int64_t h_stride, int64_t heads, const int64_t* positions,
               const float* cos, const float* sin, int64_t half, T* dst, int64_t tokens) {
  const int64_t hv = half / kLanes * kLanes;
  at::parallel_for(0, tokens * heads, row_grain(2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads, h = row % heads;
      const T* x = src + t * t_stride + h * h_stride;
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      T* o = dst + row * 2 * half;
      int64_t i = 0;
      for (; i < hv; i += kLanes) {
        const vf x1 = load(x + i), x2 = load(x + half + i), ci = load(c + i), si = load(s + i);
        store(o + i, x1 * ci - x2 * si);
        store(o + half + i, x2 * ci + x1 * si);
      }
      for (; i < half; ++i) {
        const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
        o[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
        o[half + i] = static_cast<T>(x2 * c[i] + x1 * s[i]);
      }
    }
  });
}

// q [T, H, D], k [T, KVH, D] (any token/head strides, e.g. views of a fused qkv output);
// positions [T] int64; cos_cache/sin_cache [max_position, D/2] float32.
// Returns contiguous rotated copies of q and k.
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& positions_in,
                                        const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_float(q_in, "q");
  check_same_dtype(k_in, q_in, "k");
  TORCH_CHECK_VALUE(q_in.dim() == 3 && k_in.dim() == 3 && q_in.size(0) == k_in.size(0) &&
                    q_in.size(2) == k_in.size(2) && q_in.size(2) % 2 == 0,
                    "expected q [T, H, D] and k [T, KVH, D] with one even D, got ", q_in.sizes(), " and ",
                    k_in.sizes());
  const int64_t T = q_in.size(0), half = q_in.size(2) / 2;
  check_index(positions_in, at::kLong, T, "positions");
  TORCH_CHECK_VALUE(cos_in.device().is_cpu() && cos_in.scalar_type() == at::kFloat && cos_in.dim() == 2 &&
                    cos_in.size(1) == half && sin_in.device().is_cpu() && sin_in.scalar_type() == at::kFloat &&
                    sin_in.sizes() == cos_in.sizes(),
                    "cos/sin tables must be [max_position, ", half, "] float32, got ", cos_in.sizes(), " ",
                    cos_in.scalar_type(), " and ", sin_in.sizes(), " ", sin_in.scalar_type());
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(2) == 1 ? k_in : k_in.contiguous();
  const at::Tensor positions = positions_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is outside the rope tables (",
                      cos.size(0), " positions)");

  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out = at::empty(k.sizes(), k.options());
  dispatch_float_types(q.scalar_type(), [&](auto tag) {
    using E = decltype(tag);
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
    rope_rows<E>(q.data_ptr<E>(), q.stride(0), q.stride(1), q.size(1), pos, c, s, half, q_out.data_ptr<E>(), T);
    rope_rows<E>(k.data_ptr<E>(), k.stride(0), k.stride(1), k.size(1), pos, c, s, half, k_out.data_ptr<E>(), T);
  });
  return {q_out, k_out};
}

// ------------------------------------------------------------------ SiLU * mul

// Reference (llama.py MLP): F.silu(gate) * up; silu(g) = g / (1 + exp(-g)) rounded to the dtype,
// the product rounded again.
template <typename T>
void silu_and_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t n) {
  const int64_t nv = n / kLanes * kLanes;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * n;
      const T* up = gate + n;
      T* o = out + r * n;
      int64_t i = 0;
      for (; i < nv; i += kLanes) {
        const vf g = load(gate + i);
        store(o + i, round_to<T>(g / (splat(1.0f) + vexp(-g))) * load(up + i));
      }
      for (; i < n; ++i) {
        const float g = static_cast<float>(gate[i]);
        o[i] = static_cast<T>(round_to<T>(g / (1.0f + sexp(-g))) * static_cast<float>(up[i]));
      }
    }
  });
}

// gate_up [T, 2 * inter] (gate first) -> [T, inter]
at::Tensor silu_and_mul(const at::Tensor& gate_up_in) {
  check_float(gate_up_in, "gate_up");
  TORCH_CHECK_VALUE(gate_up_in.dim() == 2 && gate_up_in.size(1) % 2 == 0,
                    "expected gate_up [rows, 2 * inter], got ", gate_up_in.sizes());
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  dispatch_float_types(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_impl<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, n);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged single-row attention", py::arg("query"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("positions"), py::arg("scale"),
        py::arg("sliding_window") = 0, py::arg("logits_soft_cap") = 0.0);
  m.def("multi_row_attention", &multi_row_attention, "paged multi-row (flash) attention", py::arg("query"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("positions"), py::arg("scale"), py::arg("sliding_window") = 0, py::arg("logits_soft_cap") = 0.0);
  m.def("store_kv", &store_kv, "K/V rows into cache slots", py::arg("key"), py::arg("value"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_mapping"));
  m.def("rms_norm", &rms_norm, "RMSNorm", py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm", py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"));
  m.def("rope", &rope, "rotary embedding of q and k", py::arg("q"), py::arg("k"), py::arg("positions"),
        py::arg("cos_cache"), py::arg("sin_cache"));
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up", py::arg("gate_up"));
}
