"""Proof that the emulated CUDA tests can fail: breaks the CUDA code on purpose, one change at a
time, rebuilds, runs the native test that should catch it, and restores the file. Not part of CI
(each mutation costs a rebuild and a run: about 30 minutes for all). Run from the repository root
after `cmake -S . -B cbuild && cmake --build cbuild -j2`:

    python3 tests/native/emu/mutations.py [name ...]

Prints one line per mutation: caught (the test failed or timed out) or NOT CAUGHT.
"""
import pathlib
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]
BUILD = ROOT / "cbuild"

KERNEL = "csrc/cuda/p2p/ring_kernel.cu"
SYM = "csrc/cuda/p2p/sym_kernel.cu"
SYM_BARRIER = "csrc/cuda/p2p/sym_barrier.cuh"
WIRE = "csrc/cuda/p2p/sym_wire.cu"
WIRE_WARP = "csrc/cuda/p2p/wire_warp.cuh"
WIRE_TEST = ("test_p2p_wire_emu", ["test_wire", "weak_wire"])
HIER = "csrc/cuda/hier/endpoint.cpp"
HIER_TEST = ("test_hier_emu", ["test_sweep"])
HIER_WIRE_TEST = ("test_hier_emu", ["test_wire"])
STANDIN = "tests/native/emu/nccl_standin.cpp"
P2P_TEST = ("test_p2p_ring_emu", ["test_ring", "test_timeout", "test_mismatch"])
NCCL_TEST = ("test_nccl_emu", ["test_sweep"])
# The weak memory mode (tests/native/emu/weak.cpp): a few seconds per algorithm.
WEAK_RING = ("test_p2p_ring_emu", ["weak_ring"])
WEAK_DIRECT = ("test_p2p_workspace_emu", ["weak_oneshot", "weak_twoshot"])

# name: (file, text, replacement, test, why it must be caught); text may be a list of
# (text, replacement) pairs, then replacement is None.
COPY_TEST = ("test_p2p_copy_emu", ["test_copy"])
# The cost report's targets (benchmarks/gpu_cost.py --check; "py:" runs a script with this Python).
COST_CHECK = ("gpu_cost_emu", ["py:benchmarks/gpu_cost.py", "--world", "8", "--sizes", "4K,1M",
                               "--algo", "auto,ring", "--bin", str(BUILD / "gpu_cost_emu"), "--check"])
COPY_FAILURES = ("test_p2p_copy_emu", ["test_copy_failures"])

MUTATIONS = {
    "direct_own_source_at_rank_0": (
        "csrc/cuda/reduce.cuh", "    return q == own_at ? own :", "    return q == 0 ? own :", P2P_TEST,
        "the direct kernels' fold takes the rank's own input as rank 0's and the slots for the rest"),
    "fold_prefetch_skips_last_source": (
        "csrc/cuda/reduce.cuh", "      if (q + 1 < ns) load(w, q + 1);", "      if (q + 2 < ns) load(w, q + 1);",
        P2P_TEST, "with three or more sources the fold's last source is never loaded (the one before counts twice)"),
    "copy_allgather_slot_misaligned": (
        "csrc/cuda/p2p/copy.cpp", "const int64_t at_out = c.coll == Coll::AllGather ? r * span + begin : begin;",
        "const int64_t at_out = begin;", COPY_TEST,
        "all_gather's sender puts a piece where the receiver does not look when chunks are not 16-byte multiples"),
    "copy_timeout_names_no_peer": (
        "csrc/cuda/p2p/copy.cpp", "__ATOMIC_ACQUIRE) < reached)", "__ATOMIC_ACQUIRE) > reached)",
        COPY_FAILURES, "the copy algorithm's timeout names no rank (or the wrong one) as missing"),
    "copy_one_inbox_slot": (
        "csrc/cuda/p2p/layout.h", "constexpr int kCopyDepth = 2;", "constexpr int kCopyDepth = 1;", COPY_TEST,
        "a sender overwrites the receiver's only slot for it while the receiver still folds it"),
    "copy_release_all_ones": (
        "csrc/cuda/p2p/layout.h", "constexpr uint64_t kReleased = uint64_t{1} << 62;",
        "constexpr uint64_t kReleased = ~uint64_t{0};", COPY_FAILURES,
        "released stream waits never pass the driver's cyclic compare: the ranks hang"),
    "copy_headers_unchecked": (
        KERNEL, "      const uint32_t cause = check_header(got, mine);\n      if (cause != kOk) {\n        stop = abort_word(cause, r);",
        "      const uint32_t cause = kOk;\n      if (cause != kOk) {\n        stop = abort_word(cause, r);",
        COPY_FAILURES, "mismatched calls fold each other's pieces silently, or wait forever"),
    "copy_watchdog_releases_nothing": (
        "csrc/cuda/p2p/copy.cpp",
        "    for (int s = 0; s < opt_.nranks; ++s) __atomic_store_n(&cctl_->arrived[q][s].value, kReleased, __ATOMIC_SEQ_CST);",
        "    (void)q;", COPY_FAILURES,
        "a timed-out or aborted rank leaves every stream waiting (no kernel runs to release them)"),
    "copy_watchdog_never_fires": (
        "csrc/cuda/p2p/copy.cpp",
        "  if (now - watch_.since < std::chrono::duration<double>(opt_.timeout_s)) return;",
        "  return;", COPY_FAILURES, "a rank that never calls leaves its peers' streams waiting forever"),
    "copy_kernel_skips_abort_word": (
        KERNEL, "    uint32_t stop = ld_relaxed_sys(&a.self->abort);\n    if (!stop && a.cctl) stop = ld_relaxed_sys(&a.cctl->abort);\n    bool local = stop && abort_rank(stop) == r;",
        "    uint32_t stop = 0;\n    bool local = false;", COPY_FAILURES,
        "a rank whose waits were released (a peer timed out or aborted) folds stale inboxes as a result"),
    "error_records_for_ring_blocks_only": (
        "csrc/cuda/p2p/layout.h",
        "  alignas(kLine) ErrorRecord err[kMaxBlocks];  // by block index",
        "  alignas(kLine) ErrorRecord err[kMaxChannels];  // by block index",
        ("test_p2p_ring_emu", ["test_timeout_with_every_block"]),
        "direct blocks past the 32nd record their stops past the end of the host-mapped records"),
    "plan_ignores_resident_blocks": (
        "csrc/cuda/p2p/plan.cpp",
        [("  const int resident = o.max_blocks > 0 ? o.max_blocks : kMaxBlocks;\n  const int most",
          "  const int resident = kMaxBlocks;\n  const int most"),
         ("  const int resident = o.max_blocks > 0 ? o.max_blocks : kMaxBlocks;\n  if (algo",
          "  const int resident = kMaxBlocks;\n  if (algo")], None,
        ("test_p2p_ring_emu", ["test_ranks_share_a_device", "test_two_communicators_share_a_device"]),
        "ranks sharing a device launch more blocks than it holds: some wait for blocks that never end"),
    "close_frees_a_pinned_ring": (
        "csrc/cuda/p2p/endpoint.cpp",
        "  const bool replayable = areas_.own() && pins_->load() > 0;",
        "  const bool replayable = false;",
        ("test_p2p_close_emu", ["test_replay_after_close_of_a_pinned_ring"]),
        "close() frees memory a captured graph still replays (a use after free)"),
    "no_barrier_before_post": (
        KERNEL,
        "__device__ void step_end(const Args& a, Chan& c, bool recv, bool send, uint64_t send_bytes) {\n  __syncthreads();",
        "__device__ void step_end(const Args& a, Chan& c, bool recv, bool send, uint64_t send_bytes) {",
        P2P_TEST, "thread 0 posts while other threads still write the receiver's slot"),
    "slice_shifted_by_one": (
        KERNEL,
        "    return ring::slice(ring::channel_part(ch, a.blocks, blockIdx.x), j, S);",
        "    ring::Span sp = ring::slice(ring::channel_part(ch, a.blocks, blockIdx.x), j, S);\n"
        "    if (sp.count > 1) ++sp.begin, --sp.count;\n    return sp;",
        P2P_TEST, "one element of every ring slice is never moved"),
    "skip_credit_in_all_gather": (
        KERNEL,
        "    if (recv) st_relaxed_sys(&a.up->ring[k].credits.value, c.received + 1);",
        "    if (recv && c.index < 2) st_relaxed_sys(&a.up->ring[k].credits.value, c.received + 1);",
        P2P_TEST, "the sender never gets its slots back: it waits until the timeout"),
    "ring_post_without_fence": (
        KERNEL,
        "    fence_acq_rel_sys();\n    if (send) st_relaxed_sys(&a.down->ring[k].posted.value, c.sent + 1);",
        "    if (!send) fence_acq_rel_sys();\n    if (send) st_relaxed_sys(&a.down->ring[k].posted.value, c.sent + 1);",
        WEAK_RING, "the ring's posted count raised with a relaxed store and no fence: the slot lands after it"),
    "ring_wait_without_acquire": (
        KERNEL,
        "  fence_acq_rel_sys();\n  note_wait(ctr);",
        "  if (a.algo != static_cast<uint8_t>(Algo::Ring)) fence_acq_rel_sys();\n  note_wait(ctr);",
        WEAK_RING, "no acquire after the ring's poll: the slot's data loaded with nothing ordering it after "
        "the sender's stores (the happens-before check, tests/native/emu/hb.cpp; the weak mode alone "
        "missed it)"),
    "start_reads_host_abort": (
        "csrc/cuda/p2p/device.cuh", "if (!word && a.graph && ld_relaxed_sys(&a.self->host_abort))",
        "if (!word && ld_relaxed_sys(&a.ctl->abort))",
        COST_CHECK, "every block of every call reads the host's abort word across PCIe at its start (host_reads)"),
    "replay_skips_host_word": (
        "csrc/cuda/p2p/device.cuh", "if (!word && a.graph && ld_relaxed_sys(&a.self->host_abort))", "if (false)",
        ("test_p2p_close_emu", ["test_replay_after_close_of_a_pinned_ring"]),
        "a graph replayed after close() runs its call into the peers' areas (they may be freed)"),
    "sym_wait_without_acquire": (
        SYM_BARRIER, [("  if (ld_acquire_sys(flag) < target) {", "  if (ld_relaxed_sys(flag) < target) {"),
                      ("      if (ld_acquire_sys(flag) >= target) break;",
                       "      if (ld_relaxed_sys(flag) >= target) break;")], None,
        WEAK_DIRECT, "no acquire after a workspace barrier's poll: the peers' inputs read with nothing ordering "
        "them after their stores (the happens-before check)"),
    "nccl_reduce_on_default_stream": (
        "csrc/cuda/nccl/algorithms.cpp",
        "    launch_reduce(c.dtype, c.op, got, got, own, n, 1, stream);",
        "    launch_reduce(c.dtype, c.op, got, got, own, n, 1, nullptr);",
        NCCL_TEST, "the ring's reduce of a staged slice on the legacy stream, which the rank's non-blocking "
        "stream does not wait for: the next step sends the staging before it is reduced"),
    "nccl_recv_before_send": (
        STANDIN,
        [("    s.posted = true;\n  }\n  cl.cv.notify_all();", "  }"),
         ("  for (size_t i = 0; ok && i < g->ops.size(); ++i) {\n    if (!g->ops[i].send) continue;",
          "  for (size_t i = 0; ok && i < g->ops.size(); ++i) {\n    if (!g->ops[i].send) continue;\n"
          "    slot(i).posted = true;\n    cl.cv.notify_all();")],
        None, NCCL_TEST, "every rank waits for its receive before posting its send: the ring deadlocks"),
    "nccl_descriptors_not_compared": (
        "csrc/cuda/nccl/inflight.cpp",
        "    mismatch = p.descs ? check_descs(p) : std::string();",
        "    mismatch = std::string();",
        ("test_nccl_emu", ["test_size_mismatch"]),
        "a mismatched call fails only the ranks NCCL tells (the receiver of a truncated message): the "
        "sender's call succeeds"),
    "nccl_descriptors_to_neighbours_only": (
        "csrc/cuda/nccl/endpoint.cpp",
        "    for (int k = 1; k < opt_.nranks; ++k) {\n      const int to = (opt_.rank + k) % opt_.nranks, from",
        "    for (int k = 1; k < opt_.nranks; k += std::max(1, opt_.nranks - 2)) {\n"
        "      const int to = (opt_.rank + k) % opt_.nranks, from",
        ("test_nccl_emu", ["test_mismatch_blocks_the_first_group"]),
        "descriptors go to the ring's neighbours only: a rank two steps from the mismatched one sees "
        "none and learns of it by its timeout"),
    "nccl_descriptors_in_the_data_group": (
        "csrc/cuda/nccl/endpoint.cpp",
        '    post(gops_, stream, "ncclGroupEnd (call descriptors with the peers)");',
        '    gops_.insert(gops_.end(), ops.begin(), ops.end());\n'
        '    post(gops_, stream, "ncclGroupEnd (call descriptors with the peers)");\n'
        '    RR_CUDA_CHECK(cudaEventCreateWithFlags(&next_.descs, cudaEventDisableTiming));\n'
        '    RR_CUDA_CHECK(cudaMemcpyAsync(inflight_.host(next_.slot), dev, opt_.nranks * sizeof(Desc), '
        'cudaMemcpyDeviceToHost, stream));\n'
        '    RR_CUDA_CHECK(cudaEventRecord(next_.descs, stream));\n'
        '    return;',
        ("test_nccl_emu", ["test_mismatch_blocks_the_first_group"]),
        "the descriptors ride in the first data group (the design before): a group that mismatched "
        "calls block holds them back, and the ranks fail by their timeout"),
    "release_frees_a_mapped_copy": (
        "csrc/cuda/p2p/registered.cpp",
        "    DeviceScope scope(device_);\n    unmap_locked(g);\n  }",
        "    DeviceScope scope(device_);\n    unmap_locked(g);\n    g.own.reset();\n  }",
        ("test_p2p_registered_emu", ["test_registered_release"]),
        "a released shared buffer's own copy is freed at once, while the peers still map it"),
    "unmap_peers_does_nothing": (
        "csrc/cuda/p2p/endpoint.cpp",
        "  if (pins_->load() > 0) return false;\n  unmapped_ = true;",
        "  if (pins_->load() > 0) return false;\n  return true;\n  unmapped_ = true;",
        ("test_p2p_close_emu", ["test_close_frees_nothing_mapped"]),
        "the close's first phase unmaps nothing: every rank frees its workspace while the others map it"),
    "launch_failure_does_not_abort": (
        "csrc/cuda/p2p/endpoint.cpp",
        '    abort(std::string("could not enqueue call #") + std::to_string(op_seq_) + ": " + e.what());\n',
        "",
        ("test_p2p_close_emu", ["test_launch_failure_aborts_the_group"]),
        "a refused kernel launch throws on its rank only: the peers wait in the call's kernel until "
        "their timeout"),
    "ring_loop_all_gather_sends_nothing_on": (
        "csrc/ring/loop.h", "p.recv_copy(out + rp.begin * es, rp.count, t < n - 2);",
        "p.recv_copy(out + rp.begin * es, rp.count, false);", NCCL_TEST,
        "the host ring loop (shm and nccl) stops forwarding in the all-gather: from 3 ranks on, a "
        "rank never gets the chunks two hops away"),
    "nccl_wrong_staging_buffer": (
        "csrc/cuda/nccl/algorithms.cpp",
        "    char* got = recv(g.staging[turn++ & 1], n);\n    launch_reduce(c.dtype, c.op, got, got,",
        "    char* got = recv(g.staging[turn & 1], n);\n    launch_reduce(c.dtype, c.op, got, got,",
        NCCL_TEST, "step s forwards the buffer being received into, not what step s-1 reduced"),
    "harness_fills_on_legacy_stream": (
        "tests/native/cuda_check.h",
        [("  RR_CUDA_CHECK(cudaMemcpyAsync(dst, host.data(), host.size(), cudaMemcpyHostToDevice, s));",
          "  (void)s;\n  RR_CUDA_CHECK(cudaMemcpy(dst, host.data(), host.size(), cudaMemcpyHostToDevice));"),
         ("  RR_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, s));",
          "  (void)s;\n  RR_CUDA_CHECK(cudaMemset(dst, byte, bytes));")],
        None, ("test_p2p_deterministic_emu", ["test_deterministic"]),
        "the test's own race (issue 35): inputs and outputs filled on the legacy stream, which the "
        "ranks' non-blocking streams do not wait for"),
    "registered_plan_past_the_end": (
        "csrc/cuda/p2p/registered.cpp",
        "    if (g.mapped && c >= base && c + bytes <= base + g.bytes) {",
        "    if (g.mapped && c >= base && c < base + g.bytes) {",
        ("test_p2p_registered_emu", ["test_registered"]),
        "a tensor that runs past its buffer's end is reduced in the peers' copies past theirs"),
    "fold_rounds_every_step": (
        "csrc/cuda/reduce.cuh",
        "        for (int k = 0; k < K; ++k) acc[u][k] = apply<Op>(acc[u][k], N::up(x[k]));",
        "        for (int k = 0; k < K; ++k) acc[u][k] = N::up(N::down(apply<Op>(acc[u][k], N::up(x[k]))));",
        ("test_nccl_emu", ["test_deterministic"]),
        "the rank-order fold rounds fp16/bf16 after every rank instead of once"),
    "fold_unrolled_rereads_first_source": (
        "csrc/cuda/reduce.cuh",
        "      const uint4* sq = vsrc(q);",
        "      const uint4* sq = vsrc(0);",
        ("test_p2p_ring_emu", ["test_ring"]),
        "the fold's unrolled body (several loads in flight) reads the first source for every source"),
    "fold_unrolled_stores_one_lane": (
        "csrc/cuda/reduce.cuh",
        "      for (int d = 0; d < nd; ++d) __stcg(reinterpret_cast<uint4*>(dst[d] + head) + i + u * nthreads, r);",
        "      for (int d = 0; d < nd; ++d) __stcg(reinterpret_cast<uint4*>(dst[d] + head) + i, r);",
        ("test_p2p_ring_emu", ["test_ring"]),
        "the fold's unrolled body stores every lane's result at the first lane's index"),
    # The symmetric workspace kernel (csrc/cuda/p2p/sym_kernel.cu, issue 50).
    "sym_replay_after_close_notifies_peers": (
        "csrc/cuda/p2p/device.cuh",
        "  if (ld_relaxed_sys(&a.ctl->abort) != kCtlClosed) {",
        "  if (true) {",
        ("test_p2p_close_emu", ["test_replay_after_close_of_a_pinned_ring"]),
        "a graph replayed after close writes its abort word into peers that may have freed it"),
    "sym_no_start_barrier_wait": (
        SYM_BARRIER, "    stop = sym_wait(a, &a.self->sym[k].arrived[q], v, &local);",
        "    stop = b == kStart ? 0 : sym_wait(a, &a.self->sym[k].arrived[q], v, &local);",
        P2P_TEST, "a rank pulls the peers' pieces before they copied them in"),
    "sym_no_middle_barrier": (
        SYM, "          ok = barrier(a, p.epoch(j), kMiddle, j, nbytes, &s_claim);", "", P2P_TEST,
        "two-shot gathers the peers' reduced chunks of its last piece before they wrote them"),
    "sym_pipelined_copy_in_after_barrier": (
        SYM, "          copy_in<T>(a, e0, j + 1);\n          ok = barrier(a, p.epoch(j + 1), kStart, j + 1, nbytes, &s_claim);",
        "          ok = barrier(a, p.epoch(j + 1), kStart, j + 1, nbytes, &s_claim);\n          copy_in<T>(a, e0, j + 1);",
        P2P_TEST, "pipelined two-shot: the next piece's inputs copied in after the barrier that says they are in"),
    "sym_one_half": (
        SYM, "    return Layout{(epoch(j) & 1) * a.half_bytes, j * a.chunk_elems, global, region};",
        "    return Layout{0, j * a.chunk_elems, global, region};",
        P2P_TEST, "one workspace half: a rank copies piece k + 1 over piece k while its peers read it"),
    "sym_cut_by_piece_length": (
        SYM, "    const ring::Span p = ring::channel_part(ring::Span{lo, len}, gridDim.x, blockIdx.x);",
        "    const ring::Span p = ring::channel_part(ring::Span{lo, ring::min64(len, count - lo)}, gridDim.x, blockIdx.x);",
        P2P_TEST, "blocks cut a short piece their own way: a block ahead writes where another still reads "
        "(the race found while writing the kernel)"),
    "sym_no_barrier_before_post": (
        SYM_BARRIER, "  const uint64_t v = barrier_value(epoch, b);\n  __syncthreads();",
        "  const uint64_t v = barrier_value(epoch, b);", P2P_TEST,
        "a thread raises the flag while others still copy the piece in"),
    "sym_header_unchecked": (
        SYM_BARRIER, "      const uint32_t cause = check_header(theirs, mine);",
        "      const uint32_t cause = kOk;", ("test_p2p_ring_emu", ["test_mismatch"]),
        "ranks making different calls read each other's workspaces as if they matched"),
    "sym_registered_tag_not_in_headers": (
        SYM, "    if (barrier(a, e0 + 1, kStart, 0, a.reg_tag, &s_claim)) {",
        "    if (barrier(a, e0 + 1, kStart, 0, 0, &s_claim)) {",
        ("test_p2p_registered_emu", ["test_registered_mismatch"]),
        "ranks whose tensors sit at other offsets read and write each other's wrong elements, silently"),
    "sym_registered_no_end_barrier": (
        SYM, "      barrier(a, e0 + 1, kEnd, 0, a.reg_tag, &s_claim);", "",
        ("test_p2p_registered_emu", ["test_registered_result_in_stream_order"]),
        "a rank's call ends while peers still write their results into its copy"),
    "sym_epochs_of_own_blocks_only": (
        "csrc/cuda/p2p/device.cuh", "    for (int k = blockIdx.x; k < kMaxSymBlocks; k += gridDim.x) a.self->sym[k].epoch.value = epoch;",
        "    a.self->sym[blockIdx.x].epoch.value = epoch;", ("test_p2p_workspace_emu", ["test_epochs_stay_equal"]),
        "blocks a call did not use keep old epochs: a later call with more blocks waits for values "
        "its peers passed long ago, or passes barriers early"),
    "sym_vote_thread0_only": (
        SYM_BARRIER, "  return __syncthreads_or(stop != 0) == 0;",
        "  return __syncthreads_or(0) == 0 && (threadIdx.x != 0 || stop == 0);",
        ("test_p2p_ring_emu", ["test_mismatch", "test_timeout"]),
        "only the thread that failed stops; the others go on to the next barrier"),

    "nccl_watchdog_queries_in_global_mode": (
        "csrc/cuda/nccl/watchdog.cpp", "  RelaxedCapture relaxed;  // this thread's queries, for its whole life\n", "",
        ("test_nccl_emu", ["test_watchdog_spares_a_capture"]),
        "the watchdog's event queries invalidate a CUDA graph another thread captures (issue 51, finding 2)"),
    "close_forgets_failed_calls": (
        "csrc/cuda/p2p/failures.cpp", "  closed_failed_seq_ = failed_seq_locked();\n", "",
        ("test_p2p_close_emu", ["test_failed_call_survives_close"]),
        "a Work waited on after close reports success for a call that failed on the device (issue 51, finding 4)"),
    # The narrow wire on the workspace (csrc/cuda/p2p/sym_wire.cu, issue 52).
    "wire_scale_of_one_lane": (
        WIRE_WARP, "    warp_max(amax);\n", "", WIRE_TEST,
        "each lane scales its own 4 elements: an fp8 block's scale not from the whole block's largest magnitude"),
    "wire_scale_gathered_from_wrong_lane": (
        WIRE_WARP, "const int s = lane() / kBatch, u = lane() % kBatch;", "const int s = lane() / kBatch, u = 0;", WIRE_TEST,
        "a fold decodes every block of a batch with the first block's scale"),
    "wire_warp_max_divergent": (
        WIRE_WARP, "    warp_max(amax);\n", "    if (left_of(b0, 0, nb, count) > 0) warp_max(amax);\n", WIRE_TEST,
        "a warp reduction that only the lanes with an element call (undefined on a GPU; the emulator aborts)"),
    "wire_sum_not_rounded_again": (
        WIRE_WARP, "    if (dst) over |= round_batch<W>(acc, b0, nb, count, *dst);",
        "    float kept[kBatch][kPer];\n    __builtin_memcpy(kept, acc, sizeof acc);\n"
        "    if (dst) over |= round_batch<W>(kept, b0, nb, count, *dst);", WIRE_TEST,
        "the reducing rank keeps its unrounded sum while the others decode the rounded one"),
    "wire_twoshot_no_middle_barrier": (
        WIRE, "        ok = barrier(a, epoch(j), kMiddle, j, a.wire_span, &s_claim);", "", WIRE_TEST,
        "two-shot decodes the peers' reduced chunks before they wrote them"),
    "wire_overflow_not_told": (
        WIRE, "  if (threadIdx.x == 0) store1(span.count(blockIdx.x), static_cast<uint32_t>(any));",
        "  if (threadIdx.x == 0) store1(span.count(blockIdx.x), 0u);",
        ("test_p2p_wire_emu", ["test_wire_overflow"]),
        "an fp16 overflow is known only to the rank that rounded it"),
    "wire_not_in_header": (
        "csrc/cuda/p2p/device.cuh", "  h.op = static_cast<uint8_t>(a.op | a.wire << 4);", "  h.op = a.op;",
        ("test_p2p_wire_emu", ["test_wire_mismatch"]),
        "ranks on different wires read each other's spans as their own type"),
    "wire_rs_grid_from_tensor_start": (
        WIRE,
        "      for (int c = 0; c < n; ++c) o |= put_part<T, W>(in + c * m + begin, count, P, at(j, r, c));",
        "      for (int c = 0; c < n; ++c) o |= put_part<T, W>(in + c * m + begin + (c ? 1 : 0), count, P, at(j, r, c));",
        WIRE_TEST, "reduce_scatter rounds a chunk's elements shifted by one (blocks not from the chunk's start)"),
    # The two-level CUDA plan (issue 74): ranks on emulated hosts, the NCCL stand-in between them.
    "hier_piece_folded_twice": (
        HIER, "        cross_->run(sub_call(c, Coll::AllReduce, c.dtype, red, q, k.buf, k.buf), st);\n",
        "        cross_->run(sub_call(c, Coll::AllReduce, c.dtype, red, q, k.buf, k.buf), st);\n"
        "        cross_->run(sub_call(c, Coll::AllReduce, c.dtype, red, q, k.buf, k.buf), st);\n", HIER_TEST,
        "a piece's shard reduced between hosts twice"),
    "hier_partial_sent_before_host_reduce": (
        HIER, "    after(k.in_host, a, b);\n", "", HIER_TEST,
        "a host's partial sum sent between hosts before its reduce-scatter inside the host ends"),
    "hier_slot_reused_early": (
        HIER, "    if (k.used) RR_CUDA_CHECK(cudaStreamWaitEvent(a, k.free, 0));  // its last reader is done\n", "",
        HIER_TEST, "a slot's next piece written before its last reader (the other stream) is done"),
    "hier_avg_divided_by_hosts": (
        HIER, "        if (c.op == RedOp::Avg) launch_divide(c.dtype, k.buf, q, N, st);",
        "        if (c.op == RedOp::Avg) launch_divide(c.dtype, k.buf, q, layout_.nhosts, st);", HIER_TEST,
        "AVG divided by the number of hosts instead of the group's size"),
    "hier_gather_in_host_order": (
        HIER, "            RR_CUDA_CHECK(cudaMemcpyAsync(out + (layout_.by_host[h][j] * m + p * K) * es,",
        "            RR_CUDA_CHECK(cudaMemcpyAsync(out + ((j * layout_.nhosts + h) * m + p * K) * es,", HIER_TEST,
        "all_gather leaves the chunks in (local rank, host) order, not the group's rank order"),
    "hier_gather_before_between_hosts": (
        HIER, "    if (b != s) RR_CUDA_CHECK(cudaStreamWaitEvent(s, k.between, 0));  // recorded after its second leg\n",
        "", HIER_TEST, "a piece gathered inside the host before its step between hosts ends"),
    "hier_wire_tail_not_padded": (
        HIER, "          RR_CUDA_CHECK(cudaMemsetAsync(pad_, 0, unit * es, st));\n", "", HIER_WIRE_TEST,
        "a wire call's tail padded with stale memory instead of zeros (its last block's scale moves)"),
    "hier_wire_avg_not_divided_first": (
        HIER, "        if (c.op == RedOp::Avg) launch_divide(c.dtype, k.buf, H * rn, N, st);\n", "", HIER_WIRE_TEST,
        "AVG on the wire between hosts not divided by the group's size before rounding"),
    "hier_wire_fold_not_rounded": (
        "csrc/cuda/hier/wire.cu", "p2p::fold_part<T, W>(src, nhosts, n, row_part(cap, per_row), 1, &nowhere, out + k * n);",
        "p2p::fold_part<T, W>(src, nhosts, n, row_part(cap, per_row), 1, static_cast<const WSpan<W>*>(nullptr), out + k * n);",
        HIER_WIRE_TEST, "the hosts' fold kept in float32 instead of rounded onto the wire once more"),
    "hier_wire_rows_transposed": (
        "csrc/cuda/hier/wire.cu", "(h * nrows + k) * row_bytes", "(k * nhosts + h) * row_bytes", HIER_WIRE_TEST,
        "each host folds the rows of one host instead of row k of every host"),
    # Imported memory (issue 70): the prediction checked at the start barrier, and its release.
    "imported_peers_hash_unchecked": (
        SYM, "          right = right && tw[1] == a.tag_hash;", "",
        ("test_p2p_imported_emu", ["test_imported"]),
        "a rank whose tensor moved is read at its old memory by peers that predicted it"),
    "imported_reaper_closes_nothing": (
        "csrc/cuda/p2p/imports.cpp", "      if (owner == q && load_acquire(&board_->exp[q][id % kBoardSlots].id) != id) {",
        "      if (false) {", ("test_p2p_imported_emu", ["test_imported"]),
        "an allocation freed (and reused) while a peer still maps it: undefined in CUDA"),
    "imported_export_kept_after_free": (
        "csrc/cuda/p2p/imports.cpp", "      it = exports_.erase(it);\n      withdrew = true;",
        "      ++it;\n      withdrew = true;", ("test_p2p_imported_emu", ["test_imported"]),
        "a withdrawn allocation's export stays: its hold is moved out and nothing refers to the memory "
        "again (the export is never shared anew, and the next tensor in it finds a hold-less export)"),
    # Issue 81: the release protocol, IPC beside a capture, stop_threads, a failed open.
    "imported_hold_dropped_before_peers_closed": (
        "csrc/cuda/p2p/imports.cpp",
        "      for (int q = 0; q < n && done; ++q) done = q == r || load_acquire(&board_->reaped[q][r]) >= k;",
        "", ("test_p2p_imported_emu", ["test_imported_release"]),
        "the owner frees (drops its hold) before every peer closed its mapping: undefined in CUDA"),
    "imported_pinned_peer_closes": (
        "csrc/cuda/p2p/imports.cpp", "    if (pins_->load() == 0)\n", "    if (true)\n",
        ("test_p2p_imported_emu", ["test_imported_release"]),
        "a ring a CUDA graph pins closes its mappings: the owner frees memory a captured launch reads"),
    "imported_close_frees_under_pin": (
        "csrc/cuda/p2p/endpoint.cpp", "  imported_.release(!keep && !replayable);", "  imported_.release(true);",
        ("test_p2p_imported_emu", ["test_imported_release"]),
        "a group closed while a peer maps the memory (close(false)) drops the holds: freed while mapped"),
    "reaper_close_in_global_capture_mode": (
        "csrc/cuda/p2p/imports.cpp",
        "  RelaxedCapture relaxed;  // beside a capture on another thread (torch.cuda.graph: global mode)\n", "",
        ("test_p2p_imported_emu", ["test_imports_beside_a_capture"]),
        "the reaper's IPC close in the thread's global capture mode invalidates another thread's capture"),
    "export_in_global_capture_mode": (
        "csrc/cuda/p2p/imports.cpp",
        "    RelaxedCapture relaxed;  // another thread may be capturing (this one is not: see prepare)\n", "",
        ("test_p2p_imported_emu", ["test_imports_beside_a_capture"]),
        "a first export's cudaIpcGetMemHandle in global capture mode invalidates another thread's capture"),
    "stop_threads_leaves_reaper": (
        "csrc/cuda/p2p/endpoint.cpp", "  imported_.stop();  // its IPC closes", "  // its IPC closes",
        ("test_p2p_close_emu", ["test_no_cuda_call_after_stop_threads"]),
        "a communicator left to the process's exit keeps calling CUDA from its reaper during teardown"),
    "failed_open_retried": (
        "csrc/cuda/p2p/imports.cpp", "  if (unmappable_.count({q, id})) return nullptr;\n", "",
        ("test_p2p_imported_emu", ["test_failed_open_remembered"]),
        "a peer's allocation that cannot be mapped is opened again on every call"),
    "imported_in_place_without_end_barrier": (
        SYM, "      barrier(a, e0 + 1, kEnd, 0, 0, &s_claim);", "",
        ("test_p2p_imported_emu", ["test_imported_result_in_stream_order"]),
        "a rank returns (and its caller reads the tensor) while peers still write their results into it"),
    # Issue 81 item 2: the LL flag never matches a stale word.
    "ll_flag_is_the_count_cut_to_32_bits": (
        "csrc/cuda/p2p/layout.h", "return static_cast<uint32_t>(k) | 1u;", "return static_cast<uint32_t>(k);",
        ("test_p2p_ll_emu", ["test_ll_flag_wrap"]),
        "at LL call 2^32 the flag is 0, the value of a word never written: a peer's data read before it came"),
    "ll_slots_never_wiped": (
        "csrc/cuda/p2p/ll_kernel.cu", "  if (blockIdx.x == 0 && ll_wipes(k)) {", "  if (false) {",
        ("test_p2p_ll_emu", ["test_ll_flag_wrap"]),
        "words older than 2^32 LL calls stay in a slot, where their flag comes round again"),
    # The LL one-shot (issue 71): a word says it arrived only if data and flag land as one store.
    "ll_flag_in_a_separate_store": (
        "csrc/cuda/p2p/ll_kernel.cu",
        "__device__ __forceinline__ void ll_post_group(uint64_t* p, uint4 v, int words, uint32_t flag) {\n",
        "__device__ __forceinline__ void ll_post_group(uint64_t* p, uint4 v, int words, uint32_t flag) {\n"
        "  const uint32_t d[4] = {v.x, v.y, v.z, v.w};\n"
        "  for (int k = 0; k < words; ++k) {\n"
        "    uint32_t* w32 = reinterpret_cast<uint32_t*>(p + k);\n"
        "    __stcg(w32, d[k]);\n"
        "    st_relaxed_sys(w32 + 1, flag);\n"
        "  }\n"
        "  return;\n",
        ("test_p2p_ll_emu", ["weak_ll"]),
        "the flag lands before its data (two stores): a peer folds the slot's old bytes"),
    "ll_parity_reused_one_call_early": (
        "csrc/cuda/p2p/ll_kernel.cu", "((k & 1) * a.nranks + src) * a.ll_slot", "(0 * a.nranks + src) * a.ll_slot",
        ("test_p2p_ll_emu", ["test_ll_back_to_back"]),
        "a rank ahead by a call overwrites the words its peers still wait for"),
    "ll_line_read_before_its_flag": (
        "csrc/cuda/p2p/ll_kernel.cu",
        [("  *local = true;\n  uint64_t w0, w1, w2 = 0, w3 = 0;",
          "  *local = true;\n  const uint64_t early0 = ld_ll(p);\n  uint64_t w0, w1, w2 = 0, w3 = 0;"),
         ("  d->x = static_cast<uint32_t>(w0);", "  d->x = static_cast<uint32_t>(early0);")], None,
        ("test_p2p_ll_emu", ["test_ll", "test_ll_back_to_back"]),
        "the data read before its flag said it arrived: the previous call's bytes"),
    "sym_blocks_not_in_header": (
        SYM_BARRIER, "static_cast<uint32_t>(piece & 0xffffff) | (static_cast<uint32_t>(gridDim.x) << 24);",
        "static_cast<uint32_t>(piece & 0xffffff);",
        ("test_p2p_workspace_emu", ["test_block_counts_must_agree"]),
        "ranks that cut a call between other numbers of blocks read parts not yet written (review finding 1)"),
}


def run(name):
    path, old, new, (test, args), why = MUTATIONS[name]
    f = ROOT / path
    text = f.read_text()
    edits = old if isinstance(old, list) else [(old, new)]
    mutated = text
    for o, n in edits:
        if mutated.count(o) != 1:
            return f"{name}: SKIPPED (the text to change is not in {path} exactly once)"
        mutated = mutated.replace(o, n)
    try:
        f.write_text(mutated)
        b = subprocess.run(["cmake", "--build", str(BUILD), "-j2", "--target", test],
                           capture_output=True, text=True)
        if b.returncode:
            return f"{name}: SKIPPED (does not build)\n{b.stdout[-2000:]}"
        t0 = time.monotonic()
        try:
            cmd = ([sys.executable, str(ROOT / args[0][3:]), *args[1:]] if args and args[0].startswith("py:")
                   else [str(BUILD / test), *args])
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            failed = r.returncode != 0
            out = r.stdout
        except subprocess.TimeoutExpired:
            failed, out = True, "timed out after 600 s"
        first = next((l for l in out.splitlines() if l.startswith("FAIL")), out.strip()[-200:])
        verdict = "caught" if failed else "NOT CAUGHT"
        return f"{name}: {verdict} in {time.monotonic() - t0:.0f} s ({why})\n    {first[:300]}"
    finally:
        f.write_text(text)


def main():
    # A kill must still restore the mutated file (run's finally): SIGTERM raises SystemExit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    names = sys.argv[1:] or list(MUTATIONS)
    for n in names:
        print(run(n), flush=True)
    subprocess.run(["cmake", "--build", str(BUILD), "-j2"], capture_output=True)  # restore binaries


if __name__ == "__main__":
    main()
