// Host side of the DeFT attention kernels: plan upload, scratch buffers, the occupancy queries
// (stage 2's batch, deft_attention_resident_ctas of kernels/deft_schedule.h), and the one place
// that instantiates the kernel templates of kernels/deft_attention.cuh and merge_states.cuh
// (bf16/fp16 x head_dim 64/128). How stage 1's work is cut (its grid) is kernels/deft_schedule.cc's.
#include <algorithm>
#include <array>
#include <cstring>
#include <iterator>
#include <limits>

#include "kernels/check.h"
#include "kernels/cuda_check.h"
#include "kernels/deft_attention.cuh"
#include "kernels/deft_attention.h"
#include "kernels/merge_states.cuh"
#include "kernels/deft_schedule.h"
#include "kernels/device_info.h"
#include "kernels/per_device.h"

namespace deft::kernels {

namespace {

constexpr size_t kSectionAlign = 16;

size_t align_up(size_t bytes) {
  return (bytes + kSectionAlign - 1) / kSectionAlign * kSectionAlign;
}

template <typename T>
using Stage2Kernel = void (*)(AttentionPlanView, const T*, const float*, T*, int32_t,
                              WeightPrefetch);

template <typename T>
struct Stage2Choice {
  int32_t batch;
  Stage2Kernel<T> kernel;
  int64_t resident;  // CTAs resident at once on the device
};

// Stage 2's kernel and batch (O rows per round trip; see the kernel): `batch` if given (32, 16
// or 8); else, among the batches whose grid of `ctas` CTAs is resident all at once (occupancy
// measured once per kernel and device), the smallest that takes a query's `max_partials` in one
// trip (fewer registers: more of its CTAs fit beside stage 1's last ones, which a programmatic
// launch overlaps), else the largest; 8 when none fits.
template <typename T, int kHeadDim>
Stage2Choice<T> stage2_choice_for(int64_t ctas, int32_t max_partials, int32_t batch) {
  using Choice = Stage2Choice<T>;
  static PerDevice<std::array<Choice, 3>> per_device;
  const std::array<Choice, 3> choices = per_device.get([] {
    const int32_t sms = current_device_sm_count();
    std::array<Choice, 3> c = {
        Choice{32, &detail::deft_attention_stage2_kernel<T, kHeadDim, 32>, 0},
        Choice{16, &detail::deft_attention_stage2_kernel<T, kHeadDim, 16>, 0},
        Choice{8, &detail::deft_attention_stage2_kernel<T, kHeadDim, 8>, 0}};
    for (Choice& choice : c) {
      int per_sm = 0;
      DEFT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, choice.kernel,
                                                                    detail::kStage2Threads, 0));
      choice.resident = int64_t{per_sm} * sms;
    }
    return c;
  });
  if (batch > 0) {
    for (const Choice& choice : choices) {
      if (choice.batch == batch) return choice;
    }
  }
  // choices: largest batch first.
  const Choice* pick = nullptr;
  for (const Choice& choice : choices) {
    if (ctas > choice.resident) continue;
    if (pick == nullptr || choice.batch >= max_partials) pick = &choice;
  }
  return pick != nullptr ? *pick : choices.back();
}

// Stage 2's grid without the prefetch CTAs: a CTA per query and group of kStage2Warps heads.
int64_t stage2_ctas(int32_t num_queries, const AttentionDims& dims) {
  return int64_t{num_queries} *
         ((dims.num_q_heads + detail::kStage2Warps - 1) / detail::kStage2Warps);
}

// Stage 1's kernel with its dynamic shared-memory limit raised (not a stream operation: done once
// per instantiation and device, before any capture the caller may start later).
template <typename T, int kHeadDim, bool kWgmmaPasses>
auto stage1_kernel() {
  auto* stage1 = &detail::deft_attention_stage1_kernel<T, kHeadDim, kWgmmaPasses>;
  static PerDevice<bool> smem_configured;
  smem_configured.get([&] {
    DEFT_CUDA_CHECK(cudaFuncSetAttribute(stage1, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         detail::Stage1Smem<kHeadDim>::kBytes));
    return true;
  });
  return stage1;
}

template <typename T, int kHeadDim>
int32_t resident_ctas_typed() {
  int per_sm = 0;
  DEFT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, stage1_kernel<T, kHeadDim, false>(), detail::kStage1Threads,
      detail::Stage1Smem<kHeadDim>::kBytes));
  return per_sm * current_device_sm_count();
}

template <typename T, int kHeadDim>
void launch_typed(const AttentionPlanView& plan, const PlanShape& shape, const AttentionDims& dims,
                  const void* q, const void* k_cache, const void* v_cache, void* partial_out,
                  float* partial_lse, void* out, cudaStream_t stream, bool stage2,
                  int32_t stage2_batch, const WeightPrefetch& prefetch) {
  auto* stage1 = deft_attention_wgmma_passes(shape, dims) ? stage1_kernel<T, kHeadDim, true>()
                                                          : stage1_kernel<T, kHeadDim, false>();
  constexpr int kSmemBytes = detail::Stage1Smem<kHeadDim>::kBytes;

  const int group = dims.group_size();
  detail::Stage1Params params{};
  params.plan = plan;
  params.q = q;
  params.k_cache = k_cache;
  params.v_cache = v_cache;
  params.partial_out = partial_out;
  params.partial_lse = partial_lse;
  params.out = out;
  params.num_q_heads = dims.num_q_heads;
  params.num_kv_heads = dims.num_kv_heads;
  params.group_size = group;
  params.scale_log2 = dims.softmax_scale * 1.4426950408889634f;

  const int64_t ctas = plan.num_stage1_ctas;  // the plan's table (build_stage1_ctas)
  // Programmatic dependent launch: stage 1's CTAs start (and read the plan) while the kernel
  // before them finishes; they wait for it in the kernel before reading Q or the KV.
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(detail::kStage1Threads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  DEFT_CUDA_CHECK(cudaLaunchKernelEx(&config, stage1, params));
  DEFT_CUDA_CHECK_LAUNCH();

  // Stage 2 spans every query (a launch shape fixed by the plan's size); queries with a single
  // partial return at once. Skipped entirely when no query has two partials (the caller's
  // decision, see DeftStage2).
  if (stage2) {
    const dim3 grid2(static_cast<unsigned>(plan.num_queries),
                     static_cast<unsigned>((dims.num_q_heads + detail::kStage2Warps - 1) /
                                           detail::kStage2Warps));
    // The prefetch's CTAs (past the queries in x) wait for stage 1 too.
    const PrefetchGrid with_prefetch =
        with_prefetch_ctas("launch_deft_attention", prefetch, static_cast<int32_t>(grid2.x),
                           static_cast<int32_t>(grid2.y));
    // Programmatic dependent launch: stage 2's CTAs start (and read the plan) while stage 1's
    // last CTAs finish; they wait for stage 1's results in the kernel (griddepcontrol.wait).
    config.gridDim = dim3(static_cast<unsigned>(with_prefetch.blocks), grid2.y);
    config.blockDim = dim3(detail::kStage2Threads);
    config.dynamicSmemBytes = 0;
    DEFT_CUDA_CHECK(cudaLaunchKernelEx(
        &config,
        stage2_choice_for<T, kHeadDim>(stage2_ctas(plan.num_queries, dims), shape.max_query_entries,
                                       stage2_batch)
            .kernel,
        plan, static_cast<const T*>(partial_out), static_cast<const float*>(partial_lse),
        static_cast<T*>(out), dims.num_q_heads, with_prefetch.prefetch));
    DEFT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

// ---- DevicePlan ---------------------------------------------------------------------------------

DevicePlan::DevicePlan() {
  DEFT_CUDA_CHECK(cudaEventCreateWithFlags(&upload_done_, cudaEventDisableTiming));
}

DevicePlan::~DevicePlan() {
  if (upload_pending_) cudaEventSynchronize(upload_done_);
  cudaEventDestroy(upload_done_);
}

void DevicePlan::upload(const AttentionPlanView& host_plan, const AttentionDims& dims,
                        cudaStream_t stream, std::span<const unsigned char> extra) {
  upload_sections(host_plan, dims, nullptr, stream, extra);
}

void DevicePlan::upload_padded(const AttentionPlanView& host_plan, const AttentionDims& dims,
                               const PlanCapacity& capacity, cudaStream_t stream,
                               std::span<const unsigned char> extra) {
  DEFT_CHECK(capacity.holds(host_plan),
             "DevicePlan::upload_padded: the capacity does not hold "
             "the plan (%d queries, %d tasks, %d entries, %d KV indices, %d mask words)",
             host_plan.num_queries, host_plan.num_tasks, host_plan.num_entries,
             host_plan.num_kv_indices, host_plan.num_mask_words);
  upload_sections(host_plan, dims, &capacity, stream, extra);
}

void DevicePlan::stage_padded(const AttentionPlanView& host_plan, const AttentionDims& dims,
                              const PlanCapacity& capacity, std::span<const unsigned char> extra) {
  DEFT_CHECK(capacity.holds(host_plan),
             "DevicePlan::stage_padded: the capacity does not hold "
             "the plan (%d queries, %d tasks, %d entries, %d KV indices, %d mask words)",
             host_plan.num_queries, host_plan.num_tasks, host_plan.num_entries,
             host_plan.num_kv_indices, host_plan.num_mask_words);
  wait_for_staging();  // an upload() may have left a copy of it in flight
  stage_sections(host_plan, dims, &capacity, extra);
}

void DevicePlan::wait_for_staging() {
  if (upload_pending_) DEFT_CUDA_CHECK(cudaEventSynchronize(upload_done_));
  upload_pending_ = false;
}

void DevicePlan::enqueue_copy(cudaStream_t stream) const {
  DEFT_CUDA_CHECK(cudaMemcpyAsync(device_.data(), staging_.data(), staged_bytes_,
                                  cudaMemcpyHostToDevice, stream));
}

void DevicePlan::upload_sections(const AttentionPlanView& host_plan, const AttentionDims& dims,
                                 const PlanCapacity* capacity, cudaStream_t stream,
                                 std::span<const unsigned char> extra) {
  wait_for_staging();  // it may still be feeding the previous upload's copy
  stage_sections(host_plan, dims, capacity, extra);
  enqueue_copy(stream);
  DEFT_CUDA_CHECK(cudaEventRecord(upload_done_, stream));
  upload_pending_ = true;
}

void DevicePlan::stage_sections(const AttentionPlanView& host_plan, const AttentionDims& dims,
                                const PlanCapacity* capacity,
                                std::span<const unsigned char> extra) {
  build_stage1_ctas(host_plan, dims, stage1_ctas_);
  const int32_t num_ctas = static_cast<int32_t>(stage1_ctas_.size());
  // Element counts of the sections: the plan's, or the capacity's when padding.
  AttentionPlanView sizes = host_plan;
  sizes.num_stage1_ctas = num_ctas;
  sizes.stage1_kv_heads = dims.num_kv_heads;
  if (capacity != nullptr) {
    sizes.num_queries = capacity->queries;
    sizes.num_tasks = capacity->tasks;
    sizes.num_entries = capacity->entries;
    sizes.num_kv_indices = capacity->kv_indices;
    sizes.num_mask_words = capacity->mask_words;
    sizes.num_stage1_ctas = capacity->stage1_ctas;
    DEFT_CHECK(capacity->stage1_ctas <= 0 || num_ctas <= capacity->stage1_ctas,
               "the capacity's %d stage-1 CTAs do not hold the plan's %d", capacity->stage1_ctas,
               num_ctas);
  }
  struct Section {
    const void* source;
    size_t bytes;
    size_t offset;
  };
  const auto i32 = [](int32_t count) { return static_cast<size_t>(std::max(count, 0)) * 4; };
  // Section i holds `bytes` (sized by `sizes`), of which the plan fills `used`.
  Section sections[] = {
      {host_plan.kv_slots, i32(sizes.num_kv_indices), 0},
      {host_plan.task_kv_begin, i32(sizes.num_tasks), 0},
      {host_plan.task_kv_end, i32(sizes.num_tasks), 0},
      {host_plan.task_entry_begin, i32(sizes.num_tasks + 1), 0},
      {host_plan.task_mask_begin, i32(sizes.num_tasks), 0},
      {host_plan.mask_words, static_cast<size_t>(std::max(sizes.num_mask_words, 0)) * 8, 0},
      {host_plan.entry_query, i32(sizes.num_entries), 0},
      {host_plan.query_entry_begin, i32(sizes.num_queries + 1), 0},
      {host_plan.query_entries, i32(sizes.num_entries), 0},
      {host_plan.prefill_runs,
       static_cast<size_t>(std::max(host_plan.num_prefill_runs, 0)) * sizeof(PrefillRun), 0},
      {host_plan.task_kv_ready, i32(sizes.num_tasks), 0},
      {stage1_ctas_.data(),
       static_cast<size_t>(std::max(sizes.num_stage1_ctas, 0)) * sizeof(Stage1Cta), 0},
  };
  const size_t used[] = {
      i32(host_plan.num_kv_indices),
      i32(host_plan.num_tasks),
      i32(host_plan.num_tasks),
      i32(host_plan.num_tasks + 1),
      i32(host_plan.num_tasks),
      static_cast<size_t>(std::max(host_plan.num_mask_words, 0)) * 8,
      i32(host_plan.num_entries),
      i32(host_plan.num_queries + 1),
      i32(host_plan.num_entries),
      static_cast<size_t>(std::max(host_plan.num_prefill_runs, 0)) * sizeof(PrefillRun),
      i32(host_plan.num_tasks),
      std::min(stage1_ctas_.size(), static_cast<size_t>(std::max(sizes.num_stage1_ctas, 0))) *
          sizeof(Stage1Cta)};
  size_t total = align_up(extra.size());  // extra first: extra() is the buffer's start
  for (Section& section : sections) {
    section.offset = total;
    total += align_up(section.bytes);
  }
  total = std::max<size_t>(total, kSectionAlign);

  staging_.reserve(total);
  device_.reserve(total);
  staged_bytes_ = total;

  auto* staging = staging_.as<unsigned char>();
  if (!extra.empty()) std::memcpy(staging, extra.data(), extra.size());
  for (size_t i = 0; i < std::size(sections); ++i) {
    if (used[i] > 0 && sections[i].source != nullptr) {
      std::memcpy(staging + sections[i].offset, sections[i].source, used[i]);
    }
  }
  if (host_plan.task_kv_ready == nullptr) {
    // No readiness known: no task's KV may be read before the kernel ahead has finished.
    std::memset(staging + sections[10].offset, 0, sections[10].bytes);
  }
  if (capacity != nullptr) {
    // Padding: empty tasks (no KV, entries [num_entries, num_entries)), unmasked; queries
    // without entries. Padded kv_slots, mask words and entries are never read.
    const auto fill = [&](int section, int32_t from, int32_t to, int32_t value) {
      auto* at = reinterpret_cast<int32_t*>(staging + sections[section].offset);
      std::fill(at + from, at + to, value);
    };
    const int32_t tasks = std::max(host_plan.num_tasks, 0);
    const int32_t queries = std::max(host_plan.num_queries, 0);
    const int32_t entries = std::max(host_plan.num_entries, 0);
    fill(1, tasks, capacity->tasks, 0);
    fill(2, tasks, capacity->tasks, 0);
    fill(3, tasks + 1, capacity->tasks + 1, entries);
    if (host_plan.task_entry_begin == nullptr) fill(3, 0, 1, 0);
    fill(4, tasks, capacity->tasks, -1);
    fill(10, tasks, capacity->tasks, 0);
    fill(7, queries + 1, capacity->queries + 1, entries);
    if (host_plan.query_entry_begin == nullptr) fill(7, 0, 1, 0);
    // CTAs past the plan's: padding (task -1), returning at once.
    auto* ctas = reinterpret_cast<Stage1Cta*>(staging + sections[11].offset);
    std::fill(ctas + std::min(num_ctas, sizes.num_stage1_ctas), ctas + sizes.num_stage1_ctas,
              Stage1Cta{});
  }
  auto* base = device_.as<unsigned char>();
  const auto at = [&](int index) { return base + sections[index].offset; };
  device_view_ = sizes;
  device_view_.kv_slots = reinterpret_cast<const int32_t*>(at(0));
  device_view_.task_kv_begin = reinterpret_cast<const int32_t*>(at(1));
  device_view_.task_kv_end = reinterpret_cast<const int32_t*>(at(2));
  device_view_.task_entry_begin = reinterpret_cast<const int32_t*>(at(3));
  device_view_.task_mask_begin = reinterpret_cast<const int32_t*>(at(4));
  device_view_.mask_words = reinterpret_cast<const uint64_t*>(at(5));
  device_view_.entry_query = reinterpret_cast<const int32_t*>(at(6));
  device_view_.query_entry_begin = reinterpret_cast<const int32_t*>(at(7));
  device_view_.query_entries = reinterpret_cast<const int32_t*>(at(8));
  device_view_.prefill_runs = reinterpret_cast<const PrefillRun*>(at(9));
  device_view_.task_kv_ready = reinterpret_cast<const int32_t*>(at(10));
  device_view_.stage1_ctas =
      sizes.num_stage1_ctas > 0 ? reinterpret_cast<const Stage1Cta*>(at(11)) : nullptr;

  host_prefill_runs_.assign(host_plan.prefill_runs,
                            host_plan.prefill_runs + std::max(host_plan.num_prefill_runs, 0));
  shape_ = plan_shape(host_plan);
}

PlanShape plan_shape(const AttentionPlanView& host_plan) {
  PlanShape shape;
  // A view may leave the entry arrays null when it has no tasks (a prefill-only plan built by
  // hand): no entries then.
  for (int32_t task = 0; host_plan.task_entry_begin != nullptr && task < host_plan.num_tasks;
       ++task) {
    shape.max_task_entries = std::max(shape.max_task_entries, host_plan.task_entry_begin[task + 1] -
                                                                  host_plan.task_entry_begin[task]);
  }
  for (int32_t query = 0; host_plan.query_entry_begin != nullptr && query < host_plan.num_queries;
       ++query) {
    shape.max_query_entries =
        std::max(shape.max_query_entries,
                 host_plan.query_entry_begin[query + 1] - host_plan.query_entry_begin[query]);
  }
  return shape;
}

// ---- DeftAttentionBuffers
// ------------------------------------------------------------------------

void DeftAttentionBuffers::reserve(int32_t num_entries, const AttentionDims& dims) {
  const size_t rows = static_cast<size_t>(std::max(num_entries, 1)) * dims.num_q_heads;
  partial_out_.reserve(rows * dims.head_dim * kPartialElementBytes);
  partial_lse_.reserve(rows * sizeof(float));
}

// ---- launch ------------------------------------------------------------------------------------

bool deft_attention_supported(const AttentionDims& dims) {
  // softmax_scale > 0: stage 1 takes score maxima before scaling.
  return (dims.head_dim == 64 || dims.head_dim == 128) && dims.softmax_scale > 0.0f &&
         dims.num_kv_heads > 0 && dims.num_q_heads > 0 && dims.num_q_heads % dims.num_kv_heads == 0;
}

bool deft_attention_wgmma_passes(const PlanShape& shape, const AttentionDims& dims) {
  return shape.batch_invariant ||
         int64_t{shape.max_task_entries} * dims.group_size() > detail::kMmaRows;
}

bool deft_attention_batch_invariant_available() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  static PerDevice<bool> available;
  return available.get([] {
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(&attributes,
                              &detail::deft_attention_stage1_kernel<__nv_bfloat16, 128, true>) !=
        cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attributes.binaryVersion == 90;  // DEFT_HAS_WGMMA: the sm_90a machine code
  });
}

namespace {

// body(type tag, head-dim tag) for the instantiation of `dtype` (bf16, else fp16) and `head_dim`
// (64, else 128; deft_attention_supported admits no other), returning what body returns.
template <typename Body>
auto with_kernel_types(DType dtype, int32_t head_dim, Body&& body) {
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if (dtype == DType::kBf16) {
    return head_dim == 64 ? body(__nv_bfloat16{}, D64{}) : body(__nv_bfloat16{}, D128{});
  }
  return head_dim == 64 ? body(__half{}, D64{}) : body(__half{}, D128{});
}

}  // namespace

int32_t deft_attention_resident_ctas(const AttentionDims& dims, DType dtype) {
  if (!deft_attention_supported(dims)) return 0;
  return with_kernel_types(dtype, dims.head_dim, [](auto type_tag, auto head_dim_tag) {
    return resident_ctas_typed<decltype(type_tag), decltype(head_dim_tag)::value>();
  });
}

int32_t deft_attention_stage2_batch(const PlanShape& shape, int32_t num_queries,
                                    const AttentionDims& dims, DType dtype) {
  DEFT_CHECK(deft_attention_supported(dims),
             "deft_attention_stage2_batch: unsupported head_dim %d, heads %d / %d KV or "
             "softmax_scale %g <= 0",
             dims.head_dim, dims.num_q_heads, dims.num_kv_heads, dims.softmax_scale);
  return with_kernel_types(dtype, dims.head_dim, [&](auto type_tag, auto head_dim_tag) {
    return stage2_choice_for<decltype(type_tag), decltype(head_dim_tag)::value>(
               stage2_ctas(num_queries, dims), shape.max_query_entries, 0)
        .batch;
  });
}

void launch_deft_attention(const AttentionPlanView& device_plan, const PlanShape& shape,
                           const AttentionDims& dims, DType dtype, const void* q,
                           const void* k_cache, const void* v_cache, void* partial_out,
                           float* partial_lse, void* out, cudaStream_t stream, DeftStage2 stage2,
                           int32_t stage2_batch, const WeightPrefetch& prefetch) {
  DEFT_CHECK(deft_attention_supported(dims),
             "launch_deft_attention: unsupported head_dim %d, heads %d / %d KV or softmax_scale "
             "%g <= 0",
             dims.head_dim, dims.num_q_heads, dims.num_kv_heads, dims.softmax_scale);
  DEFT_CHECK(shape.max_task_entries <= 0 || shape.max_task_entries * dims.group_size() <= (1 << 24),
             "launch_deft_attention: task too large: %d entries x group %d", shape.max_task_entries,
             dims.group_size());
  DEFT_CHECK(stage2_batch == 0 || stage2_batch == 8 || stage2_batch == 16 || stage2_batch == 32,
             "launch_deft_attention: stage 2 batch must be 0 (automatic), 8, 16 or 32, not %d",
             stage2_batch);
  if (device_plan.num_tasks == 0 || device_plan.num_queries == 0) return;
  DEFT_CHECK(device_plan.stage1_ctas != nullptr && device_plan.num_stage1_ctas >= 1,
             "launch_deft_attention: the plan has no stage-1 grid (upload it with DevicePlan); "
             "CTAs %d",
             device_plan.num_stage1_ctas);
  DEFT_CHECK(device_plan.stage1_kv_heads == dims.num_kv_heads,
             "launch_deft_attention: the plan's stage-1 grid was built for %d KV heads, not %d",
             device_plan.stage1_kv_heads, dims.num_kv_heads);
  // Known on the host only when every query has an entry (num_entries > num_queries): a plan
  // with prefill runs (rows without entries) always runs it.
  const bool run_stage2 =
      stage2 == DeftStage2::kAlways ||
      (stage2 == DeftStage2::kIfMerging &&
       (device_plan.num_entries > device_plan.num_queries || device_plan.num_prefill_runs > 0));
  with_kernel_types(dtype, dims.head_dim, [&](auto type_tag, auto head_dim_tag) {
    launch_typed<decltype(type_tag), decltype(head_dim_tag)::value>(
        device_plan, shape, dims, q, k_cache, v_cache, partial_out, partial_lse, out, stream,
        run_stage2, stage2_batch, prefetch);
  });
}

}  // namespace deft::kernels
