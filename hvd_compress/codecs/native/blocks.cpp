// Block-scaled E4M3 / float16 codes, fused: the course's optional task (compression in C++).
//
// encode: per block of `block` values, one pass for the block's finite amax (and whether it
// holds +-Inf), then one pass that scales, rounds and packs while the block is in cache.
// decode_accumulate: one pass over the output; for each block, every rank's codes are
// decoded, unscaled and summed in rank order.
//
// Bit for bit the algorithm of codecs/fp8_numpy.py and fp16_numpy.py (read their docstrings):
// integer operations on the float32 bits, written without branches so that GCC vectorises
// the loops, twice: for AVX2 where the CPU has it and for baseline x86-64, picked at run time
// (no -march=native: the library must run on whichever x86-64 runs the tests). Compiled with
// -ffp-contract=off: a fused multiply-add would round once where the reference rounds twice;
// -fno-trapping-math only lets GCC evaluate both sides of a select (it changes no rounding). Threads come from torch's pool (at::parallel_for),
// so torch.set_num_threads() governs them, as it governs the pure-torch path.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>

namespace {

inline uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }
inline float float_of(uint32_t u) { return std::bit_cast<float>(u); }
// All-ones when c holds, else zero: selects without branches, which GCC vectorises.
inline uint32_t mask(bool c) { return -(uint32_t)c; }
inline uint32_t pick(bool c, uint32_t a, uint32_t b) { return (a & mask(c)) | (b & ~mask(c)); }

constexpr uint32_t kAbs = 0x7FFFFFFFu, kInf = 0x7F800000u;

struct E4M3 {                     // OCP float8 e4m3fn, saturating (torch's cast)
  using code_t = uint8_t;
  static constexpr float max_finite = 448.0f;
  static constexpr bool has_inf = false;
  static constexpr uint32_t max_code = 0x7E, sign_bit = 0x80;
  static inline code_t encode(float y) {
    const int32_t u = (int32_t)bits_of(y), a = u & (int32_t)kAbs;
    int32_t q = (a + (int32_t)(((7 - 127) << 23) + (1 << 19) - 1) + ((a >> 20) & 1)) >> 20;
    const int32_t sub = (int32_t)bits_of(float_of((uint32_t)a) + 16384.0f) - 0x46800000;
    q = (int32_t)pick(a < 0x3C800000, sub, q);            // below 2**-6: subnormal grid
    q = (int32_t)pick(q < 0x7E, q, 0x7E);                 // overflow and Inf saturate
    q = (int32_t)pick(a > (int32_t)kInf, 0x7F, q);        // NaN
    return (code_t)(q | ((u >> 24) & 0x80));
  }
  static inline float decode(code_t c) {
    const uint32_t s = (uint32_t)(c & 0x80) << 24, e = (c >> 3) & 0xF, m = c & 7;
    const float sub = (float)(int32_t)m * 0.001953125f;     // m * 2**-9
    uint32_t v = pick(e != 0, ((e + 120) << 23) | (m << 20), bits_of(sub));
    v = pick((c & 0x7F) == 0x7F, 0x7FF00000u, v);          // NaN, as the reference table
    return float_of(v | s);
  }
};

struct FP16 {                     // IEEE float16, as NumPy's astype (NaN payloads included)
  using code_t = int16_t;
  static constexpr float max_finite = 65504.0f;
  static constexpr bool has_inf = true;
  static constexpr uint32_t max_code = 0x7BFF, sign_bit = 0x8000;
  static inline code_t encode(float y) {
    const int32_t u = (int32_t)bits_of(y), a = u & (int32_t)kAbs;
    int32_t q = (a + (int32_t)(((15 - 127) << 23) + (1 << 12) - 1) + ((a >> 13) & 1)) >> 13;
    const int32_t sub = (int32_t)bits_of(float_of((uint32_t)a) + 0.5f) - 0x3F000000;
    q = (int32_t)pick(a < 0x38800000, sub, q);            // below 2**-14: subnormal grid
    q = (int32_t)pick(q < 0x7C00, q, 0x7C00);             // overflow -> Inf
    int32_t nan = (a >> 13) & 0x3FF;
    nan = (int32_t)pick(nan > 1, nan, 1) | 0x7C00;
    q = (int32_t)pick(a > (int32_t)kInf, nan, q);
    return (code_t)(q | ((u >> 16) & 0x8000));
  }
  static inline float decode(code_t c) {
    const uint32_t h = (uint16_t)c, s = (h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    const float sub = (float)(int32_t)m * 5.9604644775390625e-08f;  // m * 2**-24
    uint32_t v = pick(e == 31, kInf | (m << 13), ((e + 112) << 23) | (m << 13));
    v = pick(e == 0, bits_of(sub), v);
    return float_of(v | s);
  }
};

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

// The loops over a range of blocks, for one format. Compiled twice (target_clones): with AVX2
// where the CPU has it, and for baseline x86-64; the loader picks at run time.
template <typename F>
inline void encode_blocks(const float* xp, typename F::code_t* cp, float* sp, int64_t n,
                          int64_t block, int64_t b0, int64_t b1) {
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

template <typename F>
inline void decode_blocks(const typename F::code_t* cp, int64_t cstride, const float* sp,
                          int64_t sstride, int64_t ranks, float* op, int64_t n, int64_t block,
                          int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    for (int64_t r = 0; r < ranks; ++r) {
      const auto* c = cp + r * cstride;
      const float s = sp[r * sstride + b], inv = 1.0f / std::fabs(s);
      const bool first = r == 0;
      if (!F::has_inf && s < 0) {                        // this block's max code means +-Inf
        for (int64_t i = lo; i < hi; ++i) {
          const uint32_t code = (uint32_t)c[i] & (2 * F::sign_bit - 1);
          const float v = F::decode(c[i]) * inv;
          const uint32_t inf = kInf | (code & F::sign_bit ? 0x80000000u : 0u);
          const float w = float_of(pick((code & (F::sign_bit - 1)) == F::max_code, inf, bits_of(v)));
          op[i] = first ? w : op[i] + w;
        }
      } else if (first) {
        for (int64_t i = lo; i < hi; ++i) op[i] = F::decode(c[i]) * inv;
      } else {
        for (int64_t i = lo; i < hi; ++i) op[i] = op[i] + F::decode(c[i]) * inv;
      }
    }
  }
}

#define HVDC_CLONES __attribute__((target_clones("avx2", "default")))
HVDC_CLONES void encode_e4m3(const float* x, uint8_t* c, float* s, int64_t n, int64_t k, int64_t b0, int64_t b1) {
  encode_blocks<E4M3>(x, c, s, n, k, b0, b1);
}
HVDC_CLONES void encode_fp16(const float* x, int16_t* c, float* s, int64_t n, int64_t k, int64_t b0, int64_t b1) {
  encode_blocks<FP16>(x, c, s, n, k, b0, b1);
}
HVDC_CLONES void decode_e4m3(const uint8_t* c, int64_t cs, const float* s, int64_t ss, int64_t r,
                             float* o, int64_t n, int64_t k, int64_t b0, int64_t b1) {
  decode_blocks<E4M3>(c, cs, s, ss, r, o, n, k, b0, b1);
}
HVDC_CLONES void decode_fp16(const int16_t* c, int64_t cs, const float* s, int64_t ss, int64_t r,
                             float* o, int64_t n, int64_t k, int64_t b0, int64_t b1) {
  decode_blocks<FP16>(c, cs, s, ss, r, o, n, k, b0, b1);
}

// About 64 KiB of float32 per task, so small buckets stay on one thread.
inline int64_t grain(int64_t block) { return block >= 16384 ? 1 : 16384 / block; }

template <typename Code, typename Fn>
void encode_impl(const at::Tensor& x, at::Tensor& codes, at::Tensor& scales, int64_t block, Fn fn) {
  const float* xp = x.data_ptr<float>();
  auto* cp = reinterpret_cast<Code*>(codes.data_ptr());
  float* sp = scales.data_ptr<float>();
  const int64_t n = x.numel(), nb = (n + block - 1) / block;
  at::parallel_for(0, nb, grain(block), [&](int64_t b0, int64_t b1) { fn(xp, cp, sp, n, block, b0, b1); });
}

template <typename Code, typename Fn>
void decode_impl(const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out, int64_t block, Fn fn) {
  const auto* cp = reinterpret_cast<const Code*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ranks = codes.size(0), n = codes.size(1), nb = (n + block - 1) / block;
  const int64_t cs = codes.stride(0), ss = scales.stride(0);
  at::parallel_for(0, nb, grain(block), [&](int64_t b0, int64_t b1) {
    fn(cp, cs, sp, ss, ranks, op, n, block, b0, b1);
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "hvdc native kernel: ", what); }

void encode(const at::Tensor& x, at::Tensor codes, at::Tensor scales, std::string fmt, int64_t block) {
  check(block >= 1, "block must be >= 1");
  check(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous(),
        "x must be a contiguous 1-D float32 CPU tensor");
  check(codes.is_contiguous() && codes.numel() == x.numel(), "codes: contiguous, one per value");
  check(scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
        scales.numel() == (x.numel() + block - 1) / block, "scales: one float32 per block");
  if (fmt == "e4m3fn") {
    check(codes.scalar_type() == at::kByte, "e4m3fn codes are uint8");
    encode_impl<uint8_t>(x, codes, scales, block, encode_e4m3);
  } else if (fmt == "float16") {
    check(codes.scalar_type() == at::kShort, "float16 codes are int16");
    encode_impl<int16_t>(x, codes, scales, block, encode_fp16);
  } else {
    check(false, "format must be e4m3fn or float16");
  }
}

void decode_accumulate(const at::Tensor& codes, const at::Tensor& scales, at::Tensor out,
                       std::string fmt, int64_t block) {
  check(block >= 1, "block must be >= 1");
  check(codes.device().is_cpu() && codes.dim() == 2 && codes.stride(1) == 1,
        "codes: 2-D CPU tensor, rows contiguous");
  check(scales.dim() == 2 && scales.stride(1) == 1 && scales.scalar_type() == at::kFloat &&
        scales.size(0) == codes.size(0) && scales.size(1) == (codes.size(1) + block - 1) / block,
        "scales: 2-D float32, one row per rank, one per block");
  check(out.is_contiguous() && out.scalar_type() == at::kFloat && out.numel() == codes.size(1),
        "out: contiguous float32, one per value");
  if (codes.size(0) == 0 || codes.size(1) == 0) return;
  if (fmt == "e4m3fn") {
    check(codes.scalar_type() == at::kByte, "e4m3fn codes are uint8");
    decode_impl<uint8_t>(codes, scales, out, block, decode_e4m3);
  } else if (fmt == "float16") {
    check(codes.scalar_type() == at::kShort, "float16 codes are int16");
    decode_impl<int16_t>(codes, scales, out, block, decode_fp16);
  } else {
    check(false, "format must be e4m3fn or float16");
  }
}

}  // namespace

TORCH_LIBRARY(hvdc, m) {
  m.def("encode(Tensor x, Tensor(a!) codes, Tensor(b!) scales, str fmt, int block) -> ()", &encode);
  m.def("decode_accumulate(Tensor codes, Tensor scales, Tensor(a!) out, str fmt, int block) -> ()",
        &decode_accumulate);
}
