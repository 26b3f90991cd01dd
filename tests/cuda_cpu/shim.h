// A CPU stand-in for the CUDA features kernels/turboquant_decode.cuh uses, so its source runs here (g++, one core):
// every thread of a CTA is a fiber (ucontext), switched only at barriers and warp collectives, so a CTA's threads
// interleave as a GPU may and any missing barrier shows as wrong data. tests/_cuda_cpu.py builds the header with this
// in place of cuda_fp16.h and cuda_bf16.h and without its inline-PTX helpers, which are here instead: mma.sync
// m16n8k16, ldmatrix x4, prmt, cp.async (copies land at cp.async.wait_group, not before), bar.sync / bar.arrive
// and warp shuffles and votes, from their definitions in the PTX ISA. Wrong code that a GPU would run (a barrier
// some threads skip) stops here with a deadlock message instead.
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)

using half = _Float16;
struct half2 {
  _Float16 x, y;
};
using __half2 = half2;
struct float2 {
  float x, y;
};
struct __nv_bfloat162 {
  uint16_t x, y;
};
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
inline half2 __floats2half2_rn(float a, float b) { return {static_cast<_Float16>(a), static_cast<_Float16>(b)}; }
inline half2 __float22half2_rn(float2 f) { return __floats2half2_rn(f.x, f.y); }
inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {bf16_to_float(v.x), bf16_to_float(v.y)}; }
inline uint32_t __umulhi(uint32_t a, uint32_t b) { return static_cast<uint32_t>((uint64_t{a} * b) >> 32); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a < b ? b : a; }

namespace sim {

struct dim3i {
  unsigned x, y, z;
};

struct Copy {
  void* dst;
  const void* src;
  int bytes, valid;
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  unsigned tid = 0;
  bool done = false;
  const uint64_t* wait_phase = nullptr;  // blocked until *wait_phase != wait_value
  uint64_t wait_value = 0;
  std::vector<Copy> open;                  // cp.async since the last commit
  std::vector<std::vector<Copy>> groups;   // committed, oldest first
};

struct Barrier {
  int expected = 0, count = 0;
  uint64_t phase = 0;
};

struct Cta {
  std::vector<Fiber> fibers;
  Fiber* cur = nullptr;
  ucontext_t sched;
  Barrier named[16];                // bar.sync / bar.arrive ids; 0 is __syncthreads
  std::vector<Barrier> warp;        // one per warp: the rendezvous of a warp collective
  std::vector<std::vector<uint8_t>> xchg;  // per warp: 32 lanes' operands of the collective under way
  std::vector<uint8_t> smem;
  dim3i block{};
  std::function<void()> body;
  bool in_fiber = false;
  char error[256] = "";  // why the last CTA stopped, if it did
};

inline Cta& cta() {
  static Cta c;
  return c;
}

// Stops the CTA: a fiber that fails is never resumed; run_cta returns false with the reason in cta().error.
inline void fail(const char* what) {
  Cta& c = cta();
  if (!c.error[0]) std::snprintf(c.error, sizeof c.error, "%s", what);
  while (c.in_fiber) swapcontext(&c.cur->ctx, &c.sched);
}

inline void yield_() { swapcontext(&cta().cur->ctx, &cta().sched); }

inline void arrive(Barrier& b, bool wait) {
  Fiber* f = cta().cur;
  const uint64_t phase = b.phase;
  if (++b.count == b.expected) {
    b.count = 0;
    ++b.phase;
    return;
  }
  if (!wait) return;
  f->wait_phase = &b.phase;
  f->wait_value = phase;
  while (b.phase == phase) yield_();
  f->wait_phase = nullptr;
}

inline unsigned lane() { return cta().cur->tid & 31; }
inline unsigned warp_id() { return cta().cur->tid >> 5; }
inline void warp_sync() { arrive(cta().warp[warp_id()], true); }

// A warp collective: each lane puts its operand of type In in its slot, all meet, each reads what it needs, all
// meet again (so nobody overwrites a slot still being read).
template <typename In, typename F>
inline auto collective(const In& mine, F&& read) {
  auto& buf = cta().xchg[warp_id()];
  if (buf.size() < 32 * sizeof(In)) buf.resize(32 * sizeof(In));
  std::memcpy(buf.data() + lane() * sizeof(In), &mine, sizeof(In));
  warp_sync();
  const In* all = reinterpret_cast<const In*>(buf.data());
  auto out = read(all);
  warp_sync();
  return out;
}

inline void run_fiber() {
  cta().body();
  cta().cur->done = true;
  swapcontext(&cta().cur->ctx, &cta().sched);
}

// Runs one CTA of `threads` threads to the end (true) or to a failure (false, cta().error says why): round robin
// over the fibers that can go on.
inline bool run_cta(dim3i block, int threads, int smem_bytes, std::function<void()> body) {
  Cta& c = cta();
  c.block = block;
  c.body = std::move(body);
  c.smem.assign(static_cast<size_t>(smem_bytes), 0xA5);  // garbage, as a GPU's would be
  c.fibers.resize(static_cast<size_t>(threads));  // stacks are kept from CTA to CTA
  c.warp.assign(static_cast<size_t>((threads + 31) / 32), Barrier{32, 0, 0});
  c.xchg.assign(c.warp.size(), {});
  for (auto& b : c.named) b = Barrier{};
  c.named[0].expected = threads;
  c.error[0] = 0;
  for (int t = 0; t < threads; ++t) {
    Fiber& f = c.fibers[static_cast<size_t>(t)];
    f.tid = static_cast<unsigned>(t);
    f.done = false;
    f.wait_phase = nullptr;
    f.open.clear();
    f.groups.clear();
    f.stack.resize(128 * 1024);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, run_fiber, 0);
  }
  for (;;) {
    bool progress = false, all_done = true;
    for (auto& f : c.fibers) {
      if (f.done) continue;
      all_done = false;
      if (f.wait_phase && *f.wait_phase == f.wait_value) continue;
      c.cur = &f;
      c.in_fiber = true;
      swapcontext(&c.sched, &f.ctx);
      c.in_fiber = false;
      if (c.error[0]) return false;
      progress = true;
    }
    if (all_done) break;
    if (!progress) {
      fail("deadlock: threads wait at a barrier the others never reach");
      return false;
    }
  }
  for (auto& f : c.fibers)
    if (!f.open.empty() || !f.groups.empty()) {
      fail("a thread ended with cp.async copies never waited for");
      return false;
    }
  return true;
}

}  // namespace sim

inline sim::dim3i thread_idx_() { return {sim::cta().cur->tid, 0, 0}; }
#define threadIdx (thread_idx_())
#define blockIdx (sim::cta().block)

inline void __syncthreads() { sim::arrive(sim::cta().named[0], true); }

// One CTA runs at a time here, so a global atomic is a plain read-modify-write, a fence is nothing, and the clock
// only has to move; a CTA's SM is made up from its index, 4 SMs.
inline int atomicAdd(int* a, int v) {
  const int old = *a;
  *a = old + v;
  return old;
}
inline void __threadfence() {}
inline long long clock64() {
  static long long t = 0;
  return t += 64;
}
inline unsigned smid() { return (sim::cta().block.x + 3 * sim::cta().block.y) % 4; }

inline void named_barrier(int id, int n, bool wait) {
  if (id < 0 || id > 15 || n % 32) sim::fail("bar: id 0..15 and a thread count in whole warps");
  sim::Barrier& b = sim::cta().named[id];
  if (b.expected == 0) b.expected = n;
  if (b.expected != n) sim::fail("bar: one id used with two thread counts");
  sim::arrive(b, wait);
}
inline void bar_arrive(int id, int n) { named_barrier(id, n, false); }
inline void bar_sync(int id, int n) { named_barrier(id, n, true); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  if (mask != 0xffffffffu) sim::fail("__shfl_xor_sync: only the full warp is emulated");
  const unsigned src = sim::lane() ^ static_cast<unsigned>(lane_mask);
  return sim::collective(v, [&](const T* all) { return all[src]; });
}

inline bool __any_sync(unsigned mask, bool v) {
  if (mask != 0xffffffffu) sim::fail("__any_sync: only the full warp is emulated");
  return sim::collective(v, [](const bool* all) {
    for (int l = 0; l < 32; ++l)
      if (all[l]) return true;
    return false;
  });
}

namespace onespark_tq {

// prmt.b32 (default mode): byte i of the result is byte (selector nibble i & 7) of {b, a}, or that byte's sign
// replicated when the nibble's bit 3 is set
inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t x = (uint64_t{b} << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = (sel >> (4 * i)) & 0xF;
    uint32_t byte = static_cast<uint32_t>(x >> (8 * (s & 7))) & 0xFF;
    if (s & 8) byte = (byte & 0x80) ? 0xFF : 0;
    r |= byte << (8 * i);
  }
  return r;
}

inline float half_lo(uint32_t r) {
  _Float16 h;
  uint16_t u = static_cast<uint16_t>(r & 0xFFFF);
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}
inline float half_hi(uint32_t r) { return half_lo(r >> 16); }

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, d += A B with the PTX ISA's fragment layouts: lane (g, c) =
// (lane / 4, lane % 4) holds A rows g, g + 8 at columns 2c, 2c + 1 (a0, a1) and 2c + 8, 2c + 9 (a2, a3); B rows
// 2c, 2c + 1 (b0) and 2c + 8, 2c + 9 (b1) at column g; D rows g, g + 8 at columns 2c, 2c + 1.
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  struct Ops {
    uint32_t a[4], b0, b1;
  };
  const Ops mine{{a[0], a[1], a[2], a[3]}, b0, b1};
  float acc[4] = {d[0], d[1], d[2], d[3]};
  struct Out {
    float v[4];
  };
  const Out out = sim::collective(mine, [&](const Ops* all) {
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, c = l & 3;
      const Ops& o = all[l];
      A[g][2 * c] = half_lo(o.a[0]), A[g][2 * c + 1] = half_hi(o.a[0]);
      A[g + 8][2 * c] = half_lo(o.a[1]), A[g + 8][2 * c + 1] = half_hi(o.a[1]);
      A[g][2 * c + 8] = half_lo(o.a[2]), A[g][2 * c + 9] = half_hi(o.a[2]);
      A[g + 8][2 * c + 8] = half_lo(o.a[3]), A[g + 8][2 * c + 9] = half_hi(o.a[3]);
      B[2 * c][g] = half_lo(o.b0), B[2 * c + 1][g] = half_hi(o.b0);
      B[2 * c + 8][g] = half_lo(o.b1), B[2 * c + 9][g] = half_hi(o.b1);
    }
    const int g = static_cast<int>(sim::lane() >> 2), c = static_cast<int>(sim::lane() & 3);
    Out r;
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1), col = 2 * c + (e & 1);
      float s = acc[e];
      for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
      r.v[e] = s;
    }
    return r;
  });
  for (int e = 0; e < 4; ++e) d[e] = out.v[e];
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8j .. 8j + 7 give the row addresses of matrix j; lane t gets
// 32 bits of row t / 4 of each matrix, halves 2 (t % 4) and 2 (t % 4) + 1
inline void ldsm4(uint32_t (&a)[4], const half* p) {
  const unsigned t = sim::lane();
  struct Out {
    uint32_t v[4];
  };
  const Out out = sim::collective(p, [&](const half* const* rows) {
    Out r;
    for (int j = 0; j < 4; ++j) std::memcpy(&r.v[j], reinterpret_cast<const char*>(rows[8 * j + t / 4]) + 4 * (t % 4), 4);
    return r;
  });
  for (int j = 0; j < 4; ++j) a[j] = out.v[j];
}

// cp.async with src-size: `valid ? bytes : 0` bytes copied, the rest of `bytes` zero-filled, when waited for
inline void cp_async(void* smem, const void* gmem, int bytes, bool valid) {
  sim::cta().cur->open.push_back({smem, gmem, bytes, valid ? bytes : 0});
}
inline void cp_commit() {
  sim::Fiber* f = sim::cta().cur;
  f->groups.push_back(std::move(f->open));
  f->open.clear();
}
template <int N>
inline void cp_wait() {
  sim::Fiber* f = sim::cta().cur;
  while (f->groups.size() > static_cast<size_t>(N)) {
    for (const sim::Copy& c : f->groups.front()) {
      std::memset(c.dst, 0, static_cast<size_t>(c.bytes));
      std::memcpy(c.dst, c.src, static_cast<size_t>(c.valid));
    }
    f->groups.erase(f->groups.begin());
  }
}

}  // namespace onespark_tq
