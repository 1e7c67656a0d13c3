// Stage 1's work division (kernels/deft_schedule.h): host code only, built with or without CUDA.
#include "kernels/deft_schedule.h"

#include <algorithm>
#include <bit>
#include <utility>

namespace deft::kernels {

int32_t deft_attention_row_slices(int32_t max_task_entries, const AttentionDims& dims) {
  const int32_t max_rows = std::max(1, max_task_entries * dims.group_size());
  const int32_t passes = (max_rows + kStage1PassRows - 1) / kStage1PassRows;
  return std::min(passes, kMaxRowSlices);
}

void build_stage1_ctas(const AttentionPlanView& host_plan, const AttentionDims& dims,
                       std::vector<Stage1Cta>& ctas) {
  ctas.clear();
  const int32_t num_tasks = host_plan.task_entry_begin != nullptr ? host_plan.num_tasks : 0;
  // The tasks are ordered (a task's CTAs all have its work), not the CTAs: a step's host time.
  std::vector<std::pair<int32_t, int32_t>> work_task(num_tasks);  // (work, task)
  for (int32_t task = 0; task < num_tasks; ++task) {
    const int32_t tokens = host_plan.task_kv_begin != nullptr
                               ? host_plan.task_kv_end[task] - host_plan.task_kv_begin[task]
                               : 0;
    const bool masked =
        host_plan.task_mask_begin != nullptr && host_plan.task_mask_begin[task] >= 0;
    const int32_t tiles = (tokens + kStage1TileTokens - 1) / kStage1TileTokens;
    work_task[task] = {tiles * (masked ? 2 : 1) + kStage1CtaOverheadTiles, task};
  }
  // Longest first, ties in task order (std::sort: no temporary buffer, unlike stable_sort).
  std::sort(work_task.begin(), work_task.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  for (const auto& [work, task] : work_task) {
    const int32_t slices = deft_attention_row_slices(
        host_plan.task_entry_begin[task + 1] - host_plan.task_entry_begin[task], dims);
    for (int32_t head = 0; head < dims.num_kv_heads; ++head) {
      for (int32_t slice = 0; slice < slices; ++slice) {
        ctas.push_back({.task = task, .kv_head = head, .slice = slice, .slices = slices});
      }
    }
  }
}

int32_t pow2_bucket(int32_t count) {
  return count <= 1 ? count : static_cast<int32_t>(std::bit_ceil(static_cast<uint32_t>(count)));
}

int32_t task_bucket(int32_t count) {
  if (count <= 16) return pow2_bucket(count);
  const int32_t step = static_cast<int32_t>(std::bit_floor(static_cast<uint32_t>(count))) / 8;
  return (count + step - 1) / step * step;
}

}  // namespace deft::kernels
