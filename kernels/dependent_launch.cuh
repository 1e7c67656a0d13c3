// Programmatic dependent launch (sm_90): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start before the kernel ahead of it in
// the stream has finished, once every CTA of that kernel has called allow_dependent_launch() (or
// exited). It must call wait_for_prerequisite_grid() before reading anything that kernel writes
// or writing anything it reads; data written before that kernel started (a plan, weights) may be
// read earlier. Both are no-ops where unsupported or when the launch had no such attribute.
#pragma once

namespace deft::kernels::detail {

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace deft::kernels::detail
