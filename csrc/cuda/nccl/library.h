// NCCL as the process already has it: the libnccl.so.2 torch loaded, opened with dlopen (no second
// copy, no link flags), and the few entry points this transport calls. Included by .cpp files
// only, so that the endpoint's header needs no nccl.h.
#pragma once
#include <nccl.h>

#include <string>

namespace ringreduce::cuda::nccl {

// The entry points, once: (field of Api, NCCL's name).
#define RR_NCCL_FUNCTIONS(X)                                                                     \
  X(get_version, ncclGetVersion) X(get_unique_id, ncclGetUniqueId)                               \
  X(init_rank_config, ncclCommInitRankConfig) X(finalize, ncclCommFinalize)                      \
  X(destroy, ncclCommDestroy) X(abort, ncclCommAbort) X(async_error, ncclCommGetAsyncError)      \
  X(error_string, ncclGetErrorString) X(last_error, ncclGetLastError)                            \
  X(group_start, ncclGroupStart) X(group_end, ncclGroupEnd) X(send, ncclSend) X(recv, ncclRecv)

struct Api {
#define RR_NCCL_FIELD(field, name) decltype(&name) field = nullptr;
  RR_NCCL_FUNCTIONS(RR_NCCL_FIELD)
#undef RR_NCCL_FIELD
  int version = 0;
};

// The library, loaded on first use (once per process; lib: a path to try when no libnccl.so.2 is
// loaded yet, "" for the default search). Throws RingError when it is missing or too old.
const Api& api(const std::string& lib);
// NCCL's words for res, with the communicator's last error in brackets where it has one.
std::string error_text(const Api& nc, ncclResult_t res, ncclComm_t comm);

}  // namespace ringreduce::cuda::nccl
