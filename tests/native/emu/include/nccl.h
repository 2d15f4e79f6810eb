// The NCCL API subset that csrc/cuda/nccl/ uses, declared for the in-process NCCL stand-in of the
// emulated device (tests only; tests/native/emu/nccl_standin.cpp). Names, result codes and
// signatures follow NCCL's public API so that cuda/nccl/ compiles unchanged against either.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda_runtime.h"

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct ncclComm* ncclComm_t;
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

typedef enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9
} ncclDataType_t;

#define NCCL_CONFIG_UNDEF_INT (-2147483647 - 1)
typedef struct {
  size_t size;
  unsigned magic;
  unsigned version;
  int blocking;  // 0: calls return ncclInProgress and complete in the background
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER {sizeof(ncclConfig_t), 0xcafebeef, 21800, NCCL_CONFIG_UNDEF_INT}

extern "C" {
ncclResult_t ncclGetVersion(int* version);
ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state);
const char* ncclGetErrorString(ncclResult_t result);
const char* ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream);

// Test hooks of the stand-in (not NCCL's): the next call of `function` (e.g. "ncclRecv") on any
// thread returns `result`; how deep the calling thread's group nesting is; how many operations
// (a group, or a send/recv outside one) were enqueued so far, all communicators together.
void standin_fail_next(const char* function, ncclResult_t result);
int standin_group_depth();
uint64_t standin_groups();
}
