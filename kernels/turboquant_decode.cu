// torch binding of turboquant_decode.cuh (built by turboquant_cuda.py with torch.utils.cpp_extension).
#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "turboquant_decode.cuh"

namespace {

template <int M, int STAGES>
void launch(const onespark_tq::Params& p, int grid_x, int grid_y, cudaStream_t stream) {
  constexpr int smem = onespark_tq::smem_bytes<M, STAGES>();
  // Above 48 KB of shared memory a kernel must ask, once on each device a process launches it on.
  static std::atomic<uint64_t> sized{0};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  TORCH_CHECK(device < 64, "the TurboQuant CUDA kernel takes devices 0..63, got ", device);
  const uint64_t bit = uint64_t{1} << device;
  if (!(sized.load() & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(onespark_tq::decode_k4v4<M, STAGES>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    sized.fetch_or(bit);
  }
  if (grid_x == 0) return;  // a size query (ctas_per_sm)
  onespark_tq::decode_k4v4<M, STAGES><<<dim3(grid_x, grid_y), onespark_tq::NW * 32, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int M, int STAGES>
int resident() {
  launch<M, STAGES>(onespark_tq::Params{}, 0, 0, nullptr);
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, onespark_tq::decode_k4v4<M, STAGES>,
                                                               onespark_tq::NW * 32, onespark_tq::smem_bytes<M, STAGES>()));
  return n;
}

// CTAs of the kernel for `rows` query rows per KV head that one SM holds at once (sizes the split grid).
int64_t ctas_per_sm(int64_t rows, int64_t stages) {
  const int M = static_cast<int>((rows + 15) / 16);
  TORCH_CHECK(M >= 1 && M <= 4 && (stages == 2 || stages == 3), "rows 1..64, stages 2 or 3");
  using Query = int (*)();
  static const Query table[2][4] = {{resident<1, 2>, resident<2, 2>, resident<3, 2>, resident<4, 2>},
                                    {resident<1, 3>, resident<2, 3>, resident<3, 3>, resident<4, 3>}};
  return table[stages - 2][M - 1]();
}

void decode_k4v4(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_table,
                 const torch::Tensor& seq_lens, torch::Tensor& ws_acc, torch::Tensor& ws_ml, int64_t block_bytes,
                 int64_t v_offset, int64_t s_offset, int64_t num_kv_heads, int64_t page, int64_t num_splits,
                 double k_mul, const std::vector<int64_t>& tab, int64_t stages) {
  TORCH_CHECK(q.is_cuda() && (q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16) &&
                  q.is_contiguous() && q.dim() == 4 && q.size(3) == onespark_tq::D,
              "q must be contiguous fp16 or bf16 [B, Hq, T, 256] on the GPU");
  TORCH_CHECK(cache.scalar_type() == torch::kUInt8 && cache.is_contiguous() && cache.device() == q.device(),
              "cache must be contiguous uint8 on q's device");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt && block_table.stride(1) == 1 &&
                  seq_lens.scalar_type() == torch::kInt && seq_lens.is_contiguous(),
              "block_table and seq_lens must be int32 (block_table rows contiguous)");
  TORCH_CHECK(ws_acc.scalar_type() == torch::kFloat && ws_ml.scalar_type() == torch::kFloat, "workspaces are fp32");
  TORCH_CHECK(tab.size() == 4, "tab: 4 words");
  TORCH_CHECK(page % 16 == 0 && page > 0, "page must be a multiple of 16 keys");
  TORCH_CHECK(stages == 2 || stages == 3, "stages: 2 or 3");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2);
  TORCH_CHECK(Hq % num_kv_heads == 0, "query heads must divide into KV heads");
  const int64_t G = Hq / num_kv_heads, M = (G * T + 15) / 16;
  TORCH_CHECK(M >= 1 && M <= 4, "G x T query rows per KV head must be at most 64, got ", G * T);
  TORCH_CHECK(ws_acc.numel() >= B * num_kv_heads * num_splits * G * T * onespark_tq::D &&
                  ws_ml.numel() >= B * num_kv_heads * num_splits * G * T * 2,
              "workspace too small");
  const c10::cuda::CUDAGuard guard(q.device());
  onespark_tq::Params p{};
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  p.q_bf16 = q.scalar_type() == torch::kBFloat16;
  p.cache = cache.data_ptr<uint8_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.ws_acc = ws_acc.data_ptr<float>();
  p.ws_ml = ws_ml.data_ptr<float>();
  p.bt_stride = block_table.stride(0);
  p.block_bytes = block_bytes;
  p.v_offset = static_cast<int>(v_offset);
  p.s_offset = static_cast<int>(s_offset);
  p.H = static_cast<int>(num_kv_heads);
  p.G = static_cast<int>(G);
  p.T = static_cast<int>(T);
  TORCH_CHECK(onespark_tq::set_page_division(p, static_cast<uint32_t>(page / 16), block_table.size(1)),
              "block table too long for the kernel's page division");
  p.num_splits = static_cast<int>(num_splits);
  p.k_mul = static_cast<float>(k_mul);
  for (int i = 0; i < 4; ++i) p.tab[i] = static_cast<uint32_t>(tab[i]);
  const int gx = static_cast<int>(B * num_kv_heads), gy = static_cast<int>(num_splits);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  using Launch = void (*)(const onespark_tq::Params&, int, int, cudaStream_t);
  static const Launch table[2][4] = {{launch<1, 2>, launch<2, 2>, launch<3, 2>, launch<4, 2>},
                                     {launch<1, 3>, launch<2, 3>, launch<3, 3>, launch<4, 3>}};
  table[stages - 2][M - 1](p, gx, gy, stream);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_k4v4", &decode_k4v4);
  m.def("ctas_per_sm", &ctas_per_sm);
}
