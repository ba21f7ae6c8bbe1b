// The pass-shape-invariant CPU target: a Llama decoder over the GGUF's own Q4_1 / Q8_0 blocks with int8
// activations, tree attention over the in-place KV cache, one native call per pass.
// Why a kernel of our own, and the rules it keeps: docs/quantized-target.md#the-exact-int8-engine.
//
// Invariance: every operation computes a token's row with code that depends only on that row (its inputs,
// its position, the keys its mask lets it see, in their logical order), never on how many rows the pass
// holds, where the row sits in it, or which thread runs it:
//  - matmuls: the one-row dot product runs for every row (rows share only the weight loads); threads split
//    output columns, never a reduction;
//  - attention: a row's keys are its past in cache order, then its visible in-flight tokens in pass order
//    (ancestors precede descendants, so that is depth order, the order they have after the commit); every
//    reduction over keys runs in blocks fixed by logical key index;
//  - norms, RoPE, SiLU, activation quantisation: per row.
// Compiled with -ffp-contract=off, so each written multiply-add stays what it is in every instantiation.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

namespace {

constexpr int kBlock = 32;           // weights / activations per quantisation block
constexpr int kQ41Bytes = 20;        // fp16 d, fp16 m, 16 bytes of nibbles
constexpr int kQ80Bytes = 34;        // fp16 d, 32 int8
constexpr int kFormatQ41 = 0;
constexpr int kFormatQ80 = 1;
constexpr int kRowTile = 4;          // rows sharing one load of a weight block

// ---------------------------------------------------------------------------------------------------------
// threads: a pool that runs one function on all threads per pass, with a spin barrier inside the pass

class Pool {
  static constexpr int kSpins = 20000;

 public:
  explicit Pool(int threads) : threads_(std::max(1, threads)) {
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { work(t); });
  }
  ~Pool() {
    stop_ = true;
    generation_.fetch_add(1);
    generation_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int size() const { return threads_; }

  void run(const std::function<void(int)>& job) {
    job_ = &job;
    finished_.store(0);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    job(0);
    for (int spin = 0; spin < kSpins && finished_.load(std::memory_order_acquire) != threads_ - 1; ++spin) _mm_pause();
    for (int left; (left = finished_.load(std::memory_order_acquire)) != threads_ - 1;) finished_.wait(left);
  }

  // all threads of the pass meet here: spin (they are all running, and a spin is cheaper than a sleep), then
  // sleep on the phase, so that on a busy machine a waiter does not hold the core the late thread needs
  void barrier() {
    if (threads_ == 1) return;
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.fetch_add(1, std::memory_order_acq_rel);
      if (sleepers_.load(std::memory_order_acquire)) phase_.notify_all();
      return;
    }
    for (int spin = 0; spin < kSpins; ++spin)
      if (phase_.load(std::memory_order_acquire) != phase) return;
      else _mm_pause();
    sleepers_.fetch_add(1, std::memory_order_acq_rel);
    while (phase_.load(std::memory_order_acquire) == phase) phase_.wait(phase, std::memory_order_acquire);
    sleepers_.fetch_sub(1, std::memory_order_acq_rel);
  }

 private:
  void work(int t) {
    uint64_t seen = 0;
    for (;;) {
      // spin briefly for the next pass (a decode loop calls again within microseconds), then sleep: a spinning
      // worker would take a core from the Python and onnxruntime work between passes
      for (int spin = 0; spin < 20000 && generation_.load(std::memory_order_acquire) == seen; ++spin) _mm_pause();
      generation_.wait(seen, std::memory_order_acquire);
      seen = generation_.load(std::memory_order_acquire);
      if (stop_) return;
      (*job_)(t);
      finished_.fetch_add(1, std::memory_order_acq_rel);
      finished_.notify_one();
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> finished_{0};
  std::atomic<int> arrived_{0};
  std::atomic<int> phase_{0};
  std::atomic<int> sleepers_{0};
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<bool> stop_{false};
};

// [lo, hi) of `total` items for thread t of n (contiguous shares)
inline void share(int t, int n, int total, int* lo, int* hi) {
  *lo = static_cast<int>(static_cast<int64_t>(total) * t / n);
  *hi = static_cast<int>(static_cast<int64_t>(total) * (t + 1) / n);
}

// ---------------------------------------------------------------------------------------------------------
// small vector helpers, each a fixed order of operations

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// exp(x) for x <= 0 (softmax, SiLU's exp(-|g|)): Cephes' range reduction and polynomial
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  x = _mm256_max_ps(x, lo);
  __m256 fx = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
  __m256 xx = _mm256_mul_ps(x, x);
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, xx), x), _mm256_set1_ps(1.0f));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ---------------------------------------------------------------------------------------------------------
// int8 activations: per row, blocks of 32, symmetric, d = max|x| / 127 (llama.cpp's Q8_1: s = d * sum(q))

struct Activations {
  int8_t* q = nullptr;   // [rows, K]
  float* d = nullptr;    // [rows, K/32]
  float* s = nullptr;    // [rows, K/32]
  int k = 0;
  const int8_t* qs(int r) const { return q + static_cast<int64_t>(r) * k; }
  const float* ds(int r) const { return d + static_cast<int64_t>(r) * (k / kBlock); }
  const float* ss(int r) const { return s + static_cast<int64_t>(r) * (k / kBlock); }
};

void quantize_row(const float* x, int k, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float m = hmax(amax);
    const float scale = m / 127.0f;
    const float inv = m != 0.0f ? 127.0f / m : 0.0f;
    __m256i sum = _mm256_setzero_si256();
    __m256i packed[4];
    for (int i = 0; i < 4; ++i) {
      __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      packed[i] = _mm256_cvtps_epi32(r);
      sum = _mm256_add_epi32(sum, packed[i]);
    }
    alignas(32) int32_t lanes[32];
    for (int i = 0; i < 4; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8 * i), packed[i]);
    for (int i = 0; i < kBlock; ++i) q[b * kBlock + i] = static_cast<int8_t>(lanes[i]);
    alignas(32) int32_t parts[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sum);
    int total = 0;
    for (int i = 0; i < 8; ++i) total += parts[i];
    d[b] = scale;
    s[b] = scale * static_cast<float>(total);
  }
}

void quantize_rows(const float* x, int ldx, int r0, int r1, const Activations& a) {
  for (int r = r0; r < r1; ++r) {
    int nb = a.k / kBlock;
    quantize_row(x + static_cast<int64_t>(r) * ldx, a.k, a.q + static_cast<int64_t>(r) * a.k,
                 a.d + static_cast<int64_t>(r) * nb, a.s + static_cast<int64_t>(r) * nb);
  }
}

// ---------------------------------------------------------------------------------------------------------
// the one-row dot products, run for a tile of R rows x C columns: each weight block is loaded once for the R
// rows, each activation block once for the C columns, and the R x C accumulations are independent chains (no
// wait on one fmadd's latency). Every (row, column) runs the same operations in the same order whatever the
// tile, so the tile shape never changes a bit.

// 32 nibbles of a Q4_1 block in weight order: byte j holds weight j (low) and j + 16 (high)
inline __m256i unpack_q4(const uint8_t* qs) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
  return _mm256_set_m128i(hi, lo);
}

struct Matrix {
  const uint8_t* data = nullptr;  // [N rows, K/32 blocks]
  int format = kFormatQ41;
  int n = 0, k = 0;
  int64_t row_bytes() const { return static_cast<int64_t>(k / kBlock) * (format == kFormatQ41 ? kQ41Bytes : kQ80Bytes); }
};

inline void store(float* o, float value, bool accumulate) { *o = accumulate ? *o + value : value; }

template <int R, int C>
void tile_q4_1(const Matrix& w, int c0, const Activations& a, int r0, float* out, int64_t ldo, bool accumulate) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int nb = w.k / kBlock;
  const int64_t stride = w.row_bytes();
  const uint8_t* col = w.data + c0 * stride;
  __m256 acc[R][C];
  float mins[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps(), mins[r][c] = 0.0f;
  for (int b = 0; b < nb; ++b) {
    float d[C], m[C];
    __m256i q4[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = col + c * stride + static_cast<int64_t>(b) * kQ41Bytes;
      d[c] = f16(block), m[c] = f16(block + 2), q4[c] = unpack_q4(block + 4);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs(r0 + r) + b * kBlock));
      const float dx = a.ds(r0 + r)[b], sx = a.ss(r0 + r)[b];
      for (int c = 0; c < C; ++c) {
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q4[c], x), ones));
        acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(d[c] * dx), sums, acc[r][c]);
        mins[r][c] = mins[r][c] + m[c] * sx;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(out + (r0 + r) * ldo + c0 + c, hsum(acc[r][c]) + mins[r][c], accumulate);
}

template <int R, int C>
void tile_q8_0(const Matrix& w, int c0, const Activations& a, int r0, float* out, int64_t ldo, bool accumulate) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int nb = w.k / kBlock;
  const int64_t stride = w.row_bytes();
  const uint8_t* col = w.data + c0 * stride;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    float d[C];
    __m256i q8[C], magnitude[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = col + c * stride + static_cast<int64_t>(b) * kQ80Bytes;
      d[c] = f16(block);
      q8[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
      magnitude[c] = _mm256_sign_epi8(q8[c], q8[c]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs(r0 + r) + b * kBlock));
      const float dx = a.ds(r0 + r)[b];
      for (int c = 0; c < C; ++c) {
        const __m256i products = _mm256_maddubs_epi16(magnitude[c], _mm256_sign_epi8(x, q8[c]));
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, ones));
        acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(d[c] * dx), sums, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(out + (r0 + r) * ldo + c0 + c, hsum(acc[r][c]), accumulate);
}

template <int R, int C>
inline void tile(const Matrix& w, int c0, const Activations& a, int r0, float* out, int64_t ldo, bool acc) {
  if (w.format == kFormatQ41)
    tile_q4_1<R, C>(w, c0, a, r0, out, ldo, acc);
  else
    tile_q8_0<R, C>(w, c0, a, r0, out, ldo, acc);
}

// rows [r0, r0 + R) over columns [c0, c1): tiles of C columns, then one column at a time
template <int R, int C>
void rows_over_columns(const Matrix& w, const Activations& a, int r0, float* out, int64_t ldo, bool acc, int c0, int c1) {
  int c = c0;
  for (; c + C <= c1; c += C) tile<R, C>(w, c, a, r0, out, ldo, acc);
  for (; c < c1; ++c) tile<R, 1>(w, c, a, r0, out, ldo, acc);
}

// out[r, col] (+)= a[r] . w[col] for every row, columns [c0, c1): columns in chunks of 16 so a chunk's weights
// stay in L1 while every row tile passes over them
void matmul_columns(const Matrix& w, const Activations& a, int rows, float* out, int64_t ldo, bool acc, int c0, int c1) {
  constexpr int kColChunk = 16;
  for (int t0 = c0; t0 < c1; t0 += kColChunk) {
    const int t1 = std::min(c1, t0 + kColChunk);
    int r = 0;
    for (; r + kRowTile <= rows; r += kRowTile) rows_over_columns<kRowTile, 2>(w, a, r, out, ldo, acc, t0, t1);
    const int left = rows - r;
    if (left == 3) rows_over_columns<3, 2>(w, a, r, out, ldo, acc, t0, t1);
    if (left == 2) rows_over_columns<2, 4>(w, a, r, out, ldo, acc, t0, t1);
    if (left == 1) rows_over_columns<1, 4>(w, a, r, out, ldo, acc, t0, t1);
  }
}

void matmul(Pool& pool, int t, const Matrix& w, const Activations& a, int rows, float* out, int64_t ldo, bool acc) {
  int c0, c1;
  share(t, pool.size(), w.n, &c0, &c1);
  matmul_columns(w, a, rows, out, ldo, acc, c0, c1);
}

// ---------------------------------------------------------------------------------------------------------
// per-row operations

void rms_norm_row(const float* x, const float* weight, int h, float eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < h; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  const float scale = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(h) + eps);
  for (int i = 0; i < h; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(scale));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), v));
  }
}

// rotate-half RoPE (Hugging Face layout) of `heads` heads of size d at one position
void rope_row(float* x, int heads, int d, const float* cos, const float* sin) {
  const int half = d / 2;
  for (int h = 0; h < heads; ++h) {
    float* v = x + h * d;
    for (int i = 0; i < half; i += 8) {
      __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + half + i);
      __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
      _mm256_storeu_ps(v + i, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
      _mm256_storeu_ps(v + half + i, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
    }
  }
}

// silu(g) * u over n values: g * sigmoid(g), sigmoid from exp(-|g|) (never overflows)
void silu_mul_row(const float* g, const float* u, int n, float* y) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < n; i += 8) {
    __m256 x = _mm256_loadu_ps(g + i);
    __m256 e = exp256(_mm256_or_ps(x, sign));  // exp(-|x|)
    __m256 positive = _mm256_div_ps(one, _mm256_add_ps(one, e));
    __m256 negative = _mm256_div_ps(e, _mm256_add_ps(one, e));
    __m256 sigmoid = _mm256_blendv_ps(positive, negative, x);  // x's sign bit picks
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid), _mm256_loadu_ps(u + i)));
  }
}

// ---------------------------------------------------------------------------------------------------------
// tree attention of one query row and head (the TreeAttention contract, docs/engine-contract.md): keys are
// `past` cache positions then the in-flight tokens listed in `visible`, in that (logical) order

struct KeySource {
  const float* past_k;  // [past, d] rows `stride` apart
  const float* past_v;
  int64_t past_stride;
  int past;
  const float* new_k;   // in-flight token j at new_k + j * new_stride
  const float* new_v;
  int64_t new_stride;
  const int* visible;
  int num_visible;
  const float* key(int i) const { return i < past ? past_k + i * past_stride : new_k + visible[i - past] * new_stride; }
  const float* value(int i) const { return i < past ? past_v + i * past_stride : new_v + visible[i - past] * new_stride; }
  int count() const { return past + num_visible; }
};

inline float dot_head(const float* q, const float* k, int d) {
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
  return hsum(acc);
}

// scores: scratch of at least count() rounded up to 8
void attend_row(const float* q, const KeySource& keys, int d, float scale, float* scores, float* out) {
  const int n = keys.count();
  if (n == 0) {  // the contract: a row that sees nothing returns zeros
    std::memset(out, 0, sizeof(float) * d);
    return;
  }
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int i = 0; i < n; ++i) scores[i] = dot_head(q, keys.key(i), d) * scale;
  const int padded = (n + 7) / 8 * 8;
  for (int i = n; i < padded; ++i) scores[i] = -INFINITY;
  for (int i = 0; i < padded; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(scores + i));
  const __m256 top = _mm256_set1_ps(hmax(vmax));
  __m256 total = _mm256_setzero_ps();
  for (int i = 0; i < padded; i += 8) {
    __m256 s = _mm256_loadu_ps(scores + i);
    __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(s, top)), _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
    _mm256_storeu_ps(scores + i, e);
    total = _mm256_add_ps(total, e);
  }
  const float inv = 1.0f / hsum(total);
  constexpr int kMaxD = 256;
  __m256 acc[kMaxD / 8];
  for (int j = 0; j < d / 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int i = 0; i < n; ++i) {
    const __m256 p = _mm256_set1_ps(scores[i]);
    const float* v = keys.value(i);
    for (int j = 0; j < d / 8; ++j) acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), acc[j]);
  }
  for (int j = 0; j < d / 8; ++j) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(acc[j], _mm256_set1_ps(inv)));
}

// the in-flight tokens row t of a packed mask [T, words] sees, in pass order
int visible_tokens(const int32_t* mask_row, int tokens, int* visible) {
  int n = 0;
  for (int j = 0; j < tokens; ++j)
    if ((static_cast<uint32_t>(mask_row[j / 32]) >> (j % 32)) & 1u) visible[n++] = j;
  return n;
}

// ---------------------------------------------------------------------------------------------------------
// the model

struct Layer {
  Matrix qkv, o, gate_up, down;
  const float* attn_norm;
  const float* mlp_norm;
};

}  // namespace

extern "C" {

// What Python hands over (clover/kernels/cpu_target.py mirrors it with ctypes). Weight pointers stay owned by
// Python and must outlive the model.
struct CloverLayerDesc {
  const uint8_t* qkv;
  const uint8_t* o;
  const uint8_t* gate_up;
  const uint8_t* down;
  const float* attn_norm;
  const float* mlp_norm;
  int32_t format;
};

struct CloverModelDesc {
  int32_t hidden, intermediate, heads, kv_heads, head_dim, vocab, layers, max_positions, threads;
  float eps;
  const uint8_t* embedding;     // Q8_0 [vocab, hidden]
  const uint8_t* lm_head;       // [vocab, hidden] in lm_head_format
  int32_t lm_head_format;
  const float* final_norm;
  const float* rope_cos;        // [max_positions, head_dim / 2]
  const float* rope_sin;
  const CloverLayerDesc* layer; // layers target layers, then the Augmenting Block if has_augment
  int32_t has_augment;
  const uint8_t* feature_fuse;  // Q8_0 [hidden, hidden * num_features], or null
  int32_t num_features;
  const int32_t* feature_layers;  // the target layers whose inputs the Augmenting Block reads (fused)
};

}  // extern "C"

namespace {

struct Buffers {
  std::vector<float> x, attn_in, qkv, attn, gate_up, act, features, augment;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<float> scores;   // per thread
  std::vector<int> visible;    // per thread
};

class Model {
 public:
  explicit Model(const CloverModelDesc& desc) : c_(desc), pool_(desc.threads) {
    const int qkv_n = (c_.heads + 2 * c_.kv_heads) * c_.head_dim;
    for (int l = 0; l < c_.layers + (c_.has_augment ? 1 : 0); ++l) {
      const CloverLayerDesc& L = desc.layer[l];
      layers_.push_back(Layer{{L.qkv, L.format, qkv_n, c_.hidden},
                              {L.o, L.format, c_.hidden, c_.heads * c_.head_dim},
                              {L.gate_up, L.format, 2 * c_.intermediate, c_.hidden},
                              {L.down, L.format, c_.hidden, c_.intermediate},
                              L.attn_norm, L.mlp_norm});
    }
    lm_head_ = Matrix{c_.lm_head, c_.lm_head_format, c_.vocab, c_.hidden};
    fuse_ = Matrix{c_.feature_fuse, kFormatQ80, c_.hidden, c_.hidden * c_.num_features};
    features_.assign(desc.feature_layers, desc.feature_layers + desc.num_features);
  }

  struct Pass {
    const int64_t* ids;
    const int64_t* positions;
    const int32_t* past;
    const int32_t* mask;
    int batch, tokens, words;
    float* const* k_cache;   // per KV layer: [batch, kv_heads, cache_len, head_dim]
    float* const* v_cache;
    int cache_len;
    float* logits;           // [batch * tokens, vocab]
    float* h0;               // [batch * tokens, hidden]
  };

  void forward(const Pass& p) {
    const int rows = p.batch * p.tokens;
    reserve(rows, p.cache_len + p.tokens);
    pool_.run([&](int t) { forward_thread(p, rows, t); });
  }

 private:
  void reserve(int rows, int keys) {
    const int h = c_.hidden, qkv_n = (c_.heads + 2 * c_.kv_heads) * c_.head_dim;
    const int kmax = std::max({h * std::max(1, c_.num_features), c_.intermediate, c_.heads * c_.head_dim});
    auto grow = [](auto& v, size_t n) { if (v.size() < n) v.resize(n); };
    grow(b_.x, size_t(rows) * h);
    grow(b_.attn_in, size_t(rows) * h);
    grow(b_.qkv, size_t(rows) * qkv_n);
    grow(b_.attn, size_t(rows) * c_.heads * c_.head_dim);
    grow(b_.gate_up, size_t(rows) * 2 * c_.intermediate);
    grow(b_.act, size_t(rows) * c_.intermediate);
    grow(b_.features, size_t(rows) * h * std::max(1, c_.num_features));
    grow(b_.augment, size_t(rows) * h);
    grow(b_.q, size_t(rows) * kmax);
    grow(b_.d, size_t(rows) * kmax / kBlock);
    grow(b_.s, size_t(rows) * kmax / kBlock);
    grow(b_.scores, size_t(pool_.size()) * ((keys + 7) / 8 * 8));
    grow(b_.visible, size_t(pool_.size()) * p_tokens_cap(keys));
  }
  static int p_tokens_cap(int keys) { return keys; }

  Activations acts(int k) { return Activations{b_.q.data(), b_.d.data(), b_.s.data(), k}; }

  // a per-row step over this thread's share of the rows
  template <typename F>
  void each_row(int t, int rows, F&& f) {
    int r0, r1;
    share(t, pool_.size(), rows, &r0, &r1);
    for (int r = r0; r < r1; ++r) f(r);
  }

  void embed(const Pass& p, int t, int rows) {
    const int h = c_.hidden, nb = h / kBlock;
    each_row(t, rows, [&](int r) {
      const uint8_t* row = c_.embedding + p.ids[r] * int64_t(nb) * kQ80Bytes;
      float* x = b_.x.data() + int64_t(r) * h;
      for (int b = 0; b < nb; ++b) {
        const float d = f16(row + b * kQ80Bytes);
        const int8_t* q = reinterpret_cast<const int8_t*>(row + b * kQ80Bytes + 2);
        for (int i = 0; i < kBlock; ++i) x[b * kBlock + i] = d * static_cast<float>(q[i]);
      }
    });
  }

  void forward_thread(const Pass& p, int rows, int t) {
    embed(p, t, rows);
    pool_.barrier();
    float* x = b_.x.data();
    for (int l = 0; l < c_.layers; ++l) {
      keep_feature(l, t, rows);
      layer(p, l, x, l, t, rows);
    }
    pool_.barrier();
    const int h = c_.hidden;
    Activations a = acts(h);
    each_row(t, rows, [&](int r) {
      float* normed = b_.attn_in.data() + int64_t(r) * h;
      rms_norm_row(x + int64_t(r) * h, c_.final_norm, h, c_.eps, normed);
      quantize_rows(b_.attn_in.data(), h, r, r + 1, a);
    });
    pool_.barrier();
    matmul(pool_, t, lm_head_, a, rows, p.logits, c_.vocab, false);
    if (c_.has_augment) {
      augment_input(t, rows);
      layer(p, c_.layers, b_.augment.data(), c_.layers, t, rows);
      pool_.barrier();
    }
    const float* h0 = c_.has_augment ? b_.augment.data() : x;
    each_row(t, rows, [&](int r) { std::memcpy(p.h0 + int64_t(r) * h, h0 + int64_t(r) * h, sizeof(float) * h); });
  }

  // the Augmenting Block reads the input of the last target layer, or of several fused (docs/drafter.md)
  void keep_feature(int l, int t, int rows) {
    if (!c_.has_augment) return;
    const int h = c_.hidden, n = std::max(1, c_.num_features);
    for (int f = 0; f < n; ++f) {
      const int wanted = c_.num_features ? features_[f] : c_.layers - 1;
      if (wanted != l) continue;
      pool_.barrier();  // the previous layer's last writes to x
      each_row(t, rows, [&](int r) {
        std::memcpy(b_.features.data() + (int64_t(r) * n + f) * h, b_.x.data() + int64_t(r) * h, sizeof(float) * h);
      });
    }
  }

  void augment_input(int t, int rows) {
    const int h = c_.hidden;
    pool_.barrier();
    if (!c_.num_features) {
      each_row(t, rows, [&](int r) {
        std::memcpy(b_.augment.data() + int64_t(r) * h, b_.features.data() + int64_t(r) * h, sizeof(float) * h);
      });
      pool_.barrier();
      return;
    }
    const int k = h * c_.num_features;
    Activations a = acts(k);
    each_row(t, rows, [&](int r) { quantize_rows(b_.features.data(), k, r, r + 1, a); });
    pool_.barrier();
    matmul(pool_, t, fuse_, a, rows, b_.augment.data(), h, false);
    pool_.barrier();
  }

  // one decoder layer over the stream x [rows, hidden], its K/V into KV layer kv
  void layer(const Pass& p, int l, float* x, int kv, int t, int rows) {
    const Layer& L = layers_[l];
    const int h = c_.hidden, qkv_n = L.qkv.n, width = c_.heads * c_.head_dim;
    pool_.barrier();
    Activations a = acts(h);
    each_row(t, rows, [&](int r) {
      rms_norm_row(x + int64_t(r) * h, L.attn_norm, h, c_.eps, b_.attn_in.data() + int64_t(r) * h);
      quantize_rows(b_.attn_in.data(), h, r, r + 1, a);
    });
    pool_.barrier();
    matmul(pool_, t, L.qkv, a, rows, b_.qkv.data(), qkv_n, false);
    pool_.barrier();
    each_row(t, rows, [&](int r) { rope_and_store(p, kv, r); });
    pool_.barrier();
    attention(p, kv, t, rows);
    pool_.barrier();
    Activations ao = acts(width);
    each_row(t, rows, [&](int r) { quantize_rows(b_.attn.data(), width, r, r + 1, ao); });
    pool_.barrier();
    matmul(pool_, t, L.o, ao, rows, x, h, true);
    pool_.barrier();
    each_row(t, rows, [&](int r) {
      rms_norm_row(x + int64_t(r) * h, L.mlp_norm, h, c_.eps, b_.attn_in.data() + int64_t(r) * h);
      quantize_rows(b_.attn_in.data(), h, r, r + 1, a);
    });
    pool_.barrier();
    matmul(pool_, t, L.gate_up, a, rows, b_.gate_up.data(), 2 * c_.intermediate, false);
    pool_.barrier();
    const int inter = c_.intermediate;
    Activations am = acts(inter);
    each_row(t, rows, [&](int r) {
      const float* gu = b_.gate_up.data() + int64_t(r) * 2 * inter;
      silu_mul_row(gu, gu + inter, inter, b_.act.data() + int64_t(r) * inter);
      quantize_rows(b_.act.data(), inter, r, r + 1, am);
    });
    pool_.barrier();
    matmul(pool_, t, L.down, am, rows, x, h, true);
  }

  float* cache_row(float* const* cache, int kv, int b, int head, int pos, int cache_len) const {
    return cache[kv] + ((int64_t(b) * c_.kv_heads + head) * cache_len + pos) * c_.head_dim;
  }

  void rope_and_store(const Pass& p, int kv, int r) {
    const int d = c_.head_dim, b = r / p.tokens, tok = r % p.tokens;
    float* row = b_.qkv.data() + int64_t(r) * (c_.heads + 2 * c_.kv_heads) * d;
    const int64_t pos = p.positions[r];
    const float* cos = c_.rope_cos + pos * (d / 2);
    const float* sin = c_.rope_sin + pos * (d / 2);
    rope_row(row, c_.heads + c_.kv_heads, d, cos, sin);  // q heads, then k heads
    const int slot = p.past[b] + tok;
    for (int hkv = 0; hkv < c_.kv_heads; ++hkv) {
      std::memcpy(cache_row(p.k_cache, kv, b, hkv, slot, p.cache_len), row + (c_.heads + hkv) * d, sizeof(float) * d);
      std::memcpy(cache_row(p.v_cache, kv, b, hkv, slot, p.cache_len), row + (c_.heads + c_.kv_heads + hkv) * d,
                  sizeof(float) * d);
    }
  }

  void attention(const Pass& p, int kv, int t, int rows) {
    const int d = c_.head_dim, group = c_.heads / c_.kv_heads;
    const int keys_cap = (p.cache_len + p.tokens + 7) / 8 * 8;
    float* scores = b_.scores.data() + int64_t(t) * keys_cap;
    int* visible = b_.visible.data() + int64_t(t) * (p.cache_len + p.tokens);
    int lo, hi;
    share(t, pool_.size(), rows * c_.heads, &lo, &hi);
    for (int task = lo; task < hi; ++task) {
      const int r = task / c_.heads, head = task % c_.heads, b = r / p.tokens, hkv = head / group;
      const int past = p.past[b];
      KeySource keys{cache_row(p.k_cache, kv, b, hkv, 0, p.cache_len), cache_row(p.v_cache, kv, b, hkv, 0, p.cache_len),
                     d, past,
                     cache_row(p.k_cache, kv, b, hkv, past, p.cache_len), cache_row(p.v_cache, kv, b, hkv, past, p.cache_len),
                     d, visible, 0};
      keys.num_visible = visible_tokens(p.mask + int64_t(r) * p.words, p.tokens, visible);
      const float* q = b_.qkv.data() + int64_t(r) * (c_.heads + 2 * c_.kv_heads) * d + head * d;
      attend_row(q, keys, d, 1.0f / std::sqrt(static_cast<float>(d)), scores,
                 b_.attn.data() + int64_t(r) * c_.heads * d + head * d);
    }
  }

  CloverModelDesc c_;
  Pool pool_;
  std::vector<Layer> layers_;
  Matrix lm_head_, fuse_;
  std::vector<int> features_;
  Buffers b_;
};

}  // namespace

extern "C" {

void* clover_model_new(const CloverModelDesc* desc) { return new Model(*desc); }

void clover_model_free(void* model) { delete static_cast<Model*>(model); }

// One target pass (engine contract v3: the new tokens' K/V written into the cache at past + t).
void clover_model_forward(void* model, const int64_t* ids, const int64_t* positions, const int32_t* past,
                          const int32_t* mask, int32_t batch, int32_t tokens, int32_t words, float* const* k_cache,
                          float* const* v_cache, int32_t cache_len, float* logits, float* h0) {
  Model::Pass p{ids, positions, past, mask, batch, tokens, words, k_cache, v_cache, cache_len, logits, h0};
  static_cast<Model*>(model)->forward(p);
}

// The linear alone (tests): out[rows, n] = int8(x) . w, x fp32 [rows, k] quantised per row as in a pass.
void clover_linear(const uint8_t* w, int32_t format, int32_t n, int32_t k, const float* x, int32_t rows, float* out) {
  std::vector<int8_t> q(size_t(rows) * k);
  std::vector<float> d(size_t(rows) * k / kBlock), s(size_t(rows) * k / kBlock);
  Activations a{q.data(), d.data(), s.data(), k};
  quantize_rows(x, k, 0, rows, a);
  matmul_columns(Matrix{w, format, n, k}, a, rows, out, n, false, 0, n);
}

// TreeAttention alone (tests; the contract of clover.attention.tree_attention): q [B, T, Hq, D], k/v
// [B, T, Hkv, D], caches [B, Hkv, S, D] read only, out [B, T, Hq, D].
void clover_tree_attention(const float* q, const float* k, const float* v, const float* k_cache, const float* v_cache,
                           const int32_t* past, const int32_t* mask, int32_t batch, int32_t tokens, int32_t heads,
                           int32_t kv_heads, int32_t d, int32_t cache_len, int32_t words, float* out) {
  std::vector<float> scores((cache_len + tokens + 7) / 8 * 8);
  std::vector<int> visible(tokens);
  const int group = heads / kv_heads;
  for (int b = 0; b < batch; ++b)
    for (int t = 0; t < tokens; ++t)
      for (int h = 0; h < heads; ++h) {
        const int hkv = h / group;
        const int64_t cache = (int64_t(b) * kv_heads + hkv) * cache_len * d;
        const int64_t fresh = (int64_t(b) * tokens * kv_heads + hkv) * d;
        KeySource keys{k_cache + cache, v_cache + cache, d, past[b], k + fresh, v + fresh, int64_t(kv_heads) * d,
                       visible.data(), 0};
        keys.num_visible = visible_tokens(mask + (int64_t(b) * tokens + t) * words, tokens, visible.data());
        const int64_t row = ((int64_t(b) * tokens + t) * heads + h) * d;
        attend_row(q + row, keys, d, 1.0f / std::sqrt(static_cast<float>(d)), scores.data(), out + row);
      }
}

}  // extern "C"
