#include "cuda/nccl/library.h"

#include <dlfcn.h>

#include <mutex>
#include <type_traits>

#include "cuda/nccl/endpoint.h"
#include "ring/call.h"

namespace ringreduce::cuda::nccl {

const Api& api(const std::string& lib) {
  static std::once_flag once;
  static Api a;
  static std::string error;
  std::call_once(once, [&] {
    // The copy torch loaded first (same soname), then the given path, then the default search.
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (!h && !lib.empty()) h = dlopen(lib.c_str(), RTLD_NOW);
    if (!h) h = dlopen("libnccl.so.2", RTLD_NOW);
    if (!h) {
      const char* e = dlerror();
      error = std::string("ringreduce: cannot load libnccl.so.2 (") + (e ? e : "?") +
              "); the nccl transport needs the NCCL that comes with torch (nvidia-nccl-cu13)";
      return;
    }
    bool ok = true;
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn) {
        ok = false;
        error = std::string("ringreduce: libnccl.so.2 lacks ") + name + " (NCCL >= 2.18 needed)";
      }
    };
#define RR_NCCL_GET(field, name) get(a.field, #name);
    RR_NCCL_FUNCTIONS(RR_NCCL_GET)
#undef RR_NCCL_GET
    if (ok && a.get_version(&a.version) != ncclSuccess) a.version = 0;
    if (!ok) a.get_version = nullptr;
  });
  if (!a.get_version) throw RingError(error);
  return a;
}

std::string error_text(const Api& nc, ncclResult_t res, ncclComm_t comm) {
  std::string text = nc.error_string(res);
  const char* last = comm ? nc.last_error(comm) : nullptr;
  if (last && *last) text += std::string(" (") + last + ")";
  return text;
}

// The two the module calls (declared in endpoint.h, the transport's public header).
int version(const std::string& lib) { return api(lib).version; }

std::string unique_id(const std::string& lib) {
  ncclUniqueId id;
  const ncclResult_t r = api(lib).get_unique_id(&id);
  if (r != ncclSuccess)
    throw RingError(std::string("ringreduce: ncclGetUniqueId failed: ") + api(lib).error_string(r));
  return std::string(id.internal, sizeof id.internal);
}

}  // namespace ringreduce::cuda::nccl
