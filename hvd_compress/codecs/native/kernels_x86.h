// The block kernels of kernels.h again, with x86's F16C conversions (vcvtps2ph / vcvtph2ps),
// for CPUs that have AVX2 and F16C (checked at run time: blocks.cpp falls back to kernels.h).
// Bit for bit the same results as kernels.h on every input (tests, and
// scripts/check_codecs_exhaustive.py on all 2**32 float32 inputs); only faster, because the
// hardware converts 8 values in one instruction and 8-bit codes need no table gather.
//
// float16: the hardware conversion IS the format's round-to-nearest-even, overflow to Inf.
// Its NaN differs from NumPy's only for signalling NaNs (it quiets them), so lanes holding a
// NaN take kernels.h's scalar path.
//
// E4M3 encode in three conversions, all exact or correctly rounded:
//   hz = half(y, toward zero), hu = half(|y|, up): hz | (hu - hz) is |y| rounded to float16
//   "to odd" (the last bit records whether anything was cut off), and rounding that to E4M3's
//   3 mantissa bits with round-to-nearest-even is then the correct rounding of y itself
//   (round-to-odd with >= 2 extra bits never double-rounds). Normal E4M3 codes are the half's
//   bits re-biased and rounded by integer arithmetic; E4M3's subnormals (|y| < 2**-6) are
//   half(|y| * 2**-15, nearest even), whose grid of 2**-24 is E4M3's 2**-9 scaled.
// E4M3 decode: the code's 7 bits shifted into a half's place read as |value| / 256 (E4M3's
//   subnormals land on half's subnormals), widened exactly by vcvtph2ps.
//
// Outputs larger than kStreamBytes are written with non-temporal stores (as glibc's memcpy
// does for large copies): a 64 MiB decode would otherwise read every output line into the cache
// before overwriting it. Gradient buckets (1 MiB) stay below it, in the cache for the next step.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>

#include "kernels.h"

namespace hvdc::x86 {

#define HVDC_X86 __attribute__((target("avx2,f16c")))

constexpr int64_t kStreamBytes = 8 << 20;
constexpr int64_t kChunk = 256;                      // values per pass through the L1 scratch

HVDC_X86 inline __m256 abs8(__m256 y) {
  return _mm256_and_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
}

// Eight E4M3 codes (in 16-bit lanes) for eight float32 values; kernels.h's E4M3::encode.
HVDC_X86 inline __m128i e4m3_encode8(__m256 y) {
  const __m256 a = abs8(y);
  const __m128i hz = _mm256_cvtps_ph(y, _MM_FROUND_TO_ZERO);          // sign kept
  const __m128i hu = _mm256_cvtps_ph(a, _MM_FROUND_TO_POS_INF);
  const __m128i habs = _mm_and_si128(hz, _mm_set1_epi16(0x7FFF));
  const __m128i h = _mm_or_si128(habs, _mm_sub_epi16(hu, habs));      // round to odd
  // normal: re-bias (half exponent 15 -> E4M3 exponent 7) and round 7 bits to nearest even
  const __m128i lsb = _mm_and_si128(_mm_srli_epi16(h, 7), _mm_set1_epi16(1));
  __m128i q = _mm_add_epi16(_mm_sub_epi16(h, _mm_set1_epi16(0x2000)), _mm_set1_epi16(0x3F));
  q = _mm_srli_epi16(_mm_add_epi16(q, lsb), 7);
  q = _mm_min_epu16(q, _mm_set1_epi16(0x7E));                        // saturate, Inf too
  // subnormal (|y| < 2**-6): round(|y| * 2**9), via the half subnormal grid. Scaled gradients
  // rarely land there (< 2**-6 / 448 of their block's largest), so test before converting.
  const __m128i small = _mm_cmplt_epi16(habs, _mm_set1_epi16(0x2400));
  if (_mm_movemask_epi8(small)) {
    const __m128i sub = _mm256_cvtps_ph(_mm256_mul_ps(a, _mm256_set1_ps(0x1p-15f)),
                                        _MM_FROUND_TO_NEAREST_INT);
    q = _mm_blendv_epi8(q, sub, small);
  }
  const __m128i nan = _mm_cmpgt_epi16(habs, _mm_set1_epi16(0x7C00));
  if (_mm_movemask_epi8(nan)) q = _mm_blendv_epi8(q, _mm_set1_epi16(0x7F), nan);
  return _mm_or_si128(q, _mm_srli_epi16(_mm_and_si128(hz, _mm_set1_epi16(-0x8000)), 8));
}

// Eight float16 codes for eight float32 values; kernels.h's FP16::encode.
HVDC_X86 inline __m128i fp16_encode8(__m256 y, const float* src) {
  __m128i h = _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT);
  if (_mm256_movemask_ps(_mm256_cmp_ps(y, y, _CMP_UNORD_Q))) {      // a NaN: NumPy's payload
    alignas(16) int16_t c[8];
    _mm_store_si128((__m128i*)c, h);
    for (int k = 0; k < 8; ++k)
      if (src[k] != src[k]) c[k] = FP16::encode(src[k]);
    h = _mm_load_si128((const __m128i*)c);
  }
  return h;
}

template <typename F>
HVDC_X86 inline void encode_chunk(const float* __restrict x, typename F::code_t* __restrict c,
                                  int64_t len, float s, bool stream) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  if constexpr (std::is_same_v<F, E4M3>) {
    for (; i + 16 <= len; i += 16) {
      _mm_prefetch((const char*)(x + i + kChunk), _MM_HINT_T0);   // the next block's amax pass
      const __m128i lo = e4m3_encode8(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
      const __m128i hi = e4m3_encode8(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vs));
      const __m128i bytes = _mm_packus_epi16(lo, hi);
      if (stream && ((uintptr_t)(c + i) & 15) == 0) _mm_stream_si128((__m128i*)(c + i), bytes);
      else _mm_storeu_si128((__m128i*)(c + i), bytes);
    }
  } else {
    alignas(32) float y[8];
    for (; i + 8 <= len; i += 8) {
      if ((i & 15) == 0) _mm_prefetch((const char*)(x + i + kChunk), _MM_HINT_T0);
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vs);
      _mm256_store_ps(y, v);
      const __m128i h = fp16_encode8(v, y);
      if (stream && ((uintptr_t)(c + i) & 15) == 0) _mm_stream_si128((__m128i*)(c + i), h);
      else _mm_storeu_si128((__m128i*)(c + i), h);
    }
  }
  for (; i < len; ++i) c[i] = F::encode(x[i] * s);
}

// kernels.h's encode_blocks: per block, the finite amax and whether it holds +-Inf, then the
// codes of x * s, chunk by chunk while the block is in the cache.
template <typename F>
HVDC_X86 void encode_blocks(const float* __restrict xp, typename F::code_t* __restrict cp,
                            float* __restrict sp, int64_t n, int64_t block, int64_t b0, int64_t b1) {
  const bool stream = n * (int64_t)sizeof(typename F::code_t) >= kStreamBytes;
  const __m256i inf = _mm256_set1_epi32((int)kInf);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    __m256i vmax = _mm256_setzero_si256(), vinf = _mm256_setzero_si256();
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
      const __m256i a = _mm256_castps_si256(abs8(_mm256_loadu_ps(xp + i)));
      const __m256i finite = _mm256_cmpgt_epi32(inf, a);
      vmax = _mm256_max_epi32(vmax, _mm256_and_si256(a, finite));
      vinf = _mm256_or_si256(vinf, _mm256_cmpeq_epi32(a, inf));
    }
    alignas(32) int32_t m[8], f[8];
    _mm256_store_si256((__m256i*)m, vmax);
    _mm256_store_si256((__m256i*)f, vinf);
    int32_t amax = 0, has_inf = 0;
    for (int k = 0; k < 8; ++k) { amax = amax > m[k] ? amax : m[k]; has_inf |= f[k]; }
    for (; i < hi; ++i) {
      const int32_t a = (int32_t)(bits_of(xp[i]) & kAbs);
      const int32_t finite = a < (int32_t)kInf ? a : 0;
      amax = amax > finite ? amax : finite;
      has_inf |= (int32_t)(a == (int32_t)kInf);
    }
    const bool inf_at_max = !F::has_inf && has_inf;
    const float s = pow2_scale(float_of((uint32_t)amax), inf_at_max ? F::max_finite / 2 : F::max_finite);
    for (int64_t c = lo; c < hi; c += kChunk)
      encode_chunk<F>(xp + c, cp + c, (hi - c < kChunk ? hi - c : kChunk), s, stream);
    sp[b] = inf_at_max ? -s : s;
  }
  if (stream) _mm_sfence();
}

// The plain codec (no scale) on [lo, hi): what check_codecs_exhaustive.py runs on all inputs.
template <typename F>
HVDC_X86 void encode_values(const float* __restrict xp, typename F::code_t* __restrict cp,
                            int64_t lo, int64_t hi) {
  // x * 1.0 would quiet a signalling NaN; the chunk kernel multiplies, so call the lanes here
  int64_t i = lo;
  if constexpr (std::is_same_v<F, E4M3>) {
    for (; i + 16 <= hi; i += 16) {
      const __m128i bytes = _mm_packus_epi16(e4m3_encode8(_mm256_loadu_ps(xp + i)),
                                             e4m3_encode8(_mm256_loadu_ps(xp + i + 8)));
      _mm_storeu_si128((__m128i*)(cp + i), bytes);
    }
  } else {
    for (; i + 8 <= hi; i += 8)
      _mm_storeu_si128((__m128i*)(cp + i), fp16_encode8(_mm256_loadu_ps(xp + i), xp + i));
  }
  for (; i < hi; ++i) cp[i] = F::encode(xp[i]);
}

// Eight values of eight codes, exactly (|value| / 256 for E4M3: the caller scales by 256).
template <typename F>
HVDC_X86 inline __m256 decode8(const typename F::code_t* c) {
  if constexpr (std::is_same_v<F, E4M3>) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)c));
    const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7F));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    __m256 v = _mm256_cvtph_ps(h);
    const __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F));
    if (_mm_movemask_epi8(nan)) {                    // E4M3's NaN: kernels.h's quiet 0x7FF00000
      const __m256 q = _mm256_castsi256_ps(_mm256_or_si256(
          _mm256_set1_epi32(0x7FF00000), _mm256_and_si256(_mm256_castps_si256(v),
                                                          _mm256_set1_epi32((int)0x80000000u))));
      v = _mm256_blendv_ps(v, q, _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
    }
    return v;
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)c));
  }
}

// kernels.h's decode_blocks: per chunk of a block, every rank's codes decoded, scaled by
// 1/|s_r| and summed in rank order in an L1 scratch, then divided by `divisor` (if not 1) and
// written out once. Blocks whose scale is negative (E4M3's +-Inf at the max code) go to
// kernels.h's scalar loop, which knows that rule.
template <typename F>
HVDC_X86 void decode_blocks(const typename F::code_t* __restrict cp, int64_t cstride,
                            const float* __restrict sp, int64_t sstride, int64_t ranks,
                            float* __restrict op, int64_t n, int64_t block, int64_t b0, int64_t b1,
                            float divisor) {
  constexpr bool k8 = std::is_same_v<F, E4M3>;
  const bool stream = n * 4 >= kStreamBytes;
  alignas(32) float acc[kChunk];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    bool plain = true;
    for (int64_t r = 0; r < ranks; ++r) plain &= !(sp[r * sstride + b] < 0);
    if (!plain) {                                    // rare: a block that held +-Inf
      hvdc::decode_blocks<F>(cp, cstride, sp, sstride, ranks, op, n, block, b, b + 1);
      if (divisor != 1.0f) for (int64_t i = lo; i < hi; ++i) op[i] = op[i] / divisor;
      continue;
    }
    for (int64_t c = lo; c < hi; c += kChunk) {
      const int64_t len = hi - c < kChunk ? hi - c : kChunk, vlen = len & ~(int64_t)7;
      for (int64_t r = 0; r < ranks; ++r) {
        const typename F::code_t* __restrict code = cp + r * cstride + c;
        const float inv = 1.0f / std::fabs(sp[r * sstride + b]);
        // E4M3: (|v| / 256) * (256 / |s|) is one rounding of v / |s|, as kernels.h's v * inv,
        // unless 256 / |s| overflows; then two exact-or-rounded-once steps of the same product
        const bool one_step = !k8 || inv <= 0x1p119f;
        const __m256 k1 = _mm256_set1_ps(k8 ? (one_step ? inv * 256.0f : 256.0f) : inv);
        const __m256 k2 = _mm256_set1_ps(inv);
        for (int64_t i = 0; i < vlen; i += 8) {
          __m256 w = _mm256_mul_ps(decode8<F>(code + i), k1);
          if (!one_step) w = _mm256_mul_ps(w, k2);
          _mm256_store_ps(acc + i, r == 0 ? w : _mm256_add_ps(_mm256_load_ps(acc + i), w));
        }
        for (int64_t i = vlen; i < len; ++i) {
          const float w = value<F>(code[i]) * inv;
          acc[i] = r == 0 ? w : acc[i] + w;
        }
      }
      float* __restrict out = op + c;
      const __m256 d = _mm256_set1_ps(divisor);
      const bool divide = divisor != 1.0f, aligned = ((uintptr_t)out & 31) == 0;
      for (int64_t i = 0; i < vlen; i += 8) {
        __m256 v = _mm256_load_ps(acc + i);
        if (divide) v = _mm256_div_ps(v, d);
        if (stream && aligned) _mm256_stream_ps(out + i, v);
        else _mm256_storeu_ps(out + i, v);
      }
      for (int64_t i = vlen; i < len; ++i) out[i] = divide ? acc[i] / divisor : acc[i];
    }
  }
  if (stream) _mm_sfence();
}

#undef HVDC_X86

}  // namespace hvdc::x86
#endif
