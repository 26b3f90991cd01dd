// TurboQuant K4V4 decode attention with mma.sync and fragment-level decoding (CUDA C++, sm_80 and up: the
// DGX Spark's sm_121 and the H200's sm_90 run the same code). No torch here: tests/test_kernels_compile.py
// compiles this header alone with ptxas and checks registers and spills for both GPUs.
//
// One CTA per (request, KV head, split of the context), 4 warps, all G x T query rows of the KV head in
// M = ceil(G*T / 16) row tiles of 16 (16 at decode, 48 at an MTP-2 verify step: no padded rows). Keys come
// in steps of 64 through a 3-stage cp.async pipeline into shared memory, then:
//   Q @ K^T  warp w takes keys 16w .. 16w+15; each thread turns the 4-bit codes it loaded into the mma B
//            fragment in registers (PRMT lookups with the code word as its own selectors: decode_key). The dot
//            product is over coordinates, so their order is free: thread c of a quad takes code bytes
//            32c .. 32c+31 of its key (two 16-byte loads), and the rotated query is stored in shared memory in that
//            same order (coord() below), read with ldmatrix.
//   softmax  the step's row maximum is shared through shared memory (one barrier), so every warp holds the
//            same running maximum; each warp sums its own keys' probabilities (summed over warps at the end). The
//            accumulators are rescaled only in a step where a row's maximum grew, and keys are masked only in a
//            split's last steps: with the decode and the page lookups below, a step in the middle of a split issues
//            ~22% fewer instructions per warp on sm_90 than before (1,674 -> 1,309 at q_len 3, 1,181 -> 914 at
//            q_len 1: bench/results/turboquant_cuda_sass.json).
//   P @ V    warp w owns code bytes 32w .. 32w+31 of every value, i.e. coordinates 32w+j and 128+32w+j
//            (64 of 256): no decode is repeated across warps and no output is reduced across warps. An mma B
//            fragment register pairs two keys at one coordinate, so each thread decodes the value words of its
//            4 keys and pairs them with byte permutes (pair_keys()). P comes from shared memory (ldmatrix).
// Output: the same fp32 workspace as turboquant_triton's decode kernel (unnormalised sums in the rotated basis,
// running max and sum per row and split); its merge kernel normalises, weighs the splits and rotates back.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace onespark_tq {

constexpr int D = 256;          // head_dim
constexpr int ROW_BYTES = 128;  // 4-bit codes of one token, one KV head
constexpr int NW = 4;           // warps; P @ V gives warp w code bytes [32w, 32w + 32)
constexpr int TILE = 64;        // keys per step: 16 per warp in Q @ K^T
constexpr int MIN_SPLIT = 8 * TILE;  // keys a split takes at least (turboquant_cuda.num_splits_for's floor)
constexpr int KV_STRIDE = 144;  // bytes per key row in shared memory: 128 + 16 keeps the LDS.128 and LDS.32 reads
                                // below free of bank conflicts (row r starts at bank 4r mod 32)
constexpr int Q_STRIDE = D + 8;     // halves: ldmatrix rows 528 B apart, conflict-free
constexpr int P_STRIDE = TILE + 8;  // halves: 144 B

struct Params {
  const uint16_t* q;  // [B, Hq, T, D], rotated, contiguous; fp16, or bf16 with q_bf16 (rounded to fp16 on load)
  const uint8_t* cache;
  const int32_t* block_table;
  const int32_t* seq_lens;
  float* ws_acc;  // [B * H * splits * G*T, D]
  float* ws_ml;   // [B * H * splits * G*T, 2]
  int64_t bt_stride, block_bytes;
  int v_offset, s_offset, H, G, T, num_splits;
  uint32_t gpp, gpp_magic;
  bool q_bf16;  // 16-key groups per page (pages are multiples of 16 keys); ceil(2^32 / gpp) if gpp > 1
  float k_mul;   // sm_scale * log2(e): scores in base 2
  uint32_t tab[4];  // low bytes of fp16 |level[8 + m]|, m = 0..7 (2 words), then the high bytes (2 words)
};

template <int M, int STAGES>
constexpr int smem_bytes() {
  return STAGES * (2 * TILE * KV_STRIDE + TILE * 8) + M * 16 * (Q_STRIDE + P_STRIDE) * 2 + NW * M * 16 * 4;
}

// Position p (0..255) of a query row in shared memory holds rotated coordinate coord(p): slice j = p / 16 of the
// reduction, mma k index kp = p % 16. Thread c of a quad holds B values for k = 2c, 2c+1 (b0) and 2c+8, 2c+9 (b1)
// from code word w = j / 2 of its 8 (bytes 32c + 4w .. +3): A coordinates for even j, their B (+128) for odd j.
__host__ __device__ constexpr int coord(int p) {
  int j = p >> 4, kp = p & 15;
  return 128 * (j & 1) + 32 * ((kp & 7) >> 1) + 4 * (j >> 1) + 2 * (kp >> 3) + (kp & 1);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// 4 code bytes -> fp16 pairs (A_0, A_1), (A_2, A_3), (B_0, B_1), (B_2, B_3), X_k the coordinate X of byte k. A byte
// holds A's magnitude at bits 0-2, B's sign at bit 3, B's magnitude at bits 4-6, A's sign at bit 7 (turboquant.py's
// docstring), so with the signs masked out the word's low and high half-words are PRMT selectors as they stand:
// nibbles A_0 B_0 A_1 B_1 and A_2 B_2 A_3 B_3 pick the low and the high bytes of the fp16 levels from the table.
// Each sign goes to bit 7 of its high byte: a PRMT puts byte k of x (A_k's sign at bit 7) and of x << 4 (B_k's)
// in the order the lookups give. 15 integer ops per 8 values, 10 of them PRMT (the selector-building variant
// before took 18).
__device__ __forceinline__ void decode_key(uint32_t x, const uint32_t (&t)[4], uint32_t (&out)[4]) {
  const uint32_t sel = x & 0x77777777u, sel_hi = sel >> 16, x4 = x << 4;
  const uint32_t lo01 = prmt(t[0], t[1], sel), lo23 = prmt(t[0], t[1], sel_hi);  // bytes A_k B_k A_k+1 B_k+1
  const uint32_t hi01 = prmt(t[2], t[3], sel) | (prmt(x, x4, 0x5140) & 0x80808080u);
  const uint32_t hi23 = prmt(t[2], t[3], sel_hi) | (prmt(x, x4, 0x7362) & 0x80808080u);
  out[0] = prmt(lo01, hi01, 0x6240);
  out[1] = prmt(lo23, hi23, 0x6240);
  out[2] = prmt(lo01, hi01, 0x7351);
  out[3] = prmt(lo23, hi23, 0x7351);
}

// Two keys' code words (u first in k) -> out[n] = fp16 pair (u, v) at coordinate n of the word: n = 0..3 for the A
// coordinates of bytes 0..3, 4..7 for their B. The bytes are interleaved first (u0 v0 u1 v1, u2 v2 u3 v3), so the
// decoder's own pairing of neighbouring bytes pairs the two keys.
__device__ __forceinline__ void pair_keys(uint32_t xu, uint32_t xv, const uint32_t (&t)[4], uint32_t (&out)[8]) {
  uint32_t lo[4], hi[4];
  decode_key(prmt(xu, xv, 0x5140), t, lo);
  decode_key(prmt(xu, xv, 0x7362), t, hi);
  out[0] = lo[0], out[1] = lo[1], out[4] = lo[2], out[5] = lo[3];
  out[2] = hi[0], out[3] = hi[1], out[6] = hi[2], out[7] = hi[3];
}

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm4(uint32_t (&a)[4], const half* p) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(s) : "memory");
}

__device__ __forceinline__ void cp_async(void* smem, const void* gmem, int bytes, bool valid) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  int n = valid ? bytes : 0;  // 0: zero-fill, nothing read
  if (bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(n) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Where a 16-key group of the context lives: its block and its first key's row in it. Steps start at multiples of 64 keys and pages are multiples of 16, so a group never straddles two pages.
struct Group {
  const uint8_t* block;  // the group's block
  uint32_t first;        // the group's first key within the block
};
__device__ __forceinline__ Group group(const Params& p, const int32_t* bt, uint32_t grp) {
  uint32_t pg = p.gpp == 1 ? grp : __umulhi(grp, p.gpp_magic);  // grp / gpp, exact (the host checks the range)
  return {p.cache + static_cast<int64_t>(bt[pg]) * p.block_bytes, (grp - pg * p.gpp) * 16};
}

// Keys [n0, n0 + TILE) of KV head h into a stage: code rows (K, V) and the (K, V) scales. Warp w loads the step's
// 16-key group w, so a warp looks up one page a step (a thread looking up all four took ~30 integer ops each, 15%
// of a q_len-1 step on sm_90): 4 keys a load, 8 threads a 128-byte row. Keys >= end are zero-filled (codes 0 decode
// to finite levels; their scores are masked, their scale 0).
__device__ __forceinline__ void load_step(const Params& p, uint8_t* kb, uint8_t* vb, float* sc, const int32_t* bt,
                                          int n0, int end, int h, int w, int lane) {
  const int first_key = n0 + 16 * w, ch = lane & 7;
  const uint8_t* rows = p.cache;  // key 0 of the group, chunk ch; any valid address where nothing is read
  const uint8_t* scales = p.cache;
  if (first_key < end) {
    const Group gr = group(p, bt, first_key >> 4);
    rows = gr.block + (gr.first * p.H + h) * ROW_BYTES + ch * 16;
    scales = gr.block + p.s_offset + ((gr.first + lane) * p.H + h) * 8;
  }
  const int key_stride = p.H * ROW_BYTES;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int key = 4 * i + (lane >> 3), t = 16 * w + key;
    const bool ok = first_key + key < end;
    const uint8_t* row = ok ? rows + key * key_stride : p.cache;
    cp_async(kb + t * KV_STRIDE + ch * 16, row, 16, ok);
    cp_async(vb + t * KV_STRIDE + ch * 16, ok ? row + p.v_offset : p.cache, 16, ok);
  }
  if (lane < 16) {
    const bool ok = first_key + lane < end;
    cp_async(sc + (16 * w + lane) * 2, ok ? scales : p.cache, 8, ok);
  }
}

template <int M, int STAGES>
__global__ void __launch_bounds__(NW * 32) decode_k4v4(const Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* kbuf = smem;                                   // [STAGES][TILE][KV_STRIDE]
  uint8_t* vbuf = kbuf + STAGES * TILE * KV_STRIDE;       // [STAGES][TILE][KV_STRIDE]
  float* sbuf = reinterpret_cast<float*>(vbuf + STAGES * TILE * KV_STRIDE);  // [STAGES][TILE][2]
  half* qs = reinterpret_cast<half*>(sbuf + STAGES * TILE * 2);              // [M*16][Q_STRIDE]
  half* ps = qs + M * 16 * Q_STRIDE;                                         // [M*16][P_STRIDE]
  float* red = reinterpret_cast<float*>(ps + M * 16 * P_STRIDE);             // [NW][M*16]

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, c = lane & 3;
  const int bh = blockIdx.x, split = blockIdx.y, b = bh / p.H, h = bh % p.H;
  const int GT = p.G * p.T, L = p.seq_lens[b];
  // At least MIN_SPLIT keys a split, whatever num_splits: a server's CUDA graphs size the grid for max_model_len, so
  // a shorter request leaves the splits past its keys empty instead of running many short ones.
  const int per = max(MIN_SPLIT, ((L + p.num_splits - 1) / p.num_splits + TILE - 1) / TILE * TILE);
  const int start = split * per, end = min(L, start + per);
  const int64_t ws0 = (static_cast<int64_t>(bh) * p.num_splits + split) * GT;  // workspace row of tile row 0

  if (start >= end) {  // an empty split: m = -inf, l = 0 (the merge weighs it 0 and reads no accumulator)
    for (int r = tid; r < GT; r += NW * 32) {
      p.ws_ml[(ws0 + r) * 2] = -INFINITY;
      p.ws_ml[(ws0 + r) * 2 + 1] = 0.f;
    }
    return;
  }
  const int32_t* bt = p.block_table + b * p.bt_stride;
  const int steps = (end - start + TILE - 1) / TILE;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps)
      load_step(p, kbuf + s * TILE * KV_STRIDE, vbuf + s * TILE * KV_STRIDE, sbuf + s * TILE * 2, bt,
                start + s * TILE, end, h, w, lane);
    cp_commit();
  }

  // query rows r = g*T + t (query head h*G + g, position t) into shared memory in coord() order, rows >= G*T zero:
  // 16-byte loads of 8 coordinates 8k .. 8k+7, which are 4 pairs of neighbouring positions (coord() keeps pairs)
  for (int i = tid; i < M * 16 * D / 8; i += NW * 32) {
    const int r = i / (D / 8), k = i % (D / 8);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < GT)
      v = *reinterpret_cast<const uint4*>(
          p.q + ((static_cast<int64_t>(b) * p.H * p.G + h * p.G + r / p.T) * p.T + r % p.T) * D + 8 * k);
    uint32_t words[4] = {v.x, v.y, v.z, v.w};
    if (p.q_bf16) {  // as the Triton kernel's _load_q: the rotated query in its dtype, then fp16
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const __half2 h2 = __float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[u])));
        words[u] = *reinterpret_cast<const uint32_t*>(&h2);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int x = 8 * k + 2 * u;  // coordinates x, x + 1 = coord(pos), coord(pos + 1): the inverse of coord()
      const int pos = 16 * (2 * ((x >> 2) & 7) + (x >> 7)) + 2 * ((x >> 5) & 3) + 8 * ((x >> 1) & 1);
      *reinterpret_cast<uint32_t*>(qs + r * Q_STRIDE + pos) = words[u];
    }
  }
  uint32_t tab[4] = {p.tab[0], p.tab[1], p.tab[2], p.tab[3]};

  float o[M][8][4];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[m][n][e] = 0.f;
  float m_run[M][2], l_run[M][2];
  int last[M][2];  // the last key each of this thread's rows may see (causal within a verify step)
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      m_run[m][rh] = -INFINITY;
      l_run[m][rh] = 0.f;
      last[m][rh] = L - p.T + (16 * m + g + 8 * rh) % p.T;
    }

  for (int step = 0; step < steps; ++step) {
    const int n0 = start + step * TILE, stage = step % STAGES;
    cp_wait<STAGES - 2>();
    __syncthreads();  // this step's codes are in; every warp is done with the stage refilled next
    {
      int nxt = step + STAGES - 1, ns = nxt % STAGES;
      if (nxt < steps)
        load_step(p, kbuf + ns * TILE * KV_STRIDE, vbuf + ns * TILE * KV_STRIDE, sbuf + ns * TILE * 2, bt,
                  start + nxt * TILE, end, h, w, lane);
      cp_commit();
    }
    const uint8_t* kb = kbuf + stage * TILE * KV_STRIDE;
    const uint8_t* vb = vbuf + stage * TILE * KV_STRIDE;
    const float* sc = sbuf + stage * TILE * 2;

    // S = Q K^T for keys 16w + 8n + g (n = 0, 1) of the step. One row tile has 2 accumulators to chain 16 mma
    // each: A and B slices go to separate ones (ACC = 2), summed after, for twice the independent mma in flight.
    constexpr int ACC = M == 1 ? 2 : 1;
    float s[M][2][4], s2[M][2][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[m][n][e] = s2[m][n][e] = 0.f;
#pragma unroll
    for (int half16 = 0; half16 < 2; ++half16) {
      uint4 kw[2];
#pragma unroll
      for (int n = 0; n < 2; ++n)
        kw[n] = *reinterpret_cast<const uint4*>(kb + (16 * w + 8 * n + g) * KV_STRIDE + 32 * c + 16 * half16);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = 2 * (4 * half16 + i);  // slices j (A coordinates) and j + 1 (B)
        uint32_t kf[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          uint32_t x = i == 0 ? kw[n].x : i == 1 ? kw[n].y : i == 2 ? kw[n].z : kw[n].w;
          decode_key(x, tab, kf[n]);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
          uint32_t a[4];
          ldsm4(a, qs + (16 * m + (lane & 15)) * Q_STRIDE + 16 * j + (lane >> 4) * 8);
#pragma unroll
          for (int n = 0; n < 2; ++n) mma(s[m][n], a, kf[n][0], kf[n][1]);
          ldsm4(a, qs + (16 * m + (lane & 15)) * Q_STRIDE + 16 * (j + 1) + (lane >> 4) * 8);
#pragma unroll
          for (int n = 0; n < 2; ++n) mma(ACC == 2 ? s2[m][n] : s[m][n], a, kf[n][2], kf[n][3]);
        }
      }
    }
    if (ACC == 2) {
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[m][n][e] += s2[m][n][e];
    }

    // scale, mask (only a step that reaches the split's end or a verify row's own position has keys to hide:
    // the last one or two of a split), this warp's row maxima -> red
    float ks[2][2];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) ks[n][e] = sc[(16 * w + 8 * n + 2 * c + e) * 2] * p.k_mul;
    const bool edge = n0 + TILE > min(end, L - p.T + 1);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tok = n0 + 16 * w + 8 * n + 2 * c + e;
            float v = s[m][n][2 * rh + e] * ks[n][e];
            if (edge) v = (tok < end && tok <= last[m][rh]) ? v : -INFINITY;
            s[m][n][2 * rh + e] = v;
            mx = fmaxf(mx, v);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (c == 0) red[w * M * 16 + 16 * m + g + 8 * rh] = mx;
      }
    __syncthreads();

    // the step's maximum, probabilities (times the value scale, fp16) -> ps; O rescaled only when a row's maximum
    // grew, which past the first steps of a split is rare: the warp votes, and skips the M x 32 multiplies
    float alpha[M][2];
    bool grew = false;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const int r = 16 * m + g + 8 * rh;
        float mx = m_run[m][rh];
#pragma unroll
        for (int x = 0; x < NW; ++x) mx = fmaxf(mx, red[x * M * 16 + r]);
        const float safe = mx == -INFINITY ? 0.f : mx;  // a row with nothing visible yet
        alpha[m][rh] = 1.f;
        if (mx > m_run[m][rh]) {
          alpha[m][rh] = exp2f(m_run[m][rh] - mx);
          grew = true;
        }
        m_run[m][rh] = mx;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          float p0 = exp2f(s[m][n][2 * rh] - safe), p1 = exp2f(s[m][n][2 * rh + 1] - safe);
          sum += p0 + p1;
          const int k = 16 * w + 8 * n + 2 * c;
          *reinterpret_cast<half2*>(ps + r * P_STRIDE + k) = __floats2half2_rn(p0 * sc[k * 2 + 1], p1 * sc[k * 2 + 3]);
        }
        l_run[m][rh] = l_run[m][rh] * alpha[m][rh] + sum;
      }
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[m][n][e] *= alpha[m][e >> 1];
    }
    __syncthreads();

    // O += P V over the step's 4 slices of 16 keys, coordinates of code bytes 32w + 4g .. +3
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) {
      const uint8_t* vrow = vb + (16 * kk + 2 * c) * KV_STRIDE + 32 * w + 4 * g;
      uint32_t x0 = *reinterpret_cast<const uint32_t*>(vrow);
      uint32_t x1 = *reinterpret_cast<const uint32_t*>(vrow + KV_STRIDE);
      uint32_t x8 = *reinterpret_cast<const uint32_t*>(vrow + 8 * KV_STRIDE);
      uint32_t x9 = *reinterpret_cast<const uint32_t*>(vrow + 9 * KV_STRIDE);
      uint32_t b0[8], b1[8];
      pair_keys(x0, x1, tab, b0);
      pair_keys(x8, x9, tab, b1);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        uint32_t a[4];
        ldsm4(a, ps + (16 * m + (lane & 15)) * P_STRIDE + 16 * kk + (lane >> 4) * 8);
#pragma unroll
        for (int n = 0; n < 8; ++n) mma(o[m][n], a, b0[n], b1[n]);
      }
    }
  }
  cp_wait<0>();

  // l summed over warps; each warp writes its own coordinates, warp 0 the (m, l) pairs
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float l = l_run[m][rh];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      l_run[m][rh] = l;
    }
  __syncthreads();  // every warp is past its last read of red
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh)
      if (c == 0) red[w * M * 16 + 16 * m + g + 8 * rh] = l_run[m][rh];
  __syncthreads();
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int r = 16 * m + g + 8 * rh;
      if (r >= GT) continue;
      float* acc = p.ws_acc + (ws0 + r) * D;
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 4 * (2 * c + e) + 32 * w + (n & 3) + 128 * (n >> 2);  // value coordinate of (n, 2c + e)
          acc[col] = o[m][n][2 * rh + e];
        }
      if (w == 0 && c == 0) {
        float l = 0.f;
#pragma unroll
        for (int x = 0; x < NW; ++x) l += red[x * M * 16 + r];
        p.ws_ml[(ws0 + r) * 2] = m_run[m][rh];
        p.ws_ml[(ws0 + r) * 2 + 1] = l;
      }
    }
}

// Host side, for the torch binding (turboquant_decode.cu) and the CPU build (tests/cuda_cpu/runner.cc): Params'
// page division for gpp 16-key groups per page. floor(n * magic / 2^32) = floor(n / gpp) whenever
// n * excess < 2^32, so the magic number serves every group index a block table of bt_cols pages holds; false when
// no magic number does (a table that long).
inline bool set_page_division(Params& p, uint32_t gpp, int64_t bt_cols) {
  p.gpp = gpp;
  p.gpp_magic = 0;
  if (gpp <= 1) return true;
  const uint64_t magic = ((uint64_t{1} << 32) + gpp - 1) / gpp, excess = magic * gpp - (uint64_t{1} << 32);
  if (static_cast<uint64_t>(bt_cols) * gpp * excess >= (uint64_t{1} << 32)) return false;
  p.gpp_magic = static_cast<uint32_t>(magic);
  return true;
}

}  // namespace onespark_tq
