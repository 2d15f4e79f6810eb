# The emulated CUDA device (tests only; see tests/native/emu/README.md): the CUDA sources of
# csrc/cuda/ compiled by the host compiler against our own subset of the CUDA runtime, and an
# in-process stand-in for NCCL, so that ctest runs the CUDA kernels and transports without a GPU.
add_library(cuda_emu SHARED tests/native/emu/runtime.cpp tests/native/emu/cost.cpp tests/native/emu/weak.cpp
            tests/native/emu/hb.cpp)
target_include_directories(cuda_emu PUBLIC tests/native/emu/include)
target_compile_definitions(cuda_emu PUBLIC RINGREDUCE_EMU=1)
# '#pragma unroll' is nvcc's; the host compiler ignores it.
# No fused multiply-add where the device code asks for rounded products (__fmul_rn, sym_wire.cu).
target_compile_options(cuda_emu PUBLIC -Wno-unknown-pragmas -ffp-contract=off PRIVATE -Wall -Wextra)
target_link_libraries(cuda_emu PUBLIC Threads::Threads)

# libnccl.so.2 of the stand-in: cuda/nccl/library.cpp dlopens it by path, as it would torch's NCCL.
add_library(nccl_standin SHARED tests/native/emu/nccl_standin.cpp)
set_target_properties(nccl_standin PROPERTIES OUTPUT_NAME nccl VERSION 2 SOVERSION 2)
target_link_libraries(nccl_standin PRIVATE cuda_emu)
target_compile_options(nccl_standin PRIVATE -Wall -Wextra)

# The host code of the CUDA transports: every .cpp under csrc/cuda (setup.py takes the same glob).
file(GLOB_RECURSE RR_CUDA_HOST_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/*.cpp)
add_library(ringreduce_cuda_emu STATIC tests/native/emu/kernels/reduce.cpp
            tests/native/emu/kernels/p2p_kernel.cpp tests/native/emu/kernels/sym_kernel.cpp tests/native/emu/kernels/sym_wire.cpp tests/native/emu/kernels/ll_kernel.cpp tests/native/emu/kernels/hier_divide.cpp tests/native/emu/kernels/hier_wire.cpp ${RR_CUDA_HOST_SOURCES})
target_link_libraries(ringreduce_cuda_emu PUBLIC ringreduce_core cuda_emu ${CMAKE_DL_LIBS})
target_compile_options(ringreduce_cuda_emu PRIVATE -Wall -Wextra -O2)

foreach(t ${RR_CUDA_TESTS} test_nccl test_hier)
  add_executable(${t}_emu tests/native/${t}.cpp)
  target_link_libraries(${t}_emu PRIVATE ringreduce_cuda_emu)
  target_compile_definitions(${t}_emu PRIVATE RR_TEST_NCCL_LIB="$<TARGET_FILE:nccl_standin>"
                             RR_SOURCE_DIR="${CMAKE_CURRENT_SOURCE_DIR}")
  add_dependencies(${t}_emu nccl_standin)
  add_test(NAME ${t}_emu COMMAND ${t}_emu)
  set_tests_properties(${t}_emu PROPERTIES TIMEOUT 600)
endforeach()

# The weak memory mode (tests/native/emu/weak.cpp) on each p2p algorithm, 3 seeds, worlds 2-3: run
# by name (weak_*), one entry per binary that has them; about 2 s in all on the 2-core CI machine.
foreach(w "ring:weak_ring" "workspace:weak_oneshot,weak_twoshot" "registered:weak_registered" "copy:weak_copy"
          "imported:weak_imported" "ll:weak_ll" "wire:weak_wire")
  string(REPLACE ":" ";" w "${w}")
  list(GET w 0 part)
  list(GET w 1 names)
  string(REPLACE "," ";" names "${names}")
  add_test(NAME test_p2p_${part}_emu_weak COMMAND test_p2p_${part}_emu ${names})
  set_tests_properties(test_p2p_${part}_emu_weak PROPERTIES TIMEOUT 300)
endforeach()

# The cost report of the p2p algorithms on the emulated device (benchmarks/gpu_cost.py runs it).
add_executable(gpu_cost_emu benchmarks/gpu_cost_emu.cpp)
target_link_libraries(gpu_cost_emu PRIVATE ringreduce_cuda_emu)
target_include_directories(gpu_cost_emu PRIVATE tests/native/emu/include)
# Issue 25's targets on the counts (4 KiB within 3 round trips, 256 MiB remote bytes and no
# staging, 4 MiB ring slices), checked in every CI run. At 256 MiB auto runs the ring (the check
# names the algorithm it ran), so the ring is not counted a second time there (18 s on 2 cores).
find_package(Python3 COMPONENTS Interpreter)
if(Python3_FOUND)
  add_test(NAME gpu_cost_targets COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/benchmarks/gpu_cost.py
           --world 8 --sizes 4K,256M --algo auto --bin $<TARGET_FILE:gpu_cost_emu> --check)
  add_test(NAME gpu_cost_targets_ring COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/benchmarks/gpu_cost.py
           --world 8 --sizes 4M --algo ring --bin $<TARGET_FILE:gpu_cost_emu> --check)
  add_test(NAME gpu_cost_targets_registered COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/benchmarks/gpu_cost.py
           --world 8 --sizes 256M --algo registered --bin $<TARGET_FILE:gpu_cost_emu> --check)
  # Issue 50's device memory: none at world 1, <= 64 MiB per rank at world 2; barriers per call.
  add_test(NAME gpu_cost_targets_small_worlds COMMAND ${CMAKE_COMMAND} -E env ${Python3_EXECUTABLE}
           ${CMAKE_CURRENT_SOURCE_DIR}/benchmarks/gpu_cost.py --world 2 --sizes 4K,16M --algo auto
           --bin $<TARGET_FILE:gpu_cost_emu> --check)
  add_test(NAME gpu_cost_targets_world1 COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/benchmarks/gpu_cost.py
           --world 1 --sizes 4K --algo auto --bin $<TARGET_FILE:gpu_cost_emu> --check)
  # Issue 52's narrow wire: the wire's bytes between ranks, float32's barriers; two-shot balanced
  # below the workspace's size (it once cut 1 MiB into chunks of 2 MiB: 4x the bytes on rank 0).
  add_test(NAME gpu_cost_targets_wire COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/benchmarks/gpu_cost.py
           --world 8 --sizes 1M,4M --algo auto,twoshot --wire bf16,fp8 --bin $<TARGET_FILE:gpu_cost_emu> --check)
  # Issue 70: the second all_reduce on the same ordinary tensors stages nothing (imported memory).
  add_test(NAME gpu_cost_targets_recurring COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/benchmarks/gpu_cost.py
           --world 8 --sizes 1M,16M --algo auto --recurring --bin $<TARGET_FILE:gpu_cost_emu> --check)
  set_tests_properties(gpu_cost_targets gpu_cost_targets_ring gpu_cost_targets_registered gpu_cost_targets_recurring
                       gpu_cost_targets_small_worlds gpu_cost_targets_world1 gpu_cost_targets_wire
                       PROPERTIES TIMEOUT 600)
endif()
