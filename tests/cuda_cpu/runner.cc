// The CPU build of a TurboQuant decode header (tests/_cuda_cpu.py): one C entry point with the binding's checks and
// Params (kernels/turboquant_decode.cu), each CTA of the grid run to the end in turn on fibers (shim.h).
#include "shim.h"
#include ONESPARK_TQ_HEADER

namespace {

// CTAs in a scrambled order (a GPU promises none): a kernel that takes its work by ticket then runs items on CTAs
// other than their own block index.
template <int M, int STAGES>
bool grid(const onespark_tq::Params& p, int gx, int gy) {
  const int n = gx * gy;
  for (int i = 0; i < n; ++i) {
    const int k = static_cast<int>((static_cast<int64_t>(i) * 7919 + 13) % n);  // a permutation unless n % 7919 == 0
    const int x = k % gx, y = k / gx;
    if (!sim::run_cta({static_cast<unsigned>(x), static_cast<unsigned>(y), 0}, onespark_tq::NW * 32,
                      onespark_tq::smem_bytes<M, STAGES>(), [&p] { onespark_tq::decode_k4v4<M, STAGES>(p); }))
      return false;
  }
  return true;
}

// A header whose Params take work by ticket (a candidate's) gets zeroed counters, as kernels/turboquant_cuda.py's.
template <typename P>
void set_claim(P& p, int gx, int gy, std::vector<int>& counters) {
  if constexpr (requires { p.claim; }) {
    counters.assign(P::CLAIM_INTS, 0);
    p.claim = counters.data();
    p.BH = gx;
    p.ctas = gx * gy;
    p.claim_wait = 256;
  }
}

}  // namespace

// Why the last tq_decode that returned 3 stopped.
extern "C" const char* tq_error() { return sim::cta().error; }

// 0: done; 2: arguments the binding would refuse; 3: the kernel stopped (tq_error()); 4: a kernel that takes work
// by ticket left its counters non-zero.
extern "C" int tq_decode(const uint16_t* q, int B, int Hq, int T, int q_bf16, const uint8_t* cache,
                         const int32_t* block_table, int64_t bt_stride, int64_t bt_cols, const int32_t* seq_lens,
                         float* ws_acc, float* ws_ml, int64_t block_bytes, int v_offset, int s_offset, int H, int page,
                         int num_splits, float k_mul, const uint32_t* tab, int stages) {
  if (Hq % H || page % 16 || page <= 0 || (stages != 2 && stages != 3)) return 2;
  const int G = Hq / H, M = (G * T + 15) / 16;
  if (M < 1 || M > 4) return 2;
  onespark_tq::Params p{};
  p.q = q;
  p.q_bf16 = q_bf16 != 0;
  p.cache = cache;
  p.block_table = block_table;
  p.seq_lens = seq_lens;
  p.ws_acc = ws_acc;
  p.ws_ml = ws_ml;
  p.bt_stride = bt_stride;
  p.block_bytes = block_bytes;
  p.v_offset = v_offset;
  p.s_offset = s_offset;
  p.H = H;
  p.G = G;
  p.T = T;
  if (!onespark_tq::set_page_division(p, static_cast<uint32_t>(page / 16), bt_cols)) return 2;
  p.num_splits = num_splits;
  p.k_mul = k_mul;
  for (int i = 0; i < 4; ++i) p.tab[i] = tab[i];
  std::vector<int> counters;
  set_claim(p, B * H, num_splits, counters);
  using Grid = bool (*)(const onespark_tq::Params&, int, int);
  static const Grid table[2][4] = {{grid<1, 2>, grid<2, 2>, grid<3, 2>, grid<4, 2>},
                                   {grid<1, 3>, grid<2, 3>, grid<3, 3>, grid<4, 3>}};
  if (!table[stages - 2][M - 1](p, B * H, num_splits)) return 3;
  for (int c : counters)
    if (c) return 4;  // the launch's last CTA left a counter for the next launch non-zero
  return 0;
}
