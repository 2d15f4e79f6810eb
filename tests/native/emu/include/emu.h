// Test hooks of the emulated CUDA device (tests only): things a test needs to arrange that a real
// GPU does on its own (several devices, no peer access, a faulting kernel).
#pragma once
#include <cstdint>

#include "cuda_runtime.h"

extern "C" {
// Devices in the process (default: EMU_CUDA_DEVICES, else 1); at most 64.
void emu_set_device_count(int n);
// Whether device a can map memory of device b (cudaDeviceCanAccessPeer, IPC opens). Default: yes.
void emu_set_peer_access(int a, int b, int can);
// Work on stream after this point fails: the device's context is broken with error e, as after a
// kernel fault on a GPU (a sticky error: every later call on that device returns it).
cudaError_t emu_inject_fault(cudaStream_t stream, cudaError_t e);
// Makes cudaStreamIsCapturing report stream as capturing a CUDA graph (or not): the emulator
// captures nothing, this lets tests see what code does when it finds itself inside a capture.
void emu_set_capturing(cudaStream_t stream, int capturing);
// Whether that capture was invalidated (as cudaStreamEndCapture would report): while a stream
// captures, as torch.cuda.graph does by default (global mode), an event query or synchronize, an
// IPC get, open or close from a thread not in relaxed capture mode (cudaThreadExchangeStreamCaptureMode) is refused with
// cudaErrorStreamCaptureImplicit and invalidates the capture, as CUDA does.
int emu_capture_invalidated(cudaStream_t stream);
// Clears a device's sticky error (cudaDeviceReset without freeing anything), for the next test.
void emu_clear_fault(int device);
// Threads per block that a launch actually runs (EMU_BLOCK_THREADS, default 8; the kernels stride
// by blockDim.x, so fewer threads than requested only lengthens their loops). A kernel launched by
// RR_LAUNCH_WARPS runs it rounded to whole warps of 32 (at least one).
int emu_block_threads();
// The weak memory mode (tests/native/emu/weak.cpp): seed != 0 turns it on for kernels launched
// from now on, with that seed (each seed, another random order of stores landing); 0 turns it off.
// EMU_WEAK=seed in the environment turns it on at start.
void emu_set_weak(uint64_t seed);
// The happens-before check (tests/native/emu/hb.cpp): on != 0 checks, in kernels launched from now
// on, that every data load sees a store ordered before it by a release and an acquire (or by the
// end of the kernel that stored it); 0 turns it off. Either call clears the count. EMU_HB=1 in the
// environment turns it on at start.
void emu_set_hb(int on);
// Loads that raced with their store since the last emu_set_hb, and what the first one was ("" if none).
uint64_t emu_hb_races();
const char* emu_hb_first_race();
// Kernel launches executed so far.
uint64_t emu_launches();
// cudaFree calls so far of device memory that IPC mappings still mapped (undefined in CUDA: the
// owner must free only after every importer closed its handle). Each is also said on stderr.
uint64_t emu_frees_while_mapped();
// cudaIpcOpenMemHandle calls so far; and the next n of them fail (cudaErrorMapBufferObjectFailed,
// not sticky), as an open of a peer's memory the driver cannot map does.
uint64_t emu_ipc_opens();
void emu_fail_ipc_opens(int n);
// From now on (on != 0) count the CUDA API calls made by any thread but the calling one (a
// transport's own threads after stop_threads must make none: the runtime may be tearing down).
void emu_watch_calls(int on);
uint64_t emu_other_thread_calls();
// The next n kernel launches, on any thread, are refused with error e (for cudaGetLastError, not
// sticky), as a launch that asks for too many resources is on a GPU.
void emu_fail_launches(int n, cudaError_t e);
// Hardware queues per device for the streams created from now on (CUDA_DEVICE_MAX_CONNECTIONS):
// k > 0 puts every new stream of a device on queue (its index mod k), and streams sharing a queue
// run their work in the order it was enqueued, so an op that waits blocks every later op of every
// stream on that queue, as on a GPU; 0 (the default) gives every stream a queue of its own.
void emu_set_connections(int k);

// The cost model (tests/native/emu/cost.cpp): what each device did since the last reset.
struct EmuCost {
  uint64_t remote_read, remote_write;  // bytes of other devices' memory (through IPC mappings)
  uint64_t local_read, local_write;    // bytes of its own memory (kernels and device copies)
  uint64_t remote_waits, local_waits;  // completed waits on a flag in another device's / own memory
  uint64_t remote_posts;               // flag stores into another device's memory
  uint64_t launches;                   // kernels
  uint64_t half_round_trips;           // the latest clock a kernel of this device ended at
  uint64_t max_thread_waits;           // the most completed waits of one thread of one block
  // flag loads from pinned host memory by a block before it first spun in a wait: a bus round trip
  // (PCIe on a GPU) on the path of every call, as a wait's occasional check is not
  uint64_t host_reads;
};
void emu_cost_enable(int on);
// Zero every count, clock and flag stamp (streams restart at time 0).
void emu_cost_reset(void);
void emu_cost_get(int device, struct EmuCost* out);
}
