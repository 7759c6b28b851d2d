// Block-scaled E4M3 / float16 codes, fused: the course's optional task (compression in C++).
// The kernels are in kernels.h (plain C++); this file compiles them for the CPU at hand and
// registers them as torch ops (torch.ops.hvdc.*), called by codecs/blocks.py.
//
// encode: per block, one pass for the block's finite amax (and whether it holds +-Inf), then
// one pass that scales, rounds and packs while the block is in cache.
// decode_accumulate: one pass over the output; for each block, every rank's codes are
// decoded, unscaled and summed in rank order.
//
// Where the CPU has AVX2 and F16C (checked once, at load), the kernels of kernels_x86.h run:
// the hardware's float16 conversions, 8 values an instruction. Elsewhere kernels.h's loops,
// written without branches so that GCC vectorises them, compiled twice: for AVX2 and for
// baseline x86-64, picked at load time (target_clones; no -march=native: the library must run
// on whichever x86-64 runs the tests). Both are bit-identical to the torch path (tests). Flags (native/
// __init__.py): -ffp-contract=off, since a fused multiply-add would round once where the
// reference rounds twice; -fno-trapping-math only lets GCC evaluate both sides of a select
// (it changes no rounding). Threads come from torch's pool (at::parallel_for), so
// torch.set_num_threads() governs them, as it governs the pure-torch path.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "kernels.h"
#include "kernels_x86.h"

namespace {

using hvdc::E4M3;
using hvdc::FP16;

#if defined(__x86_64__)
#define HVDC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HVDC_CLONES
#endif

#if defined(__x86_64__)
// HVD_COMPRESS_F16C=0 keeps the portable kernels (how the tests check them on this CPU too).
bool detect_f16c() {
  __builtin_cpu_init();          // this runs as a static initializer, maybe before libgcc's own
  const char* off = std::getenv("HVD_COMPRESS_F16C");
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
         !(off && std::string(off) == "0");
}
const bool kF16C = detect_f16c();
#else
constexpr bool kF16C = false;
#endif

// One function per format and loop, so each gets its clones.
template <typename F>
HVDC_CLONES void encode_generic(const float* x, typename F::code_t* c, float* s, int64_t n,
                                int64_t block, int64_t b0, int64_t b1) {
  hvdc::encode_blocks<F>(x, c, s, n, block, b0, b1);
}
template <typename F>
HVDC_CLONES void decode_generic(const typename F::code_t* c, int64_t cs, const float* s, int64_t ss,
                                int64_t ranks, float* o, int64_t n, int64_t block, int64_t b0, int64_t b1,
                                float divisor) {
  hvdc::decode_blocks<F>(c, cs, s, ss, ranks, o, n, block, b0, b1);
  if (divisor != 1.0f) {
    const int64_t hi = b1 * block < n ? b1 * block : n;
    for (int64_t i = b0 * block; i < hi; ++i) o[i] = o[i] / divisor;
  }
}
template <typename F>
HVDC_CLONES void values_generic(const float* x, typename F::code_t* c, int64_t lo, int64_t hi) {
  hvdc::encode_values<F>(x, c, lo, hi);
}

template <typename F>
void encode_range(const float* x, typename F::code_t* c, float* s, int64_t n, int64_t block,
                  int64_t b0, int64_t b1) {
#if defined(__x86_64__)
  if (kF16C) return hvdc::x86::encode_blocks<F>(x, c, s, n, block, b0, b1);
#endif
  encode_generic<F>(x, c, s, n, block, b0, b1);
}
template <typename F>
void decode_range(const typename F::code_t* c, int64_t cs, const float* s, int64_t ss, int64_t ranks,
                  float* o, int64_t n, int64_t block, int64_t b0, int64_t b1, float divisor) {
#if defined(__x86_64__)
  if (kF16C) return hvdc::x86::decode_blocks<F>(c, cs, s, ss, ranks, o, n, block, b0, b1, divisor);
#endif
  decode_generic<F>(c, cs, s, ss, ranks, o, n, block, b0, b1, divisor);
}
template <typename F>
void values_range(const float* x, typename F::code_t* c, int64_t lo, int64_t hi) {
#if defined(__x86_64__)
  if (kF16C) return hvdc::x86::encode_values<F>(x, c, lo, hi);
#endif
  values_generic<F>(x, c, lo, hi);
}

// About 64 KiB of float32 per task, so small buckets stay on one thread.
inline int64_t grain(int64_t block) { return block >= 16384 ? 1 : 16384 / block; }

void check(bool ok, const char* what) { TORCH_CHECK(ok, "hvdc native kernel: ", what); }

template <typename F>
constexpr at::ScalarType code_type() {
  return sizeof(typename F::code_t) == 1 ? at::kByte : at::kShort;
}

// Calls fn.template operator()<F>() for the format named `fmt`.
template <typename Fn>
void with_format(const std::string& fmt, Fn&& fn) {
  if (fmt == "e4m3fn") fn.template operator()<E4M3>();
  else if (fmt == "float16") fn.template operator()<FP16>();
  else check(false, "format must be e4m3fn or float16");
}

// with_format, after checking that the codes' dtype is the format's.
template <typename Fn>
void dispatch(const std::string& fmt, const at::Tensor& codes, Fn&& fn) {
  with_format(fmt, [&]<typename F>() {
    check(codes.scalar_type() == code_type<F>(), "e4m3fn codes are uint8, float16 codes int16");
    fn.template operator()<F>();
  });
}

void check_x(const at::Tensor& x, const at::Tensor& codes) {
  check(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous(),
        "x must be a contiguous 1-D float32 CPU tensor");
  check(codes.device().is_cpu() && codes.is_contiguous() && codes.numel() == x.numel(),
        "codes: contiguous, one per value");
}

void encode(const at::Tensor& x, at::Tensor codes, at::Tensor scales, std::string fmt, int64_t block) {
  check(block >= 1, "block must be >= 1");
  check_x(x, codes);
  const int64_t n = x.numel(), nb = (n + block - 1) / block;
  check(scales.device().is_cpu() && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
        scales.numel() == nb, "scales: one float32 per block");
  dispatch(fmt, codes, [&]<typename F>() {
    const float* xp = x.data_ptr<float>();
    auto* cp = reinterpret_cast<typename F::code_t*>(codes.data_ptr());
    float* sp = scales.data_ptr<float>();
    at::parallel_for(0, nb, grain(block), [&](int64_t b0, int64_t b1) {
      encode_range<F>(xp, cp, sp, n, block, b0, b1);
    });
  });
}

void encode_values(const at::Tensor& x, at::Tensor codes, std::string fmt) {
  check_x(x, codes);
  dispatch(fmt, codes, [&]<typename F>() {
    const float* xp = x.data_ptr<float>();
    auto* cp = reinterpret_cast<typename F::code_t*>(codes.data_ptr());
    at::parallel_for(0, x.numel(), 65536, [&](int64_t lo, int64_t hi) { values_range<F>(xp, cp, lo, hi); });
  });
}

// Every scale an encoder writes is +-2**k, k in [-126, 127]; anything else (a flipped bit in
// transit, a message from another format) would decode into garbage gradients silently.
// A negative scale (the block's max code means +-Inf) only exists for formats without Inf.
template <typename F>
void check_scales(const float* sp, int64_t sstride, int64_t ranks, int64_t nb) {
  const uint32_t mask = F::has_inf ? 0xFFFFFFFFu : hvdc::kAbs;
  for (int64_t r = 0; r < ranks; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint32_t bits = hvdc::bits_of(sp[r * sstride + b]) & mask;
      if ((bits & 0x007FFFFFu) == 0 && bits >= 0x00800000u && bits < hvdc::kInf) continue;
      TORCH_CHECK(false, "corrupt bucket message: rank ", r, "'s scale of block ", b, " is ",
                  sp[r * sstride + b], " (bits 0x", std::hex, bits, std::dec,
                  "); scales must be finite powers of two",
                  F::has_inf ? ", positive for this format" : "");
    }
  }
}

void decode_accumulate(const at::Tensor& codes, const at::Tensor& scales, at::Tensor out,
                       std::string fmt, int64_t block, double divisor) {
  check(block >= 1, "block must be >= 1");
  check(divisor > 0, "divisor must be > 0");
  check(codes.device().is_cpu() && codes.dim() == 2 && codes.stride(1) == 1,
        "codes: 2-D CPU tensor, rows contiguous");
  const int64_t ranks = codes.size(0), n = codes.size(1), nb = (n + block - 1) / block;
  check(scales.device().is_cpu() && scales.dim() == 2 && scales.stride(1) == 1 &&
        scales.scalar_type() == at::kFloat && scales.size(0) == ranks && scales.size(1) == nb,
        "scales: 2-D float32, one row per rank, one per block");
  check(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == at::kFloat &&
        out.numel() == n, "out: contiguous float32, one per value");
  if (ranks == 0 || n == 0) return;
  dispatch(fmt, codes, [&]<typename F>() {
    check_scales<F>(scales.data_ptr<float>(), scales.stride(0), ranks, nb);
    const auto* cp = reinterpret_cast<const typename F::code_t*>(codes.data_ptr());
    const float* sp = scales.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t cs = codes.stride(0), ss = scales.stride(0);
    at::parallel_for(0, nb, grain(block), [&](int64_t b0, int64_t b1) {
      decode_range<F>(cp, cs, sp, ss, ranks, op, n, block, b0, b1, (float)divisor);
    });
  });
}

// A bucket message is [float32 scale per block | codes | pad to 4 bytes] (compressors.py).
// These ops take and give whole messages (or runs of them), so one call does a bucket or all
// of its chunks: no views made per step, and no Python between the pieces.
int64_t code_bytes_of(const std::string& fmt) { return fmt == "float16" ? 2 : 1; }
int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }
int64_t message_size(int64_t n, int64_t block, int64_t cb) {
  return 4 * blocks_of(n, block) + ((cb * n + 3) & ~(int64_t)3);
}

template <typename F>
void encode_raw(const float* xp, int64_t n, uint8_t* msg, int64_t block) {
  if (n == 0) return;
  const int64_t nb = blocks_of(n, block);
  float* sp = reinterpret_cast<float*>(msg);
  auto* cp = reinterpret_cast<typename F::code_t*>(msg + 4 * nb);
  at::parallel_for(0, nb, grain(block), [&](int64_t b0, int64_t b1) {
    encode_range<F>(xp, cp, sp, n, block, b0, b1);
  });
}

// rows of `ranks` messages, `row` bytes apart, each of n values: decoded, summed in rank order,
// divided by `divisor`, into op
template <typename F>
void decode_raw(const uint8_t* msgs, int64_t row, int64_t ranks, int64_t n, float* op,
                int64_t block, float divisor) {
  if (ranks == 0 || n == 0) return;
  const int64_t nb = blocks_of(n, block), cb = sizeof(typename F::code_t);
  const float* sp = reinterpret_cast<const float*>(msgs);
  check_scales<F>(sp, row / 4, ranks, nb);
  const auto* cp = reinterpret_cast<const typename F::code_t*>(msgs + 4 * nb);
  at::parallel_for(0, nb, grain(block), [&](int64_t b0, int64_t b1) {
    decode_range<F>(cp, row / cb, sp, row / 4, ranks, op, n, block, b0, b1, divisor);
  });
}

void check_float_vector(const at::Tensor& t, const char* what) {
  check(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous(), what);
}

void check_bytes(const at::Tensor& m, int64_t need, const char* what) {
  check(m.device().is_cpu() && m.scalar_type() == at::kByte && m.dim() == 1 && m.is_contiguous() &&
        m.numel() >= need && reinterpret_cast<uintptr_t>(m.data_ptr()) % 4 == 0, what);
}

// Chunks [bounds[k], bounds[k+1]) of a bucket, each its own message, one after another.
// block 0: one block per chunk (one scale per chunk, the per-tensor packets' rule).
void check_bounds(at::IntArrayRef bounds, int64_t numel, int64_t block) {
  check(block >= 0, "block must be >= 0 (0: one block per chunk)");
  check(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == numel, "bounds must run 0..numel");
  for (size_t k = 1; k < bounds.size(); ++k) check(bounds[k - 1] <= bounds[k], "bounds must not decrease");
}
int64_t chunk_block(int64_t n, int64_t block) { return block ? block : (n > 0 ? n : 1); }
int64_t chunks_size(at::IntArrayRef bounds, int64_t block, int64_t cb) {
  int64_t total = 0;
  for (size_t k = 1; k < bounds.size(); ++k) {
    const int64_t n = bounds[k] - bounds[k - 1];
    total += message_size(n, chunk_block(n, block), cb);
  }
  return total;
}

// n ranks' messages of n values each, one per row of a 2-D uint8 tensor
void check_messages(const at::Tensor& messages, int64_t n, int64_t block, int64_t cb, double divisor) {
  check(block >= 1, "block must be >= 1");
  check(divisor > 0, "divisor must be > 0");
  check(messages.device().is_cpu() && messages.scalar_type() == at::kByte && messages.dim() == 2 &&
        messages.stride(1) == 1 && messages.size(1) >= 4 * blocks_of(n, block) + cb * n,
        "messages: 2-D uint8, one message per row, rows contiguous");
  check(messages.size(0) == 1 || messages.stride(0) % 4 == 0, "message rows must start 4 bytes apart");
  check(reinterpret_cast<uintptr_t>(messages.data_ptr()) % 4 == 0, "messages must be 4-byte aligned");
}

void encode_message(const at::Tensor& x, at::Tensor message, std::string fmt, int64_t block) {
  check(block >= 1, "block must be >= 1");
  check_float_vector(x, "x must be a contiguous 1-D float32 CPU tensor");
  const int64_t n = x.numel(), cb = code_bytes_of(fmt);
  check_bytes(message, 4 * blocks_of(n, block) + cb * n,
              "message: contiguous 4-byte aligned uint8, 4 bytes per block + the codes");
  with_format(fmt, [&]<typename F>() {
    encode_raw<F>(x.data_ptr<float>(), n, static_cast<uint8_t*>(message.data_ptr()), block);
  });
}

void decode_messages(const at::Tensor& messages, int64_t n, at::Tensor out, std::string fmt,
                     int64_t block, double divisor) {
  const int64_t cb = code_bytes_of(fmt);
  check_messages(messages, n, block, cb, divisor);
  const int64_t ranks = messages.size(0), row = messages.stride(0);
  check_float_vector(out, "out: contiguous float32");
  check(out.numel() == n, "out: one float32 per value");
  with_format(fmt, [&]<typename F>() {
    decode_raw<F>(static_cast<const uint8_t*>(messages.data_ptr()), row, ranks, n,
                  out.data_ptr<float>(), block, (float)divisor);
  });
}

// The float32 side (values to encode, or the output) and the run of chunk messages agree;
// returns the format's bytes per code.
int64_t check_chunks(const at::Tensor& values, at::IntArrayRef bounds, const at::Tensor& message,
                     int64_t block, const std::string& fmt) {
  check_float_vector(values, "values: a contiguous 1-D float32 CPU tensor");
  check_bounds(bounds, values.numel(), block);
  const int64_t cb = code_bytes_of(fmt);
  check_bytes(message, chunks_size(bounds, block, cb), "message: contiguous 4-byte aligned uint8, "
              "one message per chunk");
  return cb;
}

// Calls fn(first value, values, block, message offset) for each chunk, in order.
template <typename Fn>
void for_each_chunk(at::IntArrayRef bounds, int64_t block, int64_t cb, Fn&& fn) {
  int64_t offset = 0;
  for (size_t k = 1; k < bounds.size(); ++k) {
    const int64_t n = bounds[k] - bounds[k - 1], blk = chunk_block(n, block);
    fn(bounds[k - 1], n, blk, offset);
    offset += message_size(n, blk, cb);
  }
}

void encode_chunks(const at::Tensor& x, at::Tensor message, at::IntArrayRef bounds, std::string fmt,
                   int64_t block) {
  const int64_t cb = check_chunks(x, bounds, message, block, fmt);
  auto* base = static_cast<uint8_t*>(message.data_ptr());
  with_format(fmt, [&]<typename F>() {
    for_each_chunk(bounds, block, cb, [&](int64_t lo, int64_t n, int64_t blk, int64_t offset) {
      encode_raw<F>(x.data_ptr<float>() + lo, n, base + offset, blk);
    });
  });
}

void decode_chunks(const at::Tensor& message, at::IntArrayRef bounds, at::Tensor out, std::string fmt,
                   int64_t block) {
  const int64_t cb = check_chunks(out, bounds, message, block, fmt);
  const auto* base = static_cast<const uint8_t*>(message.data_ptr());
  with_format(fmt, [&]<typename F>() {
    for_each_chunk(bounds, block, cb, [&](int64_t lo, int64_t n, int64_t blk, int64_t offset) {
      decode_raw<F>(base + offset, message_size(n, blk, cb), 1, n, out.data_ptr<float>() + lo, blk, 1.0f);
    });
  });
}

// The two-phase route's middle: n ranks' messages of one chunk decoded, summed, divided, and
// encoded again into `message`, in one call (the float32 sum lives only in a scratch).
void reduce_encode(const at::Tensor& messages, int64_t n, at::Tensor message, std::string fmt,
                   int64_t block, double divisor) {
  const int64_t cb = code_bytes_of(fmt);
  check_messages(messages, n, block, cb, divisor);
  const int64_t ranks = messages.size(0), row = messages.stride(0);
  check_bytes(message, 4 * blocks_of(n, block) + cb * n,
              "message: contiguous 4-byte aligned uint8, 4 bytes per block + the codes");
  // reused from call to call: a fresh buffer of a large chunk costs page faults every step
  static thread_local std::vector<float> sum;
  if ((int64_t)sum.size() < n) sum.resize(n);
  with_format(fmt, [&]<typename F>() {
    decode_raw<F>(static_cast<const uint8_t*>(messages.data_ptr()), row, ranks, n, sum.data(),
                  block, (float)divisor);
    encode_raw<F>(sum.data(), n, static_cast<uint8_t*>(message.data_ptr()), block);
  });
}

}  // namespace

TORCH_LIBRARY(hvdc, m) {
  m.def("encode(Tensor x, Tensor(a!) codes, Tensor(b!) scales, str fmt, int block) -> ()", &encode);
  m.def("encode_values(Tensor x, Tensor(a!) codes, str fmt) -> ()", &encode_values);
  m.def("decode_accumulate(Tensor codes, Tensor scales, Tensor(a!) out, str fmt, int block, "
        "float divisor=1.0) -> ()", &decode_accumulate);
  m.def("uses_f16c() -> bool", []() { return kF16C; });
  m.def("encode_message(Tensor x, Tensor(a!) message, str fmt, int block) -> ()", &encode_message);
  m.def("decode_messages(Tensor messages, int numel, Tensor(a!) out, str fmt, int block, "
        "float divisor=1.0) -> ()", &decode_messages);
  m.def("encode_chunks(Tensor x, Tensor(a!) message, int[] bounds, str fmt, int block) -> ()",
        &encode_chunks);
  m.def("decode_chunks(Tensor message, int[] bounds, Tensor(a!) out, str fmt, int block) -> ()",
        &decode_chunks);
  m.def("reduce_encode(Tensor messages, int numel, Tensor(a!) message, str fmt, int block, "
        "float divisor=1.0) -> ()", &reduce_encode);
}
