// The block kernels of blocks.cpp as plain C++ (no torch): formats, encode, decode, and the
// loops over a range of blocks. Bit for bit the algorithm of codecs/blocks.py's torch path.
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace hvdc {

inline constexpr uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }
inline constexpr float float_of(uint32_t u) { return std::bit_cast<float>(u); }
constexpr uint32_t kAbs = 0x7FFFFFFFu, kInf = 0x7F800000u;

// One format, every constant derived from its fields as codecs/formats.FloatFormat does:
// 1 sign bit, kBits - 1 - kMan exponent bits, kMan mantissa bits, bias kBias; kHasInf: the
// all-ones exponent is Inf/NaN (IEEE: float16), else only S.1..1.1..1 is NaN (E4M3).
template <int kBits, int kMan, int kBias, bool kHasInf>
struct Format {
  using code_t = std::conditional_t<kBits == 8, uint8_t, int16_t>;
  static constexpr bool has_inf = kHasInf;
  static constexpr int shift = 23 - kMan;                          // float32 bits dropped
  static constexpr uint32_t sign_bit = 1u << (kBits - 1), code_mask = 2 * sign_bit - 1;
  static constexpr uint32_t man_mask = (1u << kMan) - 1, exp_all = (sign_bit - 1) >> kMan;
  static constexpr uint32_t inf_code = exp_all << kMan, nan_code = sign_bit - 1;
  static constexpr uint32_t max_code = kHasInf ? inf_code - 1 : nan_code - 1;
  static constexpr float max_finite =
      float_of((((max_code >> kMan) + 127 - kBias) << 23) | ((max_code & man_mask) << shift));
  static constexpr float min_subnormal = float_of((uint32_t)(127 + 1 - kBias - kMan) << 23);
  // float32 biased exponents: the smallest normal binade of the format, and the first binade
  // wholly past its largest finite value
  static constexpr int32_t e_min = 127 + 1 - kBias;
  static constexpr int32_t e_over = e_min + (int32_t)(kHasInf ? exp_all - 1 : exp_all);
  // finite overflow (and Inf): E4M3 saturates to the max code, float16 goes to Inf
  static constexpr int32_t overflow = (int32_t)(kHasInf ? inf_code : max_code);

  // Round |y| to the format's grid with the FPU: adding c = 2**(e + shift) (e = |y|'s binade,
  // at least the smallest normal one) leaves exactly the bits the format keeps, rounded to
  // nearest even; the code is then the sum's bits minus c's, plus the binade's code offset.
  // Below the normal range c is the fixed MAGIC of fp8_numpy (the subnormal grid), and a
  // mantissa that rounds up carries into the next binade, as it must. Past the range, the
  // exponent is held at e_over so the sum cannot overflow, and the code clamps to `overflow`.
  static inline code_t encode(float y) {
    const int32_t u = (int32_t)bits_of(y), a = u & (int32_t)kAbs;
    int32_t e = a >> 23;
    e = e > e_min ? e : e_min;
    e = e < e_over ? e : e_over;
    const int32_t c = (e + shift) << 23;
    int32_t q = (int32_t)bits_of(float_of((uint32_t)a) + float_of((uint32_t)c)) - c + ((e - e_min) << kMan);
    q = q < overflow ? q : overflow;
    int32_t nan = (int32_t)nan_code;                     // E4M3: S.1111.111, as torch
    if constexpr (kHasInf) {                             // float16: NumPy keeps the payload
      nan = (a >> shift) & (int32_t)man_mask;
      nan = (nan > 1 ? nan : 1) | (int32_t)inf_code;
    }
    q = a > (int32_t)kInf ? nan : q;
    return (code_t)(q | ((u >> (32 - kBits)) & (int32_t)sign_bit));
  }

  // The exact widening (fp8_numpy.decode_bits / fp16_numpy.decode_bits): E4M3's NaN comes back
  // quiet (0x7FF00000, as torch), float16's NaN payload unquieted (as NumPy).
  static constexpr float decode(code_t code) {
    const uint32_t h = (uint32_t)code & code_mask, e = (h >> kMan) & exp_all, m = h & man_mask;
    const float sub = (float)(int32_t)m * min_subnormal;
    const bool special = kHasInf ? e == exp_all : (h & nan_code) == nan_code;
    uint32_t v = e != 0 ? ((e + 127 - kBias) << 23) | (m << shift) : bits_of(sub);
    v = special ? kInf | (m << shift) | (kHasInf || m == 0 ? 0u : 0x400000u) : v;
    return float_of(v | ((h & sign_bit) << (32 - kBits)));
  }
};

using E4M3 = Format<8, 3, 7, false>;      // OCP float8 e4m3fn, saturating (torch's cast)
using FP16 = Format<16, 10, 15, true>;    // IEEE float16, as NumPy's astype

template <typename F>
constexpr std::array<float, 256> table8() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) t[c] = F::decode((typename F::code_t)c);
  return t;
}
// 8-bit codes decode faster by a 256-entry table than by arithmetic (1 KiB, stays in L1)
inline constexpr std::array<float, 256> kE4M3Table = table8<E4M3>();

template <typename F>
inline float value(typename F::code_t c) {
  if constexpr (sizeof(typename F::code_t) == 1) return kE4M3Table[c];
  else return F::decode(c);
}

// Largest power of two s with amax * s <= target, clamped to 2**[-126, 127]; 1 for amax 0.
// The same frexp arithmetic as codecs/scaling.pow2_scale.
inline float pow2_scale(float amax, float target) {
  if (!(amax > 0.0f)) return 1.0f;
  int ea, et;
  const float ma = std::frexp(amax, &ea), mt = std::frexp(target, &et);
  int k = et - ea - (ma > mt ? 1 : 0);
  k = k < -126 ? -126 : (k > 127 ? 127 : k);
  return std::ldexp(1.0f, k);
}

// Blocks [b0, b1) of `block` values (the last one of n may be shorter): one pass for the
// finite amax and whether the block holds +-Inf, one pass that scales, rounds and packs while
// the block is in cache. A negative scale marks a block whose max code means +-Inf.
template <typename F>
inline void encode_blocks(const float* __restrict xp, typename F::code_t* __restrict cp,
                          float* __restrict sp, int64_t n, int64_t block, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    int32_t amax = 0, inf = 0;                           // finite amax, as magnitude bits
    for (int64_t i = lo; i < hi; ++i) {
      const int32_t a = (int32_t)(bits_of(xp[i]) & kAbs);
      const int32_t finite = a < (int32_t)kInf ? a : 0;
      amax = amax > finite ? amax : finite;
      inf |= (int32_t)(a == (int32_t)kInf);
    }
    const bool inf_at_max = !F::has_inf && inf;
    const float s = pow2_scale(float_of((uint32_t)amax), inf_at_max ? F::max_finite / 2 : F::max_finite);
    for (int64_t i = lo; i < hi; ++i) cp[i] = F::encode(xp[i] * s);
    sp[b] = inf_at_max ? -s : s;
  }
}

// The plain codec, no scale: what scripts/check_codecs_exhaustive.py runs on all 2**32 inputs.
template <typename F>
inline void encode_values(const float* __restrict xp, typename F::code_t* __restrict cp, int64_t lo,
                          int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) cp[i] = F::encode(xp[i]);
}

// out[i] = sum over ranks r in order of value(codes[r][i]) / |s_r|, the max code of a block
// with s_r < 0 read as +-Inf. `first`: out is overwritten by rank 0, not added to.
template <typename F>
inline void decode_blocks(const typename F::code_t* __restrict cp, int64_t cstride,
                          const float* __restrict sp, int64_t sstride, int64_t ranks,
                          float* __restrict op, int64_t n, int64_t block, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    for (int64_t r = 0; r < ranks; ++r) {
      const typename F::code_t* __restrict c = cp + r * cstride;
      const float s = sp[r * sstride + b], inv = 1.0f / std::fabs(s);
      if (!F::has_inf && s < 0) {                        // this block's max code means +-Inf
        for (int64_t i = lo; i < hi; ++i) {
          const uint32_t h = (uint32_t)c[i] & F::code_mask;
          float w = value<F>(c[i]) * inv;
          if ((h & (F::sign_bit - 1)) == F::max_code) w = (h & F::sign_bit) ? -INFINITY : INFINITY;
          op[i] = r == 0 ? w : op[i] + w;
        }
      } else if (r == 0) {
        for (int64_t i = lo; i < hi; ++i) op[i] = value<F>(c[i]) * inv;
      } else {
        for (int64_t i = lo; i < hi; ++i) op[i] = op[i] + value<F>(c[i]) * inv;
      }
    }
  }
}

}  // namespace hvdc
