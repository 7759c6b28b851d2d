// Block-scaled E4M3 / float16 codes, fused: the course's optional task (compression in C++).
// The kernels are in kernels.h (plain C++); this file compiles them for the CPU at hand and
// registers them as torch ops (torch.ops.hvdc.*), called by codecs/blocks.py.
//
// encode: per block, one pass for the block's finite amax (and whether it holds +-Inf), then
// one pass that scales, rounds and packs while the block is in cache.
// decode_accumulate: one pass over the output; for each block, every rank's codes are
// decoded, unscaled and summed in rank order.
//
// The loops are written without branches so that GCC vectorises them, and compiled twice: for
// AVX2 where the CPU has it and for baseline x86-64, picked at load time (target_clones; no
// -march=native: the library must run on whichever x86-64 runs the tests). Flags (native/
// __init__.py): -ffp-contract=off, since a fused multiply-add would round once where the
// reference rounds twice; -fno-trapping-math only lets GCC evaluate both sides of a select
// (it changes no rounding). Threads come from torch's pool (at::parallel_for), so
// torch.set_num_threads() governs them, as it governs the pure-torch path.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <string>

#include "kernels.h"

namespace {

using hvdc::E4M3;
using hvdc::FP16;

#if defined(__x86_64__)
#define HVDC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HVDC_CLONES
#endif

// One function per format and loop, so each gets its clones.
template <typename F>
HVDC_CLONES void encode_range(const float* x, typename F::code_t* c, float* s, int64_t n,
                              int64_t block, int64_t b0, int64_t b1) {
  hvdc::encode_blocks<F>(x, c, s, n, block, b0, b1);
}
template <typename F>
HVDC_CLONES void decode_range(const typename F::code_t* c, int64_t cs, const float* s, int64_t ss,
                              int64_t ranks, float* o, int64_t n, int64_t block, int64_t b0, int64_t b1) {
  hvdc::decode_blocks<F>(c, cs, s, ss, ranks, o, n, block, b0, b1);
}
template <typename F>
HVDC_CLONES void values_range(const float* x, typename F::code_t* c, int64_t lo, int64_t hi) {
  hvdc::encode_values<F>(x, c, lo, hi);
}

// About 64 KiB of float32 per task, so small buckets stay on one thread.
inline int64_t grain(int64_t block) { return block >= 16384 ? 1 : 16384 / block; }

void check(bool ok, const char* what) { TORCH_CHECK(ok, "hvdc native kernel: ", what); }

template <typename F>
constexpr at::ScalarType code_type() {
  return sizeof(typename F::code_t) == 1 ? at::kByte : at::kShort;
}

// Calls fn.template operator()<F>() for the format named `fmt`, after checking the codes' dtype.
template <typename Fn>
void dispatch(const std::string& fmt, const at::Tensor& codes, Fn&& fn) {
  if (fmt == "e4m3fn") {
    check(codes.scalar_type() == code_type<E4M3>(), "e4m3fn codes are uint8");
    fn.template operator()<E4M3>();
  } else if (fmt == "float16") {
    check(codes.scalar_type() == code_type<FP16>(), "float16 codes are int16");
    fn.template operator()<FP16>();
  } else {
    check(false, "format must be e4m3fn or float16");
  }
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

void decode_accumulate(const at::Tensor& codes, const at::Tensor& scales, at::Tensor out,
                       std::string fmt, int64_t block) {
  check(block >= 1, "block must be >= 1");
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
    const auto* cp = reinterpret_cast<const typename F::code_t*>(codes.data_ptr());
    const float* sp = scales.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t cs = codes.stride(0), ss = scales.stride(0);
    at::parallel_for(0, nb, grain(block), [&](int64_t b0, int64_t b1) {
      decode_range<F>(cp, cs, sp, ss, ranks, op, n, block, b0, b1);
    });
  });
}

}  // namespace

TORCH_LIBRARY(hvdc, m) {
  m.def("encode(Tensor x, Tensor(a!) codes, Tensor(b!) scales, str fmt, int block) -> ()", &encode);
  m.def("encode_values(Tensor x, Tensor(a!) codes, str fmt) -> ()", &encode_values);
  m.def("decode_accumulate(Tensor codes, Tensor scales, Tensor(a!) out, str fmt, int block) -> ()",
        &decode_accumulate);
}
