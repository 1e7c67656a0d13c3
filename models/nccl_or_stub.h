// NCCL for tensor parallelism (models/llama_cuda_tp.cc, the ranks' collectives): the real
// <nccl.h> when the build found NCCL (DEFT_HAVE_NCCL), else stand-ins for the few calls used
// that fail at run time, so a CUDA build without NCCL (e.g. an image base without libnccl) still
// builds and serves one GPU, and --tensor-parallel says why it cannot start.
#pragma once

#if defined(DEFT_HAVE_NCCL)
#include <nccl.h>
#else
#include <cuda_runtime_api.h>

#include <cstddef>

struct ncclComm;
typedef struct ncclComm* ncclComm_t;
typedef enum { ncclSuccess = 0, ncclInvalidUsage = 5 } ncclResult_t;
typedef enum { ncclInt64 = 4, ncclFloat32 = 7 } ncclDataType_t;
typedef enum { ncclSum = 0, ncclMin = 3 } ncclRedOp_t;

inline const char* ncclGetErrorString(ncclResult_t) { return "this build has no NCCL"; }
inline ncclResult_t ncclCommInitAll(ncclComm_t*, int, const int*) { return ncclInvalidUsage; }
inline ncclResult_t ncclCommDestroy(ncclComm_t) { return ncclSuccess; }
inline ncclResult_t ncclAllReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                  ncclComm_t, cudaStream_t) {
  return ncclInvalidUsage;
}
inline ncclResult_t ncclAllGather(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                                  cudaStream_t) {
  return ncclInvalidUsage;
}
#endif
