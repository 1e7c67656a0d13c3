// LlamaCudaRunner over several GPUs (models/llama_cuda.h, load_tensor_parallel): NCCL
// communicators for the devices, one rank runner per GPU, each made on its own thread (its
// shard of the weights read from the checkpoint's mapping straight onto its GPU, its GEMMs
// tuned, its KV pool agreed with the others), and the TensorParallelRunner that drives them.
#include <algorithm>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/device_buffer.h"
#include "kernels/device_scope.h"
#include "kernels/peer_all_reduce.h"
#include "models/llama_checkpoint.h"
#include "models/llama_cuda.h"
#include "models/llama_cuda_state.h"
#include "models/nccl_or_stub.h"
#include "models/step_graphs.h"
#include "models/tensor_parallel.h"
#include "models/tensor_parallel_runner.h"
#include "spdlog/spdlog.h"

namespace deft::models {
namespace {

// What the ranks of one process share, released after the runners that use them: the NCCL
// communicators, and the peer all-reduce's buffers (one on each rank's GPU) and their table.
struct NcclComms {
  std::vector<ncclComm_t> comms;
  std::vector<int> devices;
  std::vector<kernels::DeviceBuffer> peer_buffers;  // [rank], on devices[rank]
  kernels::PeerAllReduceTable peer_table;           // ranks 0: none
  ~NcclComms() {
    for (size_t r = 0; r < peer_buffers.size(); ++r) {
      const kernels::DeviceScope on_device(devices[r]);
      peer_buffers[r] = kernels::DeviceBuffer();
    }
    for (ncclComm_t comm : comms) {
      if (comm != nullptr) ncclCommDestroy(comm);
    }
  }
};

// The peer all-reduce (kernels/peer_all_reduce.h) over `devices` when every pair has peer access:
// access enabled both ways, a zeroed buffer on each GPU for `capacity` floats. False: NCCL only.
bool set_up_peer_all_reduce(NcclComms& shared, std::span<const int> devices, int64_t capacity) {
  if (devices.size() > static_cast<size_t>(kernels::kPeerAllReduceMaxRanks)) return false;
  for (int a : devices) {
    for (int b : devices) {
      int can = 0;
      if (a != b && (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || can == 0)) {
        cudaGetLastError();
        spdlog::info("tensor parallel: no peer access from device {} to {}; NCCL all-reduces", a,
                     b);
        return false;
      }
    }
  }
  for (int a : devices) {
    const kernels::DeviceScope on_device(a);
    for (int b : devices) {
      if (a == b) continue;
      const cudaError_t enabled = cudaDeviceEnablePeerAccess(b, 0);
      if (enabled == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
      } else {
        DEFT_CUDA_CHECK(enabled);
      }
    }
  }
  shared.peer_table.ranks = static_cast<int32_t>(devices.size());
  shared.peer_table.capacity = capacity;
  for (size_t r = 0; r < devices.size(); ++r) {
    const kernels::DeviceScope on_device(devices[r]);
    shared.peer_buffers.emplace_back(
        kernels::peer_all_reduce_buffer_bytes(static_cast<int32_t>(devices.size()), capacity));
    DEFT_CUDA_CHECK(
        cudaMemset(shared.peer_buffers.back().data(), 0, shared.peer_buffers.back().bytes()));
    shared.peer_table.buffers[r] = shared.peer_buffers.back().data();
  }
  return true;
}

absl::StatusOr<std::shared_ptr<NcclComms>> make_comms(std::span<const int> devices) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("llama_cuda: no CUDA device visible");
  }
  if (devices.empty()) {
    return absl::InvalidArgumentError("tensor parallel: no devices given");
  }
  if (std::set<int>(devices.begin(), devices.end()).size() != devices.size()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor parallel: devices ",
                                                   absl::StrJoin(devices, ","),
                                                   " name a GPU twice; one rank per GPU"));
  }
  for (int device : devices) {
    if (device < 0 || device >= count) {
      return absl::InvalidArgumentError(absl::StrCat("tensor parallel: device ", device,
                                                     " outside the ", count, " GPUs visible"));
    }
  }
#if !defined(DEFT_HAVE_NCCL)
  return absl::FailedPreconditionError(
      "tensor parallel: this build has no NCCL (install libnccl-dev and rebuild)");
#endif
  auto comms = std::make_shared<NcclComms>();
  comms->devices.assign(devices.begin(), devices.end());
  comms->comms.resize(devices.size(), nullptr);
  const std::vector<int> list(devices.begin(), devices.end());
  const ncclResult_t result =
      ncclCommInitAll(comms->comms.data(), static_cast<int>(list.size()), list.data());
  if (result != ncclSuccess) {
    comms->comms.assign(devices.size(), nullptr);
    return absl::InternalError(absl::StrCat("tensor parallel: ncclCommInitAll over devices ",
                                            absl::StrJoin(devices, ","),
                                            " failed: ", ncclGetErrorString(result)));
  }
  return comms;
}

// Makes every rank's runner with make_rank(options of rank r), each on its own thread.
absl::StatusOr<std::unique_ptr<engine::ModelRunner>> make_ranks(
    const ModelConfig& config, const LlamaCudaOptions& options, std::span<const int> devices,
    const std::function<absl::StatusOr<std::unique_ptr<LlamaCudaRunner>>(const LlamaCudaOptions&)>&
        make_rank) {
  const int32_t ranks = static_cast<int32_t>(devices.size());
  if (absl::Status status = check_tensor_parallel(config, ranks); !status.ok()) return status;
  absl::StatusOr<std::shared_ptr<NcclComms>> comms = make_comms(devices);
  if (!comms.ok()) return comms.status();
  // Residual all-reduces of graph-sized steps: kMaxGraphRows rows of hidden floats.
  const bool peer =
      options.peer_all_reduce &&
      set_up_peer_all_reduce(**comms, devices, int64_t{kMaxGraphRows} * config.hidden_size);
  std::vector<absl::StatusOr<std::unique_ptr<LlamaCudaRunner>>> made;
  for (size_t r = 0; r < devices.size(); ++r) made.emplace_back(absl::UnknownError("not made"));
  TensorParallelRunner::run_parallel(ranks, [&](int32_t r) {
    LlamaCudaOptions rank_options = options;
    rank_options.device = devices[static_cast<size_t>(r)];
    rank_options.tp = {.rank = r, .ranks = ranks};
    rank_options.nccl_comm = (*comms)->comms[static_cast<size_t>(r)];
    rank_options.peer_table = peer ? &(*comms)->peer_table : nullptr;
    made[static_cast<size_t>(r)] = make_rank(rank_options);
  });
  std::vector<std::unique_ptr<engine::ModelRunner>> runners;
  for (auto& rank : made) {
    if (!rank.ok()) return rank.status();
    runners.push_back(std::move(*rank));
  }
  spdlog::info("llama_cuda: tensor parallel over {} GPUs (devices {}), {} KV slots per rank", ranks,
               absl::StrJoin(devices, ","), runners[0]->info().num_kv_slots);
  return std::make_unique<TensorParallelRunner>(std::move(runners), std::move(*comms));
}

}  // namespace

bool LlamaCudaRunner::tensor_parallel_available() {
#if defined(DEFT_HAVE_NCCL)
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<engine::ModelRunner>> LlamaCudaRunner::load_tensor_parallel(
    const std::filesystem::path& model_dir, const LlamaCudaOptions& options,
    std::span<const int> devices) {
  absl::StatusOr<ModelConfig> config = load_model_config(model_dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<SafetensorsSet> checkpoint = SafetensorsSet::open(model_dir);
  if (!checkpoint.ok()) return checkpoint.status();
  return create_tensor_parallel(*config, *checkpoint, options, devices, model_dir.string());
}

absl::StatusOr<std::unique_ptr<engine::ModelRunner>> LlamaCudaRunner::create_tensor_parallel(
    const ModelConfig& config, const SafetensorsSet& checkpoint, const LlamaCudaOptions& options,
    std::span<const int> devices, std::string name) {
  return make_ranks(config, options, devices, [&](const LlamaCudaOptions& rank_options) {
    return create(config, checkpoint, rank_options, name);
  });
}

absl::StatusOr<std::unique_ptr<engine::ModelRunner>> LlamaCudaRunner::create_random_tensor_parallel(
    const ModelConfig& config, const LlamaCudaOptions& options, std::span<const int> devices,
    uint64_t seed) {
  return make_ranks(config, options, devices, [&](const LlamaCudaOptions& rank_options) {
    return create_random(config, rank_options, seed, "random");
  });
}

}  // namespace deft::models
