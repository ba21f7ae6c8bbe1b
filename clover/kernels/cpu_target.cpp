// The pass-shape-invariant CPU target: a Llama decoder over the GGUF's own Q4_1 / Q8_0 blocks with int8
// activations, tree attention over the in-place KV cache, one native call per pass.
// Why a kernel of our own, and the rules it keeps: docs/quantized-target.md#the-exact-int8-engine.
//
// Invariance: every operation computes a token's row with code that depends only on that row (its inputs,
// its position, the keys its mask lets it see, in their logical order), never on how many rows the pass
// holds, where the row sits in it, or which thread runs it:
//  - matmuls: every row runs the same micro-kernel over weights repacked 8 columns to a block, each block
//    unpacked once for all the rows of a tile; a (row, column)'s integer sums are exact and its float chain is
//    fixed (see "matmuls" below), whatever the tile or register width; threads split output columns, never a
//    reduction;
//  - attention: a row's keys are its past in cache order, then its visible in-flight tokens in pass order
//    (ancestors precede descendants, so that is depth order, the order they have after the commit); every
//    reduction over keys runs in blocks fixed by logical key index;
//  - norms, RoPE, SiLU, activation quantisation: per row.
// Compiled with -ffp-contract=off, so each written multiply-add stays what it is in every instantiation.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

constexpr int kBlock = 32;           // weights / activations per quantisation block
constexpr int kQ80Bytes = 34;        // fp16 d, 32 int8
constexpr int kFormatQ41 = 0;
constexpr int kFormatQ80 = 1;
#if defined(CLOVER_AVX512_VNNI)
constexpr int kRowTile = 8;          // rows sharing one unpacked weight block (32 vector registers)
#else
constexpr int kRowTile = 4;          // rows sharing one unpacked weight block (16 vector registers)
#endif

// ---------------------------------------------------------------------------------------------------------
// threads (docs/quantized-target.md#threads-on-a-busy-machine): the calling thread runs a pass's phases in
// order; for each it publishes the phase, and every thread, itself included, claims the phase's items in
// chunks until none are left. The caller then waits for the items in flight, never for a thread: a helper
// that the OS has descheduled (another job on its core) delays a phase only by the chunk it holds, and one
// that wakes late finds the phase done and waits for the next. Which thread computes an item never changes
// a bit (items are output columns, rows or (row, head) pairs; no reduction is split).

class Pool {
  static constexpr int kSlots = 4;             // phases in flight at most: the caller reuses a slot 4 phases on
  static constexpr int kChunksPerThread = 4;   // items / (threads * 4) per claim: balance against claim traffic
  static constexpr int kHelperSpins = 20000;   // a helper spins this long for the next phase, then sleeps
  static constexpr int kCallerSpins = 2000;    // the caller spins this long for chunks in flight, then sleeps
  static constexpr int kProbeEvery = 64;       // passes between tries of the way (all threads / caller alone) not taken
  static constexpr int kTimedSizes = 65;       // pass sizes timed apart (rows; 64 and more share one)

 public:
  using Body = void (*)(const void* context, int lo, int hi, int thread);

  explicit Pool(int threads) : threads_(std::max(1, threads)) {
    for (int t = 1; t < threads_; ++t) helpers_.emplace_back([this, t] { help(t); });
  }
  ~Pool() {
    stop_.store(true);
    word_.fetch_add(uint64_t(1) << 32);
    word_.notify_all();
    for (auto& h : helpers_) h.join();
  }
  int size() const { return threads_; }

  // A pass of `rows` rows: on all threads, or on the caller alone, whichever was faster lately for passes of that
  // size; the other way is tried once every kProbeEvery passes. Another job on the helpers' cores makes them late
  // (the OS deschedules them while they hold a chunk), and one thread alone is then faster; when the job ends, the
  // helpers pay again. Never changes a bit (docs/quantized-target.md#threads-on-a-busy-machine).
  template <typename F>
  void pass(int rows, const F& f) {
    Timing& t = timing_[std::min(rows, kTimedSizes - 1)];
    const bool faster_solo = t.solo > 0 && t.solo < t.parallel;
    const bool probe = ++t.passes % kProbeEvery == 0 || (t.passes == kProbeEvery / 2 && t.solo == 0);
    solo_ = threads_ > 1 && (faster_solo != probe);
    const auto start = std::chrono::steady_clock::now();
    f();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    double& mean = solo_ ? t.solo : t.parallel;
    mean = mean == 0 ? seconds : 0.7 * mean + 0.3 * seconds;
    solo_ = false;
  }

  // f(lo, hi, thread) over [0, items), every item exactly once; returns when all are done
  template <typename F>
  void parallel_for(int items, const F& f) {
    if (items <= 0) return;
    if (threads_ == 1 || items == 1 || solo_) return f(0, items, 0);
    const uint64_t seq = (word_.load(std::memory_order_relaxed) >> 32) + 1;
    Slot& slot = slots_[seq % kSlots];
    slot.body.store(&invoke<F>, std::memory_order_relaxed);
    slot.context.store(&f, std::memory_order_relaxed);
    slot.items.store(items, std::memory_order_relaxed);
    slot.chunk.store(std::max(1, items / (threads_ * kChunksPerThread)), std::memory_order_relaxed);
    slot.done.store(0, std::memory_order_relaxed);
    word_.store(seq << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst)) word_.notify_all();
    work_on(seq, 0);
    wait_done(slot, items);
  }

 private:
  struct alignas(64) Slot {
    std::atomic<Body> body{nullptr};
    std::atomic<const void*> context{nullptr};
    std::atomic<int> items{0}, chunk{1};
    alignas(64) std::atomic<int> done{0};
  };

  template <typename F>
  static void invoke(const void* context, int lo, int hi, int thread) { (*static_cast<const F*>(context))(lo, hi, thread); }

  // claim the next chunk of phase seq; false once it has none left (or a later phase has replaced it)
  bool claim(uint64_t seq, Body* body, const void** context, int* lo, int* hi) {
    uint64_t word = word_.load(std::memory_order_acquire);
    for (;;) {
      if ((word >> 32) != seq) return false;
      const Slot& slot = slots_[seq % kSlots];
      const int next = static_cast<int>(static_cast<uint32_t>(word));
      const int items = slot.items.load(std::memory_order_relaxed), chunk = slot.chunk.load(std::memory_order_relaxed);
      *body = slot.body.load(std::memory_order_relaxed);
      *context = slot.context.load(std::memory_order_relaxed);
      if (next >= items) return false;
      // the compare-exchange fails where the slot was reused meanwhile: what was read above is then discarded
      if (word_.compare_exchange_weak(word, word + chunk, std::memory_order_acq_rel, std::memory_order_acquire)) {
        *lo = next, *hi = std::min(items, next + chunk);
        return true;
      }
    }
  }

  void work_on(uint64_t seq, int thread) {
    Body body;
    const void* context;
    Slot& slot = slots_[seq % kSlots];
    for (int lo, hi; claim(seq, &body, &context, &lo, &hi);) {
      body(context, lo, hi, thread);
      slot.done.fetch_add(hi - lo, std::memory_order_seq_cst);
      if (caller_sleeps_.load(std::memory_order_seq_cst)) slot.done.notify_all();
    }
  }

  void wait_done(Slot& slot, int items) {
    for (int spin = 0; spin < kCallerSpins; ++spin)
      if (slot.done.load(std::memory_order_acquire) == items) return;
      else _mm_pause();
    caller_sleeps_.store(true, std::memory_order_seq_cst);
    for (int done; (done = slot.done.load(std::memory_order_seq_cst)) != items;) slot.done.wait(done);
    caller_sleeps_.store(false, std::memory_order_relaxed);
  }

  // a helper: wait for a phase it has not seen, help with it, repeat
  void help(int thread) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t word = word_.load(std::memory_order_acquire);
      for (int spin = 0; spin < kHelperSpins && (word >> 32) == seen; ++spin) {
        _mm_pause();
        word = word_.load(std::memory_order_acquire);
      }
      if ((word >> 32) == seen) {
        // sleep on the word: a spinning helper would take a core from the Python and onnxruntime work between passes
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while (((word = word_.load(std::memory_order_seq_cst)) >> 32) == seen) word_.wait(word);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      if (stop_.load()) return;
      seen = word >> 32;
      work_on(seen, thread);
    }
  }

  int threads_;
  std::vector<std::thread> helpers_;
  Slot slots_[kSlots];
  alignas(64) std::atomic<uint64_t> word_{0};  // phase number << 32 | next unclaimed item
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> caller_sleeps_{false};
  std::atomic<bool> stop_{false};
  struct Timing {
    double parallel = 0, solo = 0;  // seconds per pass, moving averages (0: not timed yet)
    int64_t passes = 0;
  };
  bool solo_ = false;  // this pass runs on the caller alone
  Timing timing_[kTimedSizes];
};

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

// Stored in tiles of kRowTile rows, block-major inside a tile (row r, block b at tile r / kRowTile, then b, then
// r % kRowTile), so a matmul tile finds the block b of its rows at fixed offsets from one pointer.
struct Activations {
  int8_t* q = nullptr;      // [tiles, K/32, kRowTile, 32]
  float* d = nullptr;       // [tiles, K/32, kRowTile]
  float* s = nullptr;       // [tiles, K/32, kRowTile]
  int32_t* sums = nullptr;  // [tiles, K/32, kRowTile] the integer sum(q) of each block
  int k = 0;
  int64_t blocks() const { return k / kBlock; }
  // the tile of rows [r0, r0 + kRowTile), r0 a multiple of kRowTile: block b of its row r at q_tile + b * kRowTile
  // * kBlock + r * kBlock, its scales at scale_tile + b * kRowTile + r
  const int8_t* q_tile(int r0) const { return q + int64_t(r0) * k; }
  int64_t scale_tile(int r0) const { return int64_t(r0) * blocks(); }
  int64_t row_offset(int r) const { return int64_t(r - r % kRowTile) * blocks() + r % kRowTile; }  // in scales
};

// one row x [k] into q / d / s / sums, whose consecutive blocks lie `stride` elements (scales) apart
void quantize_row(const float* x, int k, int stride, int8_t* q, float* d, float* s, int32_t* sums) {
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
    for (int i = 0; i < kBlock; ++i) q[int64_t(b) * stride * kBlock + i] = static_cast<int8_t>(lanes[i]);
    alignas(32) int32_t parts[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sum);
    int total = 0;
    for (int i = 0; i < 8; ++i) total += parts[i];
    d[b * stride] = scale;
    s[b * stride] = scale * static_cast<float>(total);
    sums[b * stride] = total;
  }
}

void quantize_rows(const float* x, int ldx, int r0, int r1, const Activations& a) {
  for (int r = r0; r < r1; ++r) {
    const int64_t at = a.row_offset(r);
    quantize_row(x + r * int64_t(ldx), a.k, kRowTile, a.q + at * kBlock, a.d + at, a.s + at, a.sums + at);
  }
}

// ---------------------------------------------------------------------------------------------------------
// matmuls over the repacked weights (docs/quantized-target.md#the-repacked-layout). Build time interleaves 8
// output columns per block, so that one integer dot-product instruction covers 4 inputs of 8 columns, the 32
// inputs of a block end in one int32 per column (exact, in any order and with any instruction), and the float
// work of a block (one convert, one multiply, one fmadd, and Q4_1's minimum fmadd) covers 8 columns at once.
// Each block is unpacked once and shared by every row of a tile.
//
// A (row, column)'s float chain, the same whatever the rows, the tile or the instruction set:
//   for each block b in order: acc = fma(dw[b] * dx[b], float(isum[b]), acc);  Q4_1 also: mins = fma(mw[b], sx[b], mins)
//   then out = acc (+ mins for Q4_1), (+ out where the matmul accumulates into the residual stream).

constexpr int kGroup = 8;                                  // output columns interleaved per block
constexpr int kQ41Packed = 2 * 2 * kGroup + 16 * kGroup;  // 8 fp16 d, 8 fp16 m, 4 chunks of 8 columns x 4 bytes
constexpr int kQ80Packed = 2 * kGroup + 32 * kGroup;      // 8 fp16 d, 8 chunks of 8 columns x 4 bytes

struct Packed {
  const uint8_t* data = nullptr;  // [ceil(n / 8) groups][k / 32 blocks][block bytes]
  int format = kFormatQ41;
  int n = 0, k = 0;
  int groups() const { return (n + kGroup - 1) / kGroup; }
  int blocks() const { return k / kBlock; }
  int block_bytes() const { return format == kFormatQ41 ? kQ41Packed : kQ80Packed; }
  const uint8_t* block(int g, int b) const { return data + (int64_t(g) * blocks() + b) * block_bytes(); }
};

// 4 activations (one int32) in every lane: the inputs that one dot-product step multiplies with 8 columns
inline __m256i broadcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

#if defined(CLOVER_AVX512_VNNI)
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(CLOVER_AVX_VNNI)
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif

// A Q4_1 block of 8 columns: chunk i's low nibbles are inputs 4i..4i+3, its high nibbles inputs 16+4i..19+4i
struct Q41Block {
  __m256 d, m;
  __m256i lo[4], hi[4];
};

inline Q41Block load_q4_1(const uint8_t* p) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  Q41Block b;
  b.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  b.m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  for (int i = 0; i < 4; ++i) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 + 32 * i));
    b.lo[i] = _mm256_and_si256(raw, low);
    b.hi[i] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  }
  return b;
}

// the 8 columns' integer dot products with one row's block x (32 int8)
inline __m256i isum_q4_1(const Q41Block& w, const int8_t* x) {
#if defined(CLOVER_AVX512_VNNI) || defined(CLOVER_AVX_VNNI)
  // four independent chains (integer sums: any order gives the same int32), so the dot products' latency hides
  __m256i s[4];
  for (int i = 0; i < 4; ++i) s[i] = dot_u8s8(_mm256_setzero_si256(), w.lo[i], broadcast4(x + 4 * i));
  for (int i = 0; i < 4; ++i) s[i] = dot_u8s8(s[i], w.hi[i], broadcast4(x + 16 + 4 * i));
  return _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
#else
  // each maddubs lane is at most 2 * 15 * 127 = 3810, eight of them 30480: the int16 sums cannot overflow
  __m256i s[2];
  for (int h = 0; h < 2; ++h) {
    s[h] = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo[2 * h], broadcast4(x + 8 * h)),
                            _mm256_maddubs_epi16(w.lo[2 * h + 1], broadcast4(x + 8 * h + 4)));
    s[h] = _mm256_add_epi16(s[h], _mm256_add_epi16(_mm256_maddubs_epi16(w.hi[2 * h], broadcast4(x + 16 + 8 * h)),
                                                   _mm256_maddubs_epi16(w.hi[2 * h + 1], broadcast4(x + 20 + 8 * h))));
  }
  return _mm256_madd_epi16(_mm256_add_epi16(s[0], s[1]), _mm256_set1_epi16(1));
#endif
}

// A Q8_0 block of 8 columns: chunk i holds inputs 4i..4i+3. VNNI keeps w + 128 (unsigned), AVX2 w and |w|.
struct Q80Block {
  __m256 d;
  __m256i q[8];
#if !defined(CLOVER_AVX512_VNNI) && !defined(CLOVER_AVX_VNNI)
  __m256i magnitude[8];
#endif
};

inline Q80Block load_q8_0(const uint8_t* p) {
  Q80Block b;
  b.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  for (int i = 0; i < 8; ++i) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * i));
#if defined(CLOVER_AVX512_VNNI) || defined(CLOVER_AVX_VNNI)
    b.q[i] = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
#else
    b.q[i] = w;
    b.magnitude[i] = _mm256_sign_epi8(w, w);
#endif
  }
  return b;
}

// x_sum: the block's activations summed (VNNI multiplies w + 128 and takes 128 * x_sum back off)
inline __m256i isum_q8_0(const Q80Block& w, const int8_t* x, int32_t x_sum) {
#if defined(CLOVER_AVX512_VNNI) || defined(CLOVER_AVX_VNNI)
  __m256i s[4] = {_mm256_set1_epi32(-128 * x_sum), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int i = 0; i < 8; ++i) s[i % 4] = dot_u8s8(s[i % 4], w.q[i], broadcast4(x + 4 * i));
  return _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
#else
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int i = 0; i < 8; ++i) {
    const __m256i products = _mm256_maddubs_epi16(w.magnitude[i], _mm256_sign_epi8(broadcast4(x + 4 * i), w.q[i]));
    s[i % 2] = _mm256_add_epi32(s[i % 2], _mm256_madd_epi16(products, ones));
  }
  return _mm256_add_epi32(s[0], s[1]);
#endif
}

// out[0, valid) (+)= v: full groups in one store, the last group of a matrix whose n is no multiple of 8 lane by lane
inline void store_group(float* out, __m256 v, int valid, bool accumulate) {
  if (valid >= kGroup) {
    if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(out), v);
    _mm256_storeu_ps(out, v);
    return;
  }
  alignas(32) float lanes[kGroup];
  _mm256_store_ps(lanes, v);
  for (int i = 0; i < valid; ++i) out[i] = accumulate ? out[i] + lanes[i] : lanes[i];
}

// the weights are read once per pass, in order: ask for them a few blocks ahead of their use
inline void prefetch_ahead(const Packed& w, int g, int b) {
  constexpr int kAhead = 4;
  const uint8_t* p = w.data + (int64_t(g) * w.blocks() + b + kAhead) * w.block_bytes();
  for (int line = 0; line < w.block_bytes(); line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// group g's 8 columns for rows [r0, r0 + R)
template <int R>
void group_q4_1(const Packed& w, int g, const Activations& a, int r0, float* out, int64_t ldo, bool accumulate) {
  __m256 acc[R], mins[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = _mm256_setzero_ps();
  const int8_t* xq = a.q_tile(r0);
  const float* xd = a.d + a.scale_tile(r0);
  const float* xs = a.s + a.scale_tile(r0);
  for (int b = 0; b < w.blocks(); ++b, xq += kRowTile * kBlock, xd += kRowTile, xs += kRowTile) {
    prefetch_ahead(w, g, b);
    const Q41Block block = load_q4_1(w.block(g, b));
#pragma GCC unroll 8  // unrolled, the accumulators stay in registers
    for (int r = 0; r < R; ++r) {
      const __m256 sums = _mm256_cvtepi32_ps(isum_q4_1(block, xq + r * kBlock));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(block.d, _mm256_set1_ps(xd[r])), sums, acc[r]);
      mins[r] = _mm256_fmadd_ps(block.m, _mm256_set1_ps(xs[r]), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    store_group(out + (r0 + r) * ldo + g * kGroup, _mm256_add_ps(acc[r], mins[r]), w.n - g * kGroup, accumulate);
}

template <int R>
void group_q8_0(const Packed& w, int g, const Activations& a, int r0, float* out, int64_t ldo, bool accumulate) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* xq = a.q_tile(r0);
  const float* xd = a.d + a.scale_tile(r0);
  const int32_t* xsum = a.sums + a.scale_tile(r0);
  for (int b = 0; b < w.blocks(); ++b, xq += kRowTile * kBlock, xd += kRowTile, xsum += kRowTile) {
    prefetch_ahead(w, g, b);
    const Q80Block block = load_q8_0(w.block(g, b));
#pragma GCC unroll 8  // unrolled, the accumulators stay in registers
    for (int r = 0; r < R; ++r) {
      const __m256 sums = _mm256_cvtepi32_ps(isum_q8_0(block, xq + r * kBlock, xsum[r]));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(block.d, _mm256_set1_ps(xd[r])), sums, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_group(out + (r0 + r) * ldo + g * kGroup, acc[r], w.n - g * kGroup, accumulate);
}

template <int R>
inline void group_rows(const Packed& w, int g, const Activations& a, int r0, float* out, int64_t ldo, bool acc) {
  if (w.format == kFormatQ41)
    group_q4_1<R>(w, g, a, r0, out, ldo, acc);
  else
    group_q8_0<R>(w, g, a, r0, out, ldo, acc);
}

#if defined(CLOVER_AVX512_VNNI)
// Groups g and g + 1 side by side in 512-bit registers: one broadcast of 4 activations serves 16 columns, and one
// convert, multiply and fmadd cover them. Each lane runs the operations group_q4_1 / group_q8_0 run for its
// column, in the same order (vector lanes never mix), so a column's bits do not depend on which kernel ran it.

inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512 scales_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a))));
}

inline __m512i broadcast4x16(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

inline void store_pair(float* out, __m512 v, int valid, bool accumulate) {
  store_group(out, _mm512_castps512_ps256(v), valid, accumulate);
  store_group(out + kGroup, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), valid - kGroup, accumulate);
}

template <int R>
void group_pair_q4_1(const Packed& w, int g, const Activations& a, int r0, float* out, int64_t ldo, bool accumulate) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R], mins[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), mins[r] = _mm512_setzero_ps();
  const int8_t* xq = a.q_tile(r0);
  const float* xd = a.d + a.scale_tile(r0);
  const float* xs = a.s + a.scale_tile(r0);
  for (int b = 0; b < w.blocks(); ++b, xq += kRowTile * kBlock, xd += kRowTile, xs += kRowTile) {
    prefetch_ahead(w, g, b);
    prefetch_ahead(w, g + 1, b);
    const uint8_t* pa = w.block(g, b);
    const uint8_t* pb = w.block(g + 1, b);
    const __m512 d = scales_pair(pa, pb), m = scales_pair(pa + 16, pb + 16);
    __m512i lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = load_pair(pa + 32 + 32 * i, pb + 32 + 32 * i);
      lo[i] = _mm512_and_si512(raw, low);
      hi[i] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
#pragma GCC unroll 8  // unrolled, the accumulators stay in registers
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * kBlock;
      __m512i s[4];
      for (int i = 0; i < 4; ++i) s[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], broadcast4x16(x + 4 * i));
      for (int i = 0; i < 4; ++i) s[i] = _mm512_dpbusd_epi32(s[i], hi[i], broadcast4x16(x + 16 + 4 * i));
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3])));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd[r])), sums, acc[r]);
      mins[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r]), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    store_pair(out + (r0 + r) * ldo + g * kGroup, _mm512_add_ps(acc[r], mins[r]), w.n - g * kGroup, accumulate);
}

template <int R>
void group_pair_q8_0(const Packed& w, int g, const Activations& a, int r0, float* out, int64_t ldo, bool accumulate) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* xq = a.q_tile(r0);
  const float* xd = a.d + a.scale_tile(r0);
  const int32_t* xsum = a.sums + a.scale_tile(r0);
  for (int b = 0; b < w.blocks(); ++b, xq += kRowTile * kBlock, xd += kRowTile, xsum += kRowTile) {
    prefetch_ahead(w, g, b);
    prefetch_ahead(w, g + 1, b);
    const uint8_t* pa = w.block(g, b);
    const uint8_t* pb = w.block(g + 1, b);
    const __m512 d = scales_pair(pa, pb);
    __m512i q[8];
    for (int i = 0; i < 8; ++i) q[i] = _mm512_xor_si512(load_pair(pa + 16 + 32 * i, pb + 16 + 32 * i), flip);
#pragma GCC unroll 8  // unrolled, the accumulators stay in registers
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * kBlock;
      __m512i s[4] = {_mm512_set1_epi32(-128 * xsum[r]), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
      for (int i = 0; i < 8; ++i) s[i % 4] = _mm512_dpbusd_epi32(s[i % 4], q[i], broadcast4x16(x + 4 * i));
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3])));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd[r])), sums, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_pair(out + (r0 + r) * ldo + g * kGroup, acc[r], w.n - g * kGroup, accumulate);
}

template <int R>
inline void pair_rows(const Packed& w, int g, const Activations& a, int r0, float* out, int64_t ldo, bool acc) {
  if (w.format == kFormatQ41)
    group_pair_q4_1<R>(w, g, a, r0, out, ldo, acc);
  else
    group_pair_q8_0<R>(w, g, a, r0, out, ldo, acc);
}
#endif

// rows [0, rows) of group g (and g + 1 where `pair`, on the AVX-512 path) in tiles of kRowTile, then the rest
template <bool Pair>
void tiles_of_rows(const Packed& w, int g, const Activations& a, int rows, float* out, int64_t ldo, bool acc) {
#if defined(CLOVER_AVX512_VNNI)
  auto run = [&](auto tile, int r) {
    if constexpr (Pair) pair_rows<decltype(tile)::value>(w, g, a, r, out, ldo, acc);
    else group_rows<decltype(tile)::value>(w, g, a, r, out, ldo, acc);
  };
#else
  auto run = [&](auto tile, int r) { group_rows<decltype(tile)::value>(w, g, a, r, out, ldo, acc); };
#endif
  int r = 0;
  for (; r + kRowTile <= rows; r += kRowTile) run(std::integral_constant<int, kRowTile>{}, r);
  switch (rows - r) {
    case 7: run(std::integral_constant<int, 7>{}, r); break;
    case 6: run(std::integral_constant<int, 6>{}, r); break;
    case 5: run(std::integral_constant<int, 5>{}, r); break;
    case 4: run(std::integral_constant<int, 4>{}, r); break;
    case 3: run(std::integral_constant<int, 3>{}, r); break;
    case 2: run(std::integral_constant<int, 2>{}, r); break;
    case 1: run(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// every row over column groups [g0, g1): a group's blocks stay in L1 while the row tiles pass over them
void matmul_groups(const Packed& w, const Activations& a, int rows, float* out, int64_t ldo, bool acc, int g0, int g1) {
  int g = g0;
#if defined(CLOVER_AVX512_VNNI)
  if (rows >= 4)  // a lone row (a vanilla step) runs faster one group at a time (docs/results/trees-one-pass)
    for (; g + 2 <= g1; g += 2) tiles_of_rows<true>(w, g, a, rows, out, ldo, acc);
#endif
  for (; g < g1; ++g) tiles_of_rows<false>(w, g, a, rows, out, ldo, acc);
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

// the scores of 8 keys, each hsum(fma chain of q . k over d / 8 lanes) in the lane order hsum uses, so a key's
// score is the same bits wherever it sits in a block (and the 8 keys' loads and sums are shared)
inline __m256 dot8(const float* q, const float* const* k, int d) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int i = 0; i < d; i += 8) {
    const __m256 qi = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[j] + i), acc[j]);
  }
  // per key: b = lo half + hi half (l0+l4, l1+l5, l2+l6, l3+l7), then (b0 + b2) + (b1 + b3): hsum's order
  __m256 b[4];
  for (int j = 0; j < 4; ++j)
    b[j] = _mm256_add_ps(_mm256_permute2f128_ps(acc[j], acc[j + 4], 0x20), _mm256_permute2f128_ps(acc[j], acc[j + 4], 0x31));
  const __m256 c01 = _mm256_add_ps(_mm256_unpacklo_ps(b[0], b[1]), _mm256_unpackhi_ps(b[0], b[1]));
  const __m256 c23 = _mm256_add_ps(_mm256_unpacklo_ps(b[2], b[3]), _mm256_unpackhi_ps(b[2], b[3]));
  // c01 lanes: key0 (b0+b2), key1 (b0+b2), key0 (b1+b3), key1 (b1+b3); keys 4, 5 in the high half
  const __m256 x = _mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(1, 0, 1, 0));  // key0 x, key1 x, key2 x, key3 x
  const __m256 y = _mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(3, 2, 3, 2));  // key0 y, key1 y, key2 y, key3 y
  return _mm256_add_ps(x, y);
}

alignas(32) constexpr float kZeroKey[256] = {};  // the keys that pad a last block (their scores are masked)

// scores: scratch of at least count() rounded up to 8
void attend_row(const float* q, const KeySource& keys, int d, float scale, float* scores, float* out) {
  const int n = keys.count();
  if (n == 0) {  // the contract: a row that sees nothing returns zeros
    std::memset(out, 0, sizeof(float) * d);
    return;
  }
  const int padded = (n + 7) / 8 * 8;
  for (int i0 = 0; i0 < padded; i0 += 8) {
    const float* block[8];
    for (int j = 0; j < 8; ++j) block[j] = i0 + j < n ? keys.key(i0 + j) : kZeroKey;
    _mm256_storeu_ps(scores + i0, _mm256_mul_ps(dot8(q, block, d), _mm256_set1_ps(scale)));
  }
  for (int i = n; i < padded; ++i) scores[i] = -INFINITY;
  __m256 vmax = _mm256_set1_ps(-INFINITY);
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
  Packed qkv, o, gate_up, down;
  const float* attn_norm;
  const float* mlp_norm;
};

}  // namespace

extern "C" {

// What Python hands over (clover/kernels/cpu_target.py mirrors it with ctypes). Weight pointers stay owned by
// Python and must outlive the model. Matrices are in the repacked layout (Packed), the embedding in GGUF rows.
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
  const uint8_t* embedding;     // Q8_0 GGUF rows [vocab, hidden]
  const uint8_t* lm_head;       // [vocab, hidden] in lm_head_format, repacked
  int32_t lm_head_format;
  const float* final_norm;
  const float* rope_cos;        // [max_positions, head_dim / 2]
  const float* rope_sin;
  const CloverLayerDesc* layer; // layers target layers, then the Augmenting Block if has_augment
  int32_t has_augment;
  const uint8_t* feature_fuse;  // Q8_0 [hidden, hidden * num_features] repacked, or null
  int32_t num_features;
  const int32_t* feature_layers;  // the target layers whose inputs the Augmenting Block reads (fused)
};

}  // extern "C"

namespace {

struct Buffers {
  std::vector<float> x, attn_in, qkv, attn, gate_up, act, features, augment;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sums;
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
    lm_head_ = Packed{c_.lm_head, c_.lm_head_format, c_.vocab, c_.hidden};
    fuse_ = Packed{c_.feature_fuse, kFormatQ80, c_.hidden, c_.hidden * c_.num_features};
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
    pool_.pass(p.batch * p.tokens, [&] { run(p); });
  }

 private:
  void run(const Pass& p) {
    const int rows = p.batch * p.tokens;
    reserve(rows, p.cache_len + p.tokens);
    embed(p, rows);
    float* x = b_.x.data();
    for (int l = 0; l < c_.layers; ++l) {
      keep_feature(l, rows);
      layer(p, l, x, l, rows);
    }
    const int h = c_.hidden;
    Activations a = acts(h);
    each_row(rows, [&](int r) {
      rms_norm_row(x + int64_t(r) * h, c_.final_norm, h, c_.eps, b_.attn_in.data() + int64_t(r) * h);
      quantize_rows(b_.attn_in.data(), h, r, r + 1, a);
    });
    matmul(lm_head_, a, rows, p.logits, c_.vocab, false);
    if (c_.has_augment) {
      augment_input(rows);
      layer(p, c_.layers, b_.augment.data(), c_.layers, rows);
    }
    const float* h0 = c_.has_augment ? b_.augment.data() : x;
    std::memcpy(p.h0, h0, sizeof(float) * size_t(rows) * h);
  }

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
    const size_t tiled = size_t(rows + kRowTile - 1) / kRowTile * kRowTile;  // activations are stored in whole tiles
    grow(b_.q, tiled * kmax);
    grow(b_.d, tiled * kmax / kBlock);
    grow(b_.s, tiled * kmax / kBlock);
    grow(b_.sums, tiled * kmax / kBlock);
    grow(b_.scores, size_t(pool_.size()) * ((keys + 7) / 8 * 8));
    grow(b_.visible, size_t(pool_.size()) * keys);
  }

  Activations acts(int k) { return Activations{b_.q.data(), b_.d.data(), b_.s.data(), b_.sums.data(), k}; }

  // a per-row step, rows handed out to the pool's threads
  template <typename F>
  void each_row(int rows, const F& f) {
    pool_.parallel_for(rows, [&](int lo, int hi, int) { for (int r = lo; r < hi; ++r) f(r); });
  }

  // out[r, col] (+)= a[r] . w[col]: the pool's threads take column groups
  void matmul(const Packed& w, const Activations& a, int rows, float* out, int64_t ldo, bool accumulate) {
    pool_.parallel_for(w.groups(), [&](int g0, int g1, int) { matmul_groups(w, a, rows, out, ldo, accumulate, g0, g1); });
  }

  void embed(const Pass& p, int rows) {
    const int h = c_.hidden, nb = h / kBlock;
    each_row(rows, [&](int r) {
      const uint8_t* row = c_.embedding + p.ids[r] * int64_t(nb) * kQ80Bytes;
      float* x = b_.x.data() + int64_t(r) * h;
      for (int b = 0; b < nb; ++b) {
        const float d = f16(row + b * kQ80Bytes);
        const int8_t* q = reinterpret_cast<const int8_t*>(row + b * kQ80Bytes + 2);
        for (int i = 0; i < kBlock; ++i) x[b * kBlock + i] = d * static_cast<float>(q[i]);
      }
    });
  }

  // the Augmenting Block reads the input of the last target layer, or of several fused (docs/drafter.md)
  void keep_feature(int l, int rows) {
    if (!c_.has_augment) return;
    const int h = c_.hidden, n = std::max(1, c_.num_features);
    for (int f = 0; f < n; ++f) {
      const int wanted = c_.num_features ? features_[f] : c_.layers - 1;
      if (wanted != l) continue;
      for (int r = 0; r < rows; ++r)
        std::memcpy(b_.features.data() + (int64_t(r) * n + f) * h, b_.x.data() + int64_t(r) * h, sizeof(float) * h);
    }
  }

  void augment_input(int rows) {
    const int h = c_.hidden;
    if (!c_.num_features) {
      std::memcpy(b_.augment.data(), b_.features.data(), sizeof(float) * size_t(rows) * h);
      return;
    }
    const int k = h * c_.num_features;
    Activations a = acts(k);
    each_row(rows, [&](int r) { quantize_rows(b_.features.data(), k, r, r + 1, a); });
    matmul(fuse_, a, rows, b_.augment.data(), h, false);
  }

  // one decoder layer over the stream x [rows, hidden], its K/V into KV layer kv
  void layer(const Pass& p, int l, float* x, int kv, int rows) {
    const Layer& L = layers_[l];
    const int h = c_.hidden, width = c_.heads * c_.head_dim, inter = c_.intermediate;
    Activations a = acts(h);
    each_row(rows, [&](int r) {
      rms_norm_row(x + int64_t(r) * h, L.attn_norm, h, c_.eps, b_.attn_in.data() + int64_t(r) * h);
      quantize_rows(b_.attn_in.data(), h, r, r + 1, a);
    });
    matmul(L.qkv, a, rows, b_.qkv.data(), L.qkv.n, false);
    each_row(rows, [&](int r) { rope_and_store(p, kv, r); });
    attention(p, kv, rows, acts(width));
    matmul(L.o, acts(width), rows, x, h, true);
    each_row(rows, [&](int r) {
      rms_norm_row(x + int64_t(r) * h, L.mlp_norm, h, c_.eps, b_.attn_in.data() + int64_t(r) * h);
      quantize_rows(b_.attn_in.data(), h, r, r + 1, a);
    });
    matmul(L.gate_up, a, rows, b_.gate_up.data(), 2 * inter, false);
    Activations am = acts(inter);
    each_row(rows, [&](int r) {
      const float* gu = b_.gate_up.data() + int64_t(r) * 2 * inter;
      silu_mul_row(gu, gu + inter, inter, b_.act.data() + int64_t(r) * inter);
      quantize_rows(b_.act.data(), inter, r, r + 1, am);
    });
    matmul(L.down, am, rows, x, h, true);
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

  // items are (row, head) pairs; then each row is quantised for the output projection
  void attention(const Pass& p, int kv, int rows, const Activations& out) {
    const int d = c_.head_dim, group = c_.heads / c_.kv_heads, width = c_.heads * d;
    const int keys_cap = (p.cache_len + p.tokens + 7) / 8 * 8;
    pool_.parallel_for(rows * c_.heads, [&](int lo, int hi, int t) {
      float* scores = b_.scores.data() + int64_t(t) * keys_cap;
      int* visible = b_.visible.data() + int64_t(t) * (p.cache_len + p.tokens);
      for (int task = lo; task < hi; ++task) {
        const int r = task / c_.heads, head = task % c_.heads, b = r / p.tokens, hkv = head / group;
        const int past = p.past[b];
        KeySource keys{cache_row(p.k_cache, kv, b, hkv, 0, p.cache_len),
                       cache_row(p.v_cache, kv, b, hkv, 0, p.cache_len), d, past,
                       cache_row(p.k_cache, kv, b, hkv, past, p.cache_len),
                       cache_row(p.v_cache, kv, b, hkv, past, p.cache_len), d, visible, 0};
        keys.num_visible = visible_tokens(p.mask + int64_t(r) * p.words, p.tokens, visible);
        const float* q = b_.qkv.data() + int64_t(r) * (c_.heads + 2 * c_.kv_heads) * d + head * d;
        attend_row(q, keys, d, 1.0f / std::sqrt(static_cast<float>(d)), scores, b_.attn.data() + int64_t(r) * width + head * d);
      }
    });
    each_row(rows, [&](int r) { quantize_rows(b_.attn.data(), width, r, r + 1, out); });
  }

  CloverModelDesc c_;
  Pool pool_;
  std::vector<Layer> layers_;
  Packed lm_head_, fuse_;
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

// The linear alone (tests): out[rows, n] = int8(x) . w, w repacked, x fp32 [rows, k] quantised per row as in a pass.
void clover_linear(const uint8_t* w, int32_t format, int32_t n, int32_t k, const float* x, int32_t rows, float* out) {
  const size_t tiled = size_t(rows + kRowTile - 1) / kRowTile * kRowTile;
  std::vector<int8_t> q(tiled * k);
  std::vector<float> d(tiled * k / kBlock), s(tiled * k / kBlock);
  std::vector<int32_t> sums(tiled * k / kBlock);
  Activations a{q.data(), d.data(), s.data(), sums.data(), k};
  quantize_rows(x, k, 0, rows, a);
  const Packed packed{w, format, n, k};
  matmul_groups(packed, a, rows, out, n, false, 0, packed.groups());
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
