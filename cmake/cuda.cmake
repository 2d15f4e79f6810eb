# The CUDA kernels (torch-free) and their native test. Included by CMakeLists.txt when a CUDA
# compiler is found; the test skips itself (exit 0) on a machine without a GPU.
# Architectures as in setup.py (sm_80, sm_90); override with -DCMAKE_CUDA_ARCHITECTURES=...
if(NOT CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 80 90)
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)

# The nccl transport's host code needs NCCL's headers, which the GPU native test does without (a
# pip install of torch does not always bring them): the host sources but those.
set(RR_CUDA_HOST_NO_NCCL ${RR_CUDA_HOST_SOURCES})
list(FILTER RR_CUDA_HOST_NO_NCCL EXCLUDE REGEX "/csrc/cuda/nccl/")
add_library(ringreduce_cuda STATIC csrc/cuda/nccl/reduce.cu csrc/cuda/p2p/ring_kernel.cu csrc/cuda/p2p/sym_kernel.cu csrc/cuda/p2p/sym_wire.cu csrc/cuda/p2p/ll_kernel.cu csrc/cuda/hier/divide.cu csrc/cuda/hier/wire.cu
            ${RR_CUDA_HOST_NO_NCCL})
target_link_libraries(ringreduce_cuda PUBLIC ringreduce_core CUDA::cudart)
# --expt-relaxed-constexpr: as setup.py passes it (constexpr host helpers in device code).
target_compile_options(ringreduce_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xcompiler=-Wall>
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)

add_executable(test_cuda_kernels tests/native/test_cuda_kernels.cpp)
target_link_libraries(test_cuda_kernels PRIVATE ringreduce_cuda)
add_test(NAME test_cuda_kernels COMMAND test_cuda_kernels)
set_tests_properties(test_cuda_kernels PROPERTIES TIMEOUT 600)

# The handshake microbenchmark that benchmarks/gpu_lease.sh runs on a GPU: built here so that a
# change that breaks it shows before a lease.
add_executable(gpu_handshake benchmarks/gpu_handshake.cu)
