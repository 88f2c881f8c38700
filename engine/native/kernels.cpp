// Batch-invariant decode attention over the paged pool; a work item is one decode token's kv heads
// (all of them or one, see run_float; the float64 kernel takes one).
//
// A work item reads only its own token's query rows, its own pages and its own position, and sums
// in one fixed order: the dot products lane by lane (LANES partial sums over the head dim, or over
// its pairs of dims for bfloat16 pages, then a fixed pairwise tree), the softmax denominator and
// P @ V key by key from the window's first key to the token's position. Nothing in it depends on
// the other tokens of the call, on the thread that runs it or on the number of threads: its bits
// are those of the token computed alone.
// engine/native_kernels.py builds and loads this file; engine/invariant_attention.py calls it, and
// engine/models/norms.py's RMSNorm calls rms_norm below.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// One vector of 64 bytes: 16 floats or 8 doubles (GCC vector extensions: one AVX-512 register,
// two AVX2 ones; every lane's arithmetic is the same whatever the ISA picks).
template <typename acc_t> struct Vec;
template <> struct Vec<float> { typedef float type __attribute__((vector_size(64))); };
template <> struct Vec<double> { typedef double type __attribute__((vector_size(64))); };
template <typename acc_t> constexpr int64_t kLanes = 64 / sizeof(acc_t);

inline float widen(float value) { return value; }
inline double widen(double value) { return value; }
inline float widen(c10::BFloat16 value) { return static_cast<float>(value); }
inline float widen(c10::Half value) { return static_cast<float>(value); }

// Lanes [d, d + L) of a row of `dim`, zero past its end.
template <typename acc_t, typename kv_t>
inline typename Vec<acc_t>::type load(const kv_t* row, int64_t d, int64_t dim) {
  constexpr int64_t L = kLanes<acc_t>;
  typename Vec<acc_t>::type vector;
  if constexpr (std::is_same_v<acc_t, kv_t>) {
    if (d + L <= dim) {
      std::memcpy(&vector, row + d, sizeof(vector));
      return vector;
    }
  } else if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<kv_t, c10::BFloat16>) {
    if (d + L <= dim) {  // bfloat16 is float's upper 16 bits
      typedef uint16_t u16 __attribute__((vector_size(32)));
      typedef uint32_t u32 __attribute__((vector_size(64)));
      u16 bits;
      std::memcpy(&bits, row + d, sizeof(bits));
      const u32 wide = __builtin_convertvector(bits, u32) << 16;
      std::memcpy(&vector, &wide, sizeof(vector));
      return vector;
    }
  }
  for (int64_t l = 0; l < L; ++l) vector[l] = d + l < dim ? widen(row[d + l]) : acc_t(0);
  return vector;
}

// The lanes of `vector` summed as a fixed pairwise tree.
template <typename acc_t>
inline acc_t lane_sum(typename Vec<acc_t>::type vector) {
  constexpr int64_t L = kLanes<acc_t>;
  acc_t lanes[L];
  std::memcpy(lanes, &vector, sizeof(lanes));
  for (int64_t width = L / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

// Sixteen float vectors -> one vector whose lane j is the lane sum of vectors[j], each by the tree
// of lane_sum (lane l + lane l + 8, then + 4, + 2, + 1): four levels of pairwise combining, the
// lanes of each key kept apart, so no key's sum depends on the other fifteen.
typedef float f16 __attribute__((vector_size(64)));
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i16 __attribute__((vector_size(64)));

inline f16 combine8(f16 x, f16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline f16 combine4(f16 x, f16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline f16 combine2(f16 x, f16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline f16 combine1(f16 x, f16 y) {
  return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
inline f16 lane_sums_tree(const f16* v) {
  f16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = combine8(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = combine4(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = combine2(b[2 * i], b[2 * i + 1]);
  return combine1(c[0], c[1]);
}

// exp of each lane, x <= 0 (a score minus its row's maximum): Cephes' expf polynomial after
// x = n ln 2 + r; below -87.3 (past float's normal range) exactly 0, as exp's own result there
// would weigh nothing beside the maximum's 1.
template <typename V, typename I>
inline V exp_lanes(V x) {
  const V clamped = x < -87.3f ? V{} - 87.3f : x;
  V n = clamped * 1.44269504088896341f + 0.5f;
  const V truncated = __builtin_convertvector(__builtin_convertvector(n, I), V);
  n = truncated > n ? truncated - 1.0f : truncated;  // floor
  const V r = clamped - n * 0.693359375f - n * -2.12194440e-4f;
  V y = 1.9875691500e-4f * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const I exponent = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return x < -87.3f ? V{} : y * scale;
}
// Where a 64-byte vector is two AVX2 registers (no AVX-512), GCC lowers a scalar operand, a
// select (a < b ? x : y), a shuffle across the halves and a vector's store to memory lane by
// lane, through the stack; the forms below give each the halves' own instructions, with every
// lane's arithmetic unchanged (the same bits on every ISA). The decode kernel at bench peers'
// 64-beam step, 30 layers (AMD EPYC, AVX2): 94 ms before, 32 after. With AVX-512 they are the
// plain expressions.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kTwoRegisterVectors = true;
typedef int32_t i8 __attribute__((vector_size(32)));
inline f8 low_half(f16 x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7); }
inline f8 high_half(f16 x) { return __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15); }
inline f16 join(f8 low, f8 high) {
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
// x in every lane
inline f16 splat(float x) {
  const __m256 half = _mm256_set1_ps(x);
  f16 out;
  std::memcpy(&out, &half, sizeof(half));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(half), &half, sizeof(half));
  return out;
}
// *destination = v
inline void put(f16* destination, f16 v) {
  const f8 low = low_half(v), high = high_half(v);
  std::memcpy(destination, &low, sizeof(low));
  std::memcpy(reinterpret_cast<char*>(destination) + sizeof(low), &high, sizeof(high));
}
// Eight keys' vectors -> their lane_sum trees, key j in lane j: lane l + lane l + 8 (each key's
// halves), then + 4 (the 128-bit quarters of keys i and i + 4 side by side), + 2, + 1 (shuffles
// within the quarters), the keys landing in order.
inline f8 lane_sums8(const f16* v) {
  __m256 s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) {
    __m256 low, high;  // loaded as halves: a whole vector would pass through the stack
    std::memcpy(&low, &v[i], sizeof(low));
    std::memcpy(&high, reinterpret_cast<const char*>(&v[i]) + sizeof(low), sizeof(high));
    s8[i] = _mm256_add_ps(low, high);
  }
  for (int i = 0; i < 4; ++i) {
    s4[i] = _mm256_add_ps(_mm256_permute2f128_ps(s8[i], s8[i + 4], 0x20), _mm256_permute2f128_ps(s8[i], s8[i + 4], 0x31));
  }
  for (int i = 0; i < 2; ++i) {
    s2[i] = _mm256_add_ps(_mm256_shuffle_ps(s4[2 * i], s4[2 * i + 1], 0x44), _mm256_shuffle_ps(s4[2 * i], s4[2 * i + 1], 0xEE));
  }
  return (f8)_mm256_add_ps(_mm256_shuffle_ps(s2[0], s2[1], 0x88), _mm256_shuffle_ps(s2[0], s2[1], 0xDD));
}
inline f16 lane_sums16(const f16* v) { return join(lane_sums8(v), lane_sums8(v + 8)); }
inline f16 exp16(f16 x) { return join(exp_lanes<f8, i8>(low_half(x)), exp_lanes<f8, i8>(high_half(x))); }
// The larger of a and b lane by lane (a where neither is larger)
inline f16 lane_max(f16 a, f16 b) {
  const f8 al = low_half(a), bl = low_half(b), ah = high_half(a), bh = high_half(b);
  return join(bl > al ? bl : al, bh > ah ? bh : ah);
}
// x's lanes whose index plus `first` is below `count`, 0 in the others
inline f16 lanes_below(f16 x, int32_t first, int32_t count) {
  const i8 index = {0, 1, 2, 3, 4, 5, 6, 7};
  return join(index + first < count ? low_half(x) : f8{}, index + (first + 8) < count ? high_half(x) : f8{});
}
#else
constexpr bool kTwoRegisterVectors = false;
inline f16 splat(float x) { return x - f16{}; }  // x - (+0) is x, signed zeros included
inline void put(f16* destination, f16 v) { *destination = v; }
inline f16 lane_sums16(const f16* v) { return lane_sums_tree(v); }
inline f16 exp16(f16 x) { return exp_lanes<f16, i16>(x); }
inline f16 lane_max(f16 a, f16 b) { return b > a ? b : a; }
inline f16 lanes_below(f16 x, int32_t first, int32_t count) {
  const i16 index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return index + first < count ? x : f16{};
}
#endif

constexpr int64_t kMaxVectors = 32;  // head dims up to 512 floats

// body(begin, end) over items [0, num_items), one run of items per thread, the runs of about equal
// work (an item's keys, `work(item)`) rather than of equal count: a prompt's last tokens read many
// more keys than its first, and a batch's requests differ in length. Which thread runs an item
// never changes its bits.
template <typename Work, typename Body>
void parallel_by_work(int64_t num_items, const Work& work, const Body& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  if (threads <= 1) return body(0, num_items);
  std::vector<int64_t> bounds(threads + 1, num_items);
  bounds[0] = 0;
  int64_t total = 0;
  for (int64_t item = 0; item < num_items; ++item) total += work(item);
  int64_t running = 0;
  for (int64_t item = 0, t = 1; item < num_items && t < threads; ++item) {
    running += work(item);
    while (t < threads && running * threads >= total * t) bounds[t++] = item + 1;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) body(bounds[t], bounds[t + 1]);
  });
}

// The keys a token at `position` reads (all of them, or its window's)
inline int64_t first_key(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

// An item's work for parallel_by_work: the keys its token reads, plus `fixed` for its fixed costs
inline int64_t item_work(int64_t position, int64_t window, int64_t fixed) {
  return position - first_key(position, window) + 1 + fixed;
}

struct Layout {
  int64_t num_units, num_heads, num_kv_heads, head_dim, tokens_per_block;
  int64_t query_row_stride, output_row_stride, block_stride, max_pages;
  int64_t window;  // 0: none
  double scale;
};

// bfloat16 pages with AVX512-BF16 (and a head dim of whole 32-value vectors): a score's products
// are taken two dims at a time by one bfloat16 dot-product instruction (vdpbf16ps) on the pages'
// own bits, 16 lanes of dim pairs (2l, 2l + 1), (32 + 2l, 33 + 2l), ... summed in float32, then the
// lane tree; the scale multiplies the summed score. Each product of two bfloat16 values is exact in
// float32, so this is the float32 dot product in another (fixed) order, and it spares widening
// every key to float32 first: a layer's 16 requests 17.3 against 20.5 ms for 30 calls with the
// pool out of the caches (11.9 against 15.1 with it in). The queries are bfloat16 values (the
// model's dtype; a query that is not one is refused, as its pairs would round it).
typedef uint16_t bf32 __attribute__((vector_size(64)));  // 32 bfloat16 bit patterns
#if defined(__AVX512BF16__)
constexpr bool kBfloat16Pairs = true;
inline f16 dot_pairs(f16 sum, bf32 x, bf32 y) { return (f16)_mm512_dpbf16_ps((__m512)sum, (__m512bh)x, (__m512bh)y); }
inline bf32 bfloat16_pairs(const float* values) {
  f16 low, high;
  std::memcpy(&low, values, sizeof(low));
  std::memcpy(&high, values + 16, sizeof(high));
  const bf32 pairs = (bf32)_mm512_cvtne2ps_pbh((__m512)high, (__m512)low);
  f16 back_low = (f16)_mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)pairs));
  f16 back_high = (f16)_mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)pairs, 1));
  TORCH_CHECK(!_mm512_cmpneq_ps_mask((__m512)back_low, (__m512)low) && !_mm512_cmpneq_ps_mask((__m512)back_high, (__m512)high),
              "a bfloat16 pool's queries must be bfloat16 values");
  return pairs;
}
// 32 bfloat16 values -> the two float vectors of _mm512_unpacklo/hi_epi16 (see run_float's value_vectors)
inline void widen_pairs(const void* values, f16& low, f16& high) {
  const __m512i bits = _mm512_loadu_si512(values), zero = _mm512_setzero_si512();
  low = (f16)_mm512_unpacklo_epi16(zero, bits);
  high = (f16)_mm512_unpackhi_epi16(zero, bits);
}
#else
constexpr bool kBfloat16Pairs = false;
inline void widen_pairs(const void*, f16&, f16&) {}
inline f16 dot_pairs(f16 sum, bf32, bf32) { return sum; }
inline bf32 bfloat16_pairs(const float*) { return bf32{}; }
#endif

// Float compute (float, bfloat16 or half pages): keys in blocks of 16, whose 16 dot products are
// summed lane by lane and then by lane_sums16, one vector of scores a block; exp by exp16; the
// denominator in 16 lanes over the blocks, then their tree. Lanes past the last key are computed
// from a repeated key and set to 0 before they are summed: no visible key's result depends on them.
// NV: head_dim / 16 where the compiler knows it (the row's vectors then live in registers), 0 for
// any other head dim (zero-padded to whole vectors). An item takes all of its token's kv heads,
// key by key, so each key's (and value's) row is read as one run of heads * dim, not a head's
// slice of it each pass: with the pool out of the caches (a step's weights pass between layers)
// that read 16 requests' keys in 0.74 ms a layer against 0.83 (float32; 0.72 against 0.81
// bfloat16). Where the tokens are fewer than two per thread (a lone greedy request), an item is
// one (token, kv head) so that every thread has work. The sums are the same either way.
template <typename q_t, typename kv_t, int64_t NV>
void run_float(const q_t* query, const kv_t* kv, const int64_t* token_index, const int64_t* positions,
               const int64_t* block_table, q_t* output, const Layout& s) {
  constexpr int64_t L = 16;
  constexpr bool kPairs = kBfloat16Pairs && std::is_same_v<kv_t, c10::BFloat16> && NV % 2 == 0 && NV > 0;
  constexpr int64_t NP = kPairs ? NV / 2 : 1;  // a row's vectors of 32 bfloat16
  const int64_t group = s.num_heads / s.num_kv_heads, dim = NV > 0 ? NV * L : s.head_dim;
  const int64_t T = s.tokens_per_block, num_vectors = NV > 0 ? NV : (dim + L - 1) / L;
  // A row's lanes [v L, v L + L): whole vectors where NV says so, else zero past the row's end
  const auto row_vector = [dim](const auto* row, int64_t v) { return load<float>(row, v * L, NV > 0 ? (v + 1) * L : dim); };
  const int64_t row = s.num_kv_heads * dim;  // one token's keys (or values) in a block
  // A value row's vectors for P @ V. bfloat16 pairs: each 32 values widened by two unpacks (the
  // value in a float's upper half), which leaves the dims of a vector in the unpacks' order: lanes
  // [4c, 4c + 4) of vector 2p hold dims 32p + 8c + [0, 4), of vector 2p + 1 dims 32p + 8c + [4, 8).
  // Each dim's sum takes the same products in the same order, only in another lane; the output's
  // dims come back through value_lane. Half the instructions of widening 16 values at a time:
  // with the scores' pairs, 8.03-8.31 against 8.23-8.61 s for bench peers' 16 requests in process.
  const auto value_vectors = [&](const kv_t* value_row, f16* vectors) {
    if constexpr (kPairs) {
      for (int64_t p = 0; p < NP; ++p) {
        widen_pairs(value_row + 32 * p, vectors[2 * p], vectors[2 * p + 1]);
      }
    } else {
      for (int64_t v = 0; v < num_vectors; ++v) vectors[v] = row_vector(value_row, v);
    }
  };
  // The lane (vector * L + lane) of dim d in the sums value_vectors fed
  const auto value_lane = [](int64_t d) -> int64_t {
    if constexpr (kPairs) return d / 32 * 32 + (d % 8 >= 4) * L + d % 32 / 8 * 4 + d % 4;
    return d;
  };
  // A work item is one token's kv heads [h0, h0 + heads): all of them where the tokens give every
  // thread two or more (each key's row of all heads is then read as one run), else one head.
  const int64_t heads = s.num_units >= 2 * at::get_num_threads() ? s.num_kv_heads : 1;
  const int64_t items_per_unit = s.num_kv_heads / heads, rows = heads * group;
  const auto work = [&](int64_t item) { return item_work(positions[item / items_per_unit], s.window, L); };
  parallel_by_work(s.num_units * items_per_unit, work, [&](int64_t begin, int64_t end) {
    std::vector<f16> q(rows * num_vectors), acc(rows * num_vectors), partial(rows * L);
    std::vector<bf32> q_pairs(kPairs ? rows * NP : 0);
    f16 keys[kMaxVectors];
    std::vector<f16> weights;
    std::vector<float> totals(rows);
    std::vector<const kv_t*> key_rows;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t unit = item / items_per_unit, h0 = item % items_per_unit * heads;
      const int64_t position = positions[unit], token = token_index[unit];
      const int64_t first = first_key(position, s.window);
      const int64_t count = position - first + 1, num_blocks = (count + L - 1) / L;
      const int64_t* pages = block_table + unit * s.max_pages;
      const q_t* query_row = query + token * s.query_row_stride + h0 * group * dim;
      if constexpr (kPairs) {
        for (int64_t r = 0; r < rows * NP; ++r) {
          if constexpr (std::is_same_v<q_t, float>) {
            q_pairs[r] = bfloat16_pairs(query_row + r * 32);
          } else {
            std::memcpy(&q_pairs[r], query_row + r * 32, sizeof(bf32));
          }
        }
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t v = 0; v < num_vectors; ++v) {
            q[r * num_vectors + v] = row_vector(query_row + r * dim, v) * splat(static_cast<float>(s.scale));
          }
        }
      }
      weights.resize(rows * num_blocks);  // [head, block]: 16 keys' scores, then weights
      // Each key's row (from head h0), page by page (no division per key)
      key_rows.resize(count);
      for (int64_t j = 0, page = first / T, slot = first % T; j < count; ++j) {
        key_rows[j] = kv + pages[page] * s.block_stride + slot * row + h0 * dim;
        if (++slot == T) slot = 0, ++page;
      }
      for (int64_t b = 0; b < num_blocks; ++b) {
        for (int64_t jj = 0; jj < L; ++jj) {
          const kv_t* k = key_rows[std::min(b * L + jj, count - 1)];
          for (int64_t h = 0; h < heads; ++h) {
            if constexpr (kPairs) {
              bf32 key_pairs[NP];
              for (int64_t v = 0; v < NP; ++v) std::memcpy(&key_pairs[v], k + h * dim + v * 32, sizeof(bf32));
              for (int64_t g = 0; g < group; ++g) {
                const bf32* qg = q_pairs.data() + (h * group + g) * NP;
                f16 sum = dot_pairs(f16{}, qg[0], key_pairs[0]);
                for (int64_t v = 1; v < NP; ++v) sum = dot_pairs(sum, qg[v], key_pairs[v]);
                partial[(h * group + g) * L + jj] = sum;
              }
            } else {
              for (int64_t v = 0; v < num_vectors; ++v) keys[v] = row_vector(k + h * dim, v);
              for (int64_t g = 0; g < group; ++g) {
                const f16* qg = q.data() + (h * group + g) * num_vectors;
                f16 sum = qg[0] * keys[0];
                for (int64_t v = 1; v < num_vectors; ++v) sum += qg[v] * keys[v];
                put(&partial[(h * group + g) * L + jj], sum);
              }
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          put(&weights[r * num_blocks + b], lane_sums16(partial.data() + r * L));
          if constexpr (kPairs) weights[r * num_blocks + b] *= static_cast<float>(s.scale);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        f16* scores = weights.data() + r * num_blocks;
        f16 maximum = scores[0];  // lanes past the last key repeat it: never above the maximum
        for (int64_t b = 1; b < num_blocks; ++b) maximum = lane_max(maximum, scores[b]);
        float row_max = maximum[0];
        for (int64_t l = 1; l < L; ++l) row_max = std::max(row_max, maximum[l]);
        f16 denominator = {};
        for (int64_t b = 0; b < num_blocks; ++b) {
          const f16 value = exp16(scores[b] - splat(row_max));
          put(&scores[b], lanes_below(value, static_cast<int32_t>(b * L), static_cast<int32_t>(count)));
          denominator += scores[b];
        }
        totals[r] = lane_sum<float>(denominator);
      }
      // P @ V, key by key; then divided by the denominator (its lanes summed by the tree).
      std::fill(acc.begin(), acc.end(), f16{});
      const float* weight = reinterpret_cast<const float*>(weights.data());
      const int64_t weight_stride = num_blocks * L;
      // K keys' values at a time where the compiler knows the head dim (a head's sums then stay
      // in registers over the K); each sum still adds key after key.
      int64_t j = 0;
      if constexpr (NV > 0) {
        constexpr int64_t K = kTwoRegisterVectors ? 2 : 4;  // AVX2's 16 registers hold 2 (31.7 against 34.0 ms)
        for (; j + K <= count; j += K) {
          for (int64_t h = 0; h < heads; ++h) {
            f16 values[K][NV];
            for (int64_t k = 0; k < K; ++k) {
              value_vectors(key_rows[j + k] + T * row + h * dim, values[k]);
            }
            for (int64_t g = 0; g < group; ++g) {
              const float* w = weight + (h * group + g) * weight_stride + j;
              f16* out = acc.data() + (h * group + g) * NV;
              f16 sums[NV];
              for (int64_t v = 0; v < NV; ++v) sums[v] = out[v];
              for (int64_t k = 0; k < K; ++k) {
                const f16 wk = splat(w[k]);
                for (int64_t v = 0; v < NV; ++v) sums[v] += wk * values[k][v];
              }
              for (int64_t v = 0; v < NV; ++v) put(&out[v], sums[v]);
            }
          }
        }
      }
      for (; j < count; ++j) {
        for (int64_t h = 0; h < heads; ++h) {
          const kv_t* v_row = key_rows[j] + T * row + h * dim;
          value_vectors(v_row, keys);
          for (int64_t g = 0; g < group; ++g) {
            const f16 w = splat(weight[(h * group + g) * weight_stride + j]);
            f16* out = acc.data() + (h * group + g) * num_vectors;
            for (int64_t v = 0; v < num_vectors; ++v) put(&out[v], out[v] + w * keys[v]);
          }
        }
      }
      q_t* output_row = output + token * s.output_row_stride + h0 * group * dim;
      for (int64_t r = 0; r < rows; ++r) {  // a bfloat16 output rounds as torch's .to() does (to nearest even)
        for (int64_t d = 0; d < dim; ++d) {
          const int64_t lane = value_lane(d);
          output_row[r * dim + d] = q_t(acc[r * num_vectors + lane / L][lane % L] / totals[r]);
        }
      }
    }
  });
}

template <typename q_t, typename kv_t>
void dispatch_float(const q_t* query, const kv_t* kv, const int64_t* token_index, const int64_t* positions,
                    const int64_t* block_table, q_t* output, const Layout& s) {
  switch (s.head_dim) {
    case 64: return run_float<q_t, kv_t, 4>(query, kv, token_index, positions, block_table, output, s);
    case 128: return run_float<q_t, kv_t, 8>(query, kv, token_index, positions, block_table, output, s);
    case 256: return run_float<q_t, kv_t, 16>(query, kv, token_index, positions, block_table, output, s);
    default: return run_float<q_t, kv_t, 0>(query, kv, token_index, positions, block_table, output, s);
  }
}

template <typename acc_t, typename kv_t>
void run(const acc_t* query, const kv_t* kv, const int64_t* token_index, const int64_t* positions,
         const int64_t* block_table, acc_t* output, const Layout& s) {
  using vec = typename Vec<acc_t>::type;
  constexpr int64_t L = kLanes<acc_t>;
  const int64_t group = s.num_heads / s.num_kv_heads, dim = s.head_dim, T = s.tokens_per_block;
  const int64_t num_vectors = (dim + L - 1) / L;
  const int64_t row = s.num_kv_heads * dim;  // one token's keys (or values) in a block
  const auto work = [&](int64_t item) { return item_work(positions[item / s.num_kv_heads], s.window, L); };
  parallel_by_work(s.num_units * s.num_kv_heads, work, [&](int64_t begin, int64_t end) {
    std::vector<vec> q(group * num_vectors), acc(group * num_vectors), keys(num_vectors);
    std::vector<acc_t> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t unit = item / s.num_kv_heads, kv_head = item % s.num_kv_heads;
      const int64_t position = positions[unit], token = token_index[unit];
      const int64_t first = first_key(position, s.window);
      const int64_t count = position - first + 1;
      const int64_t* pages = block_table + unit * s.max_pages;
      const acc_t* query_row = query + token * s.query_row_stride + kv_head * group * dim;
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t v = 0; v < num_vectors; ++v) {
          q[g * num_vectors + v] = load<acc_t>(query_row + g * dim, v * L, dim) * static_cast<acc_t>(s.scale);
        }
      }
      scores.resize(group * count);
      // Scores: each (head, key) a dot product, lane by lane then a tree over the lanes.
      for (int64_t j = 0; j < count; ++j) {
        const int64_t key = first + j;
        const kv_t* k = kv + pages[key / T] * s.block_stride + (key % T) * row + kv_head * dim;
        for (int64_t v = 0; v < num_vectors; ++v) keys[v] = load<acc_t>(k, v * L, dim);
        for (int64_t g = 0; g < group; ++g) {
          const vec* qg = q.data() + g * num_vectors;
          vec sum = qg[0] * keys[0];
          for (int64_t v = 1; v < num_vectors; ++v) sum += qg[v] * keys[v];
          scores[g * count + j] = lane_sum<acc_t>(sum);
        }
      }
      // Softmax weights, key by key.
      for (int64_t g = 0; g < group; ++g) {
        acc_t* weights = scores.data() + g * count;
        acc_t maximum = -std::numeric_limits<acc_t>::infinity();
        for (int64_t j = 0; j < count; ++j) maximum = std::max(maximum, weights[j]);
        acc_t denominator = 0;
        for (int64_t j = 0; j < count; ++j) {
          weights[j] = std::exp(weights[j] - maximum);
          denominator += weights[j];
        }
        for (int64_t j = 0; j < count; ++j) weights[j] /= denominator;
      }
      // P @ V, key by key.
      std::fill(acc.begin(), acc.end(), vec{});
      for (int64_t j = 0; j < count; ++j) {
        const int64_t key = first + j;
        const kv_t* v_row = kv + pages[key / T] * s.block_stride + (T + key % T) * row + kv_head * dim;
        for (int64_t v = 0; v < num_vectors; ++v) keys[v] = load<acc_t>(v_row, v * L, dim);
        for (int64_t g = 0; g < group; ++g) {
          const acc_t weight = scores[g * count + j];
          vec* out = acc.data() + g * num_vectors;
          for (int64_t v = 0; v < num_vectors; ++v) out[v] += weight * keys[v];
        }
      }
      acc_t* output_row = output + token * s.output_row_stride + kv_head * group * dim;
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t d = 0; d < dim; ++d) output_row[g * dim + d] = acc[g * num_vectors + d / L][d % L];
      }
    }
  });
}

void decode_attention(const at::Tensor& query, const at::Tensor& kv_layer, const at::Tensor& token_index,
                      const at::Tensor& positions, const at::Tensor& block_table, double scale,
                      int64_t window, at::Tensor& output) {
  TORCH_CHECK(query.dim() == 3 && output.dim() == 3 && kv_layer.dim() == 5, "query [N, H, D], output [N, H, D], kv_layer [blocks, 2, T, Hkv, D]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "query rows must be contiguous");
  TORCH_CHECK(output.stride(2) == 1 && output.stride(1) == output.size(2), "output rows must be contiguous");
  TORCH_CHECK(output.scalar_type() == query.scalar_type() && output.size(1) == query.size(1) && output.size(2) == query.size(2), "output must match query");
  const int64_t T = kv_layer.size(2), num_kv_heads = kv_layer.size(3), dim = kv_layer.size(4);
  TORCH_CHECK(kv_layer.stride(4) == 1 && kv_layer.stride(3) == dim && kv_layer.stride(2) == num_kv_heads * dim && kv_layer.stride(1) == T * num_kv_heads * dim, "kv_layer's blocks must be contiguous");
  TORCH_CHECK(query.size(2) == dim && query.size(1) % num_kv_heads == 0, "query heads must be a multiple of kv heads of the same dim");
  for (const at::Tensor* index : {&token_index, &positions, &block_table}) {
    TORCH_CHECK(index->scalar_type() == at::kLong && index->is_contiguous(), "index tensors must be contiguous int64");
  }
  const int64_t num_units = token_index.size(0);
  TORCH_CHECK(positions.size(0) == num_units && block_table.dim() == 2 && block_table.size(0) == num_units, "one position and one block-table row per token");
  Layout layout{num_units, query.size(1), num_kv_heads, dim, T, query.stride(0), output.stride(0),
                kv_layer.stride(0), block_table.size(1), window, scale};
  if (num_units == 0) return;
  const int64_t* tokens = token_index.data_ptr<int64_t>();
  const int64_t* position_ptr = positions.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t num_rows = std::min(query.size(0), output.size(0));
  for (int64_t unit = 0; unit < num_units; ++unit) {
    TORCH_CHECK(0 <= tokens[unit] && tokens[unit] < num_rows, "token index ", tokens[unit], " out of range");
    TORCH_CHECK(0 <= position_ptr[unit] && position_ptr[unit] < layout.max_pages * T, "position ", position_ptr[unit], " past its block-table row");
    const int64_t last_page = position_ptr[unit] / T;
    for (int64_t page = 0; page <= last_page; ++page) {
      const int64_t block = table[unit * layout.max_pages + page];
      TORCH_CHECK(0 <= block && block < kv_layer.size(0), "block id ", block, " out of the pool");
    }
  }
  TORCH_CHECK(dim <= kMaxVectors * 16, "head dim ", dim, " above the decode kernel's ", kMaxVectors * 16);
  const auto kv_type = kv_layer.scalar_type();
  if (query.scalar_type() == at::kFloat && kv_type == at::kFloat) {
    dispatch_float(query.data_ptr<float>(), kv_layer.data_ptr<float>(), tokens, position_ptr, table, output.data_ptr<float>(), layout);
  } else if (query.scalar_type() == at::kFloat && kv_type == at::kBFloat16) {
    dispatch_float(query.data_ptr<float>(), kv_layer.data_ptr<c10::BFloat16>(), tokens, position_ptr, table, output.data_ptr<float>(), layout);
  } else if (query.scalar_type() == at::kBFloat16 && kv_type == at::kBFloat16) {  // computes in float32
    dispatch_float(query.data_ptr<c10::BFloat16>(), kv_layer.data_ptr<c10::BFloat16>(), tokens, position_ptr, table, output.data_ptr<c10::BFloat16>(), layout);
  } else if (query.scalar_type() == at::kFloat && kv_type == at::kHalf) {
    dispatch_float(query.data_ptr<float>(), kv_layer.data_ptr<c10::Half>(), tokens, position_ptr, table, output.data_ptr<float>(), layout);
  } else if (query.scalar_type() == at::kDouble && kv_type == at::kDouble) {
    run(query.data_ptr<double>(), kv_layer.data_ptr<double>(), tokens, position_ptr, table, output.data_ptr<double>(), layout);
  } else {
    TORCH_CHECK(false, "no decode kernel for query ", query.scalar_type(), " and kv ", kv_type);
  }
}

// RMSNorm over the last axis, as engine/models/norms.py's RMSNorm computes it: the row in
// float32, its mean square (16 lanes over the row, then lane_sum's tree), times 1 / sqrt(mean +
// eps), rounded to the row's dtype, then times the weight in that dtype. A row's bits are its own.
template <typename scalar_t>
void rms_norm_row(const scalar_t* row, const scalar_t* weight, scalar_t* out, int64_t width, double eps) {
  constexpr int64_t L = 16;
  f16 squares = {};
  for (int64_t d = 0; d < width; d += L) {
    const f16 x = load<float>(row, d, width);
    squares += x * x;
  }
  const float mean = lane_sum<float>(squares) / static_cast<float>(width);
  const float scale = 1.0f / std::sqrt(mean + static_cast<float>(eps));
  for (int64_t d = 0; d < width; ++d) {
    const scalar_t normalised = static_cast<scalar_t>(widen(row[d]) * scale);
    out[d] = static_cast<scalar_t>(widen(weight[d]) * widen(normalised));
  }
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* input, const scalar_t* weight, scalar_t* output, int64_t num_rows,
                   int64_t width, double eps) {
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(input + r * width, weight, output + r * width, width, eps);
  });
}

// The residual add before a norm, fused with it: sum = residual + delta (in float32, rounded to
// the dtype: torch's add), then the norm of sum, row by row. The same bits as the add and
// rms_norm apart, one call instead of two a norm (60 a decode step of a 30-layer model).
template <typename scalar_t>
void add_rms_norm_rows(const scalar_t* residual, const scalar_t* delta, const scalar_t* weight, scalar_t* sum,
                       scalar_t* output, int64_t num_rows, int64_t width, double eps) {
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t offset = r * width;
      for (int64_t d = 0; d < width; ++d) {
        sum[offset + d] = static_cast<scalar_t>(widen(residual[offset + d]) + widen(delta[offset + d]));
      }
      rms_norm_row(sum + offset, weight, output + offset, width, eps);
    }
  });
}

void check_norm_operands(const at::Tensor& input, const at::Tensor& weight) {
  TORCH_CHECK(input.is_contiguous() && input.dim() >= 1, "input must be contiguous");
  const int64_t width = input.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width && weight.is_contiguous(), "weight must be [", width, "]");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), "weight and input must share a dtype");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "no rms_norm kernel for ", input.scalar_type());
}

int64_t num_rows_of(const at::Tensor& input) {
  const int64_t width = input.size(-1);
  return width == 0 ? 0 : input.numel() / width;
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_norm_operands(input, weight);
  at::Tensor output = at::empty_like(input);
  const int64_t width = input.size(-1), num_rows = num_rows_of(input);
  if (input.scalar_type() == at::kFloat) {
    rms_norm_rows(input.data_ptr<float>(), weight.data_ptr<float>(), output.data_ptr<float>(), num_rows, width, eps);
  } else {
    rms_norm_rows(input.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                  output.data_ptr<c10::BFloat16>(), num_rows, width, eps);
  }
  return output;
}

// (residual + delta, rms_norm of it)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_norm_operands(residual, weight);
  TORCH_CHECK(delta.is_contiguous() && delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type(),
              "delta must be contiguous, of the residual's shape and dtype");
  at::Tensor sum = at::empty_like(residual), output = at::empty_like(residual);
  const int64_t width = residual.size(-1), num_rows = num_rows_of(residual);
  if (residual.scalar_type() == at::kFloat) {
    add_rms_norm_rows(residual.data_ptr<float>(), delta.data_ptr<float>(), weight.data_ptr<float>(),
                      sum.data_ptr<float>(), output.data_ptr<float>(), num_rows, width, eps);
  } else {
    add_rms_norm_rows(residual.data_ptr<c10::BFloat16>(), delta.data_ptr<c10::BFloat16>(),
                      weight.data_ptr<c10::BFloat16>(), sum.data_ptr<c10::BFloat16>(),
                      output.data_ptr<c10::BFloat16>(), num_rows, width, eps);
  }
  return {sum, output};
}

// A gated MLP's activation: silu(gate) * up from the fused gate_up projection's rows [N, 2 I]
// (gate the first I columns). silu is torch's own kernel (at::silu, so its bits are torch's);
// the product is taken in float32 and rounded to the dtype, as torch's mul does. One call for
// split, silu and mul.
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t width) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) == 2 * width,
              "gate_up must be [N, 2 x ", width, "] with contiguous rows");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
              "no silu_mul kernel for ", gate_up.scalar_type());
  const int64_t num_rows = gate_up.size(0), stride = gate_up.stride(0);
  at::Tensor output = at::silu(gate_up.narrow(1, 0, width)).contiguous();  // [N, I]
  const auto multiply = [&](auto* out, const auto* rows) {
    at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        using scalar_t = std::remove_pointer_t<decltype(out)>;
        const auto* up = rows + r * stride + width;
        scalar_t* o = out + r * width;
        for (int64_t d = 0; d < width; ++d) o[d] = static_cast<scalar_t>(widen(o[d]) * widen(up[d]));
      }
    });
  };
  if (gate_up.scalar_type() == at::kFloat) {
    multiply(output.data_ptr<float>(), gate_up.data_ptr<float>());
  } else {
    multiply(output.data_ptr<c10::BFloat16>(), gate_up.data_ptr<c10::BFloat16>());
  }
  return output;
}

// float lanes rounded to bfloat16 (to nearest, ties to even), kept widened (no NaN here: rotary
// tables are finite and so are the projections they multiply)
inline f16 round_bfloat16(f16 x) {
  i16 bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & ~0xFFFF;
  f16 rounded;
  std::memcpy(&rounded, &bits, sizeof(rounded));
  return rounded;
}

// x rounded to scalar_t, kept widened; a float product goes through memory (the empty asm), so the
// compiler cannot fuse it with the add that follows into one multiply-add of other bits.
template <typename scalar_t>
inline f16 rounded(f16 x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    asm("" : "+m"(x));
    return x;
  } else {
    return round_bfloat16(x);
  }
}

template <typename scalar_t>
inline void store(scalar_t* row, int64_t d, f16 lanes) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(row + d, &lanes, sizeof(lanes));
  } else {
    typedef uint16_t u16 __attribute__((vector_size(32)));
    i16 bits;
    std::memcpy(&bits, &lanes, sizeof(bits));
    const u16 halves = __builtin_convertvector(bits >> 16, u16);
    std::memcpy(row + d, &halves, sizeof(halves));
  }
}

// Rotary on the query and key heads of a fused projection's rows, the keys and values written to
// their slots in the pool, as decoder.apply_rotary_table and attention.write_kv do in torch ops:
// x cos + roll(x, D / 2) signed_sin, each product and the sum rounded to the dtype (the same
// bits). qkv [N, (H + 2 Hkv) D], rows contiguous; cos, signed_sin [N, D]; kv_layer [blocks, 2,
// T, Hkv, D]; slot_blocks, slot_offsets [N]. Returns the rotated queries [N, H, D].
template <typename scalar_t>
void rotary_write_rows(const scalar_t* qkv, int64_t qkv_stride, const scalar_t* cos, const scalar_t* sin,
                       scalar_t* kv, int64_t block_stride, int64_t T, const int64_t* blocks,
                       const int64_t* offsets, scalar_t* query_out, int64_t num_tokens, int64_t num_heads,
                       int64_t num_kv_heads, int64_t dim) {
  constexpr int64_t L = 16;
  const int64_t half = dim / 2, row = num_kv_heads * dim;
  at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* token = qkv + n * qkv_stride;
      scalar_t* keys = kv + blocks[n] * block_stride + offsets[n] * row;
      scalar_t* values = keys + T * row;
      for (int64_t head = 0; head < num_heads + num_kv_heads; ++head) {
        const scalar_t* x = token + head * dim;
        scalar_t* out = head < num_heads ? query_out + (n * num_heads + head) * dim : keys + (head - num_heads) * dim;
        for (int64_t d = 0; d < dim; d += L) {
          const int64_t partner = d < half ? d + half : d - half;
          const f16 c = load<float>(cos + n * dim, d, dim), s = load<float>(sin + n * dim, d, dim);
          const f16 lanes = rounded<scalar_t>(rounded<scalar_t>(load<float>(x, d, dim) * c) +
                                              rounded<scalar_t>(load<float>(x, partner, dim) * s));
          store(out, d, lanes);
        }
      }
      std::memcpy(values, token + (num_heads + num_kv_heads) * dim, row * sizeof(scalar_t));
    }
  });
}

at::Tensor rotary_write(const at::Tensor& qkv, int64_t num_heads, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& kv_layer, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  TORCH_CHECK(kv_layer.dim() == 5, "kv_layer [blocks, 2, T, Hkv, D]");
  const int64_t T = kv_layer.size(2), num_kv_heads = kv_layer.size(3), dim = kv_layer.size(4);
  TORCH_CHECK(kv_layer.stride(4) == 1 && kv_layer.stride(3) == dim && kv_layer.stride(2) == num_kv_heads * dim && kv_layer.stride(1) == T * num_kv_heads * dim, "kv_layer's blocks must be contiguous");
  TORCH_CHECK(dim % 32 == 0, "head dim ", dim, " is not a multiple of 32");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim, "qkv must be [N, (H + 2 Hkv) D] with contiguous rows");
  const int64_t num_tokens = qkv.size(0);
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->is_contiguous() && table->numel() == num_tokens * dim, "cos and sin must be [N, D], contiguous");
  }
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() && kv_layer.scalar_type() == qkv.scalar_type(), "qkv, cos, sin and kv_layer must share a dtype");
  for (const at::Tensor* index : {&slot_blocks, &slot_offsets}) {
    TORCH_CHECK(index->scalar_type() == at::kLong && index->is_contiguous() && index->numel() == num_tokens, "slot tensors must be [N] contiguous int64");
  }
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t n = 0; n < num_tokens; ++n) {
    TORCH_CHECK(0 <= blocks[n] && blocks[n] < kv_layer.size(0) && 0 <= offsets[n] && offsets[n] < T, "slot (", blocks[n], ", ", offsets[n], ") out of the pool");
  }
  at::Tensor query = at::empty({num_tokens, num_heads, dim}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rotary_write_rows(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), kv_layer.data_ptr<float>(), kv_layer.stride(0), T, blocks, offsets, query.data_ptr<float>(), num_tokens, num_heads, num_kv_heads, dim);
  } else if (qkv.scalar_type() == at::kBFloat16) {
    rotary_write_rows(qkv.data_ptr<c10::BFloat16>(), qkv.stride(0), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(), kv_layer.data_ptr<c10::BFloat16>(), kv_layer.stride(0), T, blocks, offsets, query.data_ptr<c10::BFloat16>(), num_tokens, num_heads, num_kv_heads, dim);
  } else {
    TORCH_CHECK(false, "no rotary_write kernel for ", qkv.scalar_type());
  }
  return query;
}

// ---- panel_linear: y = x @ W.T with W in 16-column panels, every output one fma chain over k ----
//
// The weight is held as panels [ceil(N / 16), K, 16]: panel p, row k holds W[16p .. 16p + 15, k]
// (zero past N). Every output y[m, n] is acc = fma(x[m, k], W[n, k], acc) for k = 0 .. K-1 from
// acc = 0, in that order: how rows are blocked, how panels are split between threads and how many
// rows there are change which outputs are computed together, never an output's bits. So a row's
// outputs do not depend on the batch (no check needed), and fusing layers (one panel set for
// q, k and v) gives each column the bits it has alone. A register tile is up to 6 rows x 16
// columns (12 accumulators, two 8-lane vectors a row; docs/engine.md, "Linear layers on AVX2").

constexpr int64_t kPanel = 16;      // columns per panel
constexpr int64_t kTileRows = 6;    // rows per register tile
constexpr int64_t kBlockRows = 48;  // rows per pass over a panel: their x rows stay in L2

#if defined(__AVX2__) && defined(__FMA__)
// The tile's accumulators are named variables: an array of them, GCC stored to the stack every k.
template <int R>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy) {
#define BEAMSPLIT_TILE_ROW(r)                                                   \
  __m256 acc##r##a = _mm256_setzero_ps(), acc##r##b = _mm256_setzero_ps();      \
  const float* x##r = x + (R > r ? r : 0) * ldx;
  BEAMSPLIT_TILE_ROW(0) BEAMSPLIT_TILE_ROW(1) BEAMSPLIT_TILE_ROW(2)
  BEAMSPLIT_TILE_ROW(3) BEAMSPLIT_TILE_ROW(4) BEAMSPLIT_TILE_ROW(5)
#undef BEAMSPLIT_TILE_ROW
  for (int64_t k = 0; k < K; ++k) {
    const __m256 low = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 high = _mm256_loadu_ps(panel + k * kPanel + 8);
#define BEAMSPLIT_TILE_FMA(r)                                   \
    if constexpr (R > r) {                                      \
      const __m256 a = _mm256_broadcast_ss(x##r + k);           \
      acc##r##a = _mm256_fmadd_ps(a, low, acc##r##a);           \
      acc##r##b = _mm256_fmadd_ps(a, high, acc##r##b);          \
    }
    BEAMSPLIT_TILE_FMA(0) BEAMSPLIT_TILE_FMA(1) BEAMSPLIT_TILE_FMA(2)
    BEAMSPLIT_TILE_FMA(3) BEAMSPLIT_TILE_FMA(4) BEAMSPLIT_TILE_FMA(5)
#undef BEAMSPLIT_TILE_FMA
  }
#define BEAMSPLIT_TILE_STORE(r)                                 \
  if constexpr (R > r) {                                        \
    _mm256_storeu_ps(y + r * ldy, acc##r##a);                   \
    _mm256_storeu_ps(y + r * ldy + 8, acc##r##b);               \
  }
  BEAMSPLIT_TILE_STORE(0) BEAMSPLIT_TILE_STORE(1) BEAMSPLIT_TILE_STORE(2)
  BEAMSPLIT_TILE_STORE(3) BEAMSPLIT_TILE_STORE(4) BEAMSPLIT_TILE_STORE(5)
#undef BEAMSPLIT_TILE_STORE
}
#else
// Without AVX2 and FMA: the same chains, one output at a time (std::fma rounds once, as the
// vector FMA does, so the bits are the same).
template <int R>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kPanel; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[r * ldx + k], panel[k * kPanel + c], acc);
      y[r * ldy + c] = acc;
    }
  }
}
#endif

// Rows [0, rows) of x against one panel, into y (ldy apart), in tiles of up to kTileRows.
inline void panel_rows(const float* x, int64_t K, int64_t rows, const float* panel, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kTileRows <= rows; m += kTileRows) panel_tile<6>(x + m * K, K, panel, K, y + m * ldy, ldy);
  const float* xm = x + m * K;
  float* ym = y + m * ldy;
  switch (rows - m) {
    case 5: panel_tile<5>(xm, K, panel, K, ym, ldy); break;
    case 4: panel_tile<4>(xm, K, panel, K, ym, ldy); break;
    case 3: panel_tile<3>(xm, K, panel, K, ym, ldy); break;
    case 2: panel_tile<2>(xm, K, panel, K, ym, ldy); break;
    case 1: panel_tile<1>(xm, K, panel, K, ym, ldy); break;
    default: break;
  }
}

// x [M, K] float32 (any row stride: made contiguous), panels [ceil(N / 16), K, 16] -> y [M, N].
at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat, "panel_linear takes [rows, in] float32");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() && panels.size(2) == kPanel, "panels must be [ceil(out / 16), in, 16] contiguous float32");
  TORCH_CHECK(panels.size(1) == input.size(1), "panels hold ", panels.size(1), " input features, the rows ", input.size(1));
  TORCH_CHECK(0 < out_features && out_features <= panels.size(0) * kPanel && out_features > (panels.size(0) - 1) * kPanel, "out_features ", out_features, " does not fit ", panels.size(0), " panels");
  const at::Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = panels.size(0);
  at::Tensor output = at::empty({M, N}, x.options());
  if (M == 0) return output;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = output.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tail;  // the last panel's outputs when N is not a multiple of 16
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * kPanel;
      const int64_t width = std::min(kPanel, N - p * kPanel);
      for (int64_t m0 = 0; m0 < M; m0 += kBlockRows) {
        const int64_t rows = std::min(kBlockRows, M - m0);
        if (width == kPanel) {
          panel_rows(xp + m0 * K, K, rows, panel, yp + m0 * N + p * kPanel, N);
          continue;
        }
        tail.resize(rows * kPanel);
        panel_rows(xp + m0 * K, K, rows, panel, tail.data(), kPanel);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(yp + (m0 + r) * N + p * kPanel, tail.data() + r * kPanel, width * sizeof(float));
      }
    }
  });
  return output;
}

}  // namespace

TORCH_LIBRARY(beamsplit, m) {
  m.def("decode_attention(Tensor query, Tensor kv_layer, Tensor token_index, Tensor positions, Tensor block_table, float scale, int window, Tensor(a!) output) -> ()");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("add_rms_norm(Tensor residual, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.def("silu_mul(Tensor gate_up, int width) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("rotary_write(Tensor qkv, int num_heads, Tensor cos, Tensor sin, Tensor(a!) kv_layer, Tensor slot_blocks, Tensor slot_offsets) -> Tensor");
  m.impl("rotary_write", c10::DispatchKey::CPU, TORCH_FN(rotary_write));
  m.def("panel_linear(Tensor input, Tensor panels, int out_features) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, TORCH_FN(panel_linear));
}
