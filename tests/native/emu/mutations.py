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

KERNEL = "csrc/cuda/p2p_kernel.cu"
STANDIN = "tests/native/emu/nccl_standin.cpp"
P2P_TEST = ("test_cuda_kernels_emu", ["test_ring", "test_timeout", "test_mismatch"])
NCCL_TEST = ("test_nccl_ring_emu", ["test_sweep"])
# The weak memory mode (tests/native/emu/weak.cpp): a few seconds per algorithm.
WEAK_RING = ("test_cuda_kernels_emu", ["weak_ring"])
WEAK_DIRECT = ("test_cuda_kernels_emu", ["weak_oneshot", "weak_twoshot"])

# name: (file, text, replacement, test, why it must be caught); text may be a list of
# (text, replacement) pairs, then replacement is None.
COPY_TEST = ("test_cuda_kernels_emu", ["test_copy"])
COPY_FAILURES = ("test_cuda_kernels_emu", ["test_copy_failures"])

MUTATIONS = {
    "direct_own_source_at_rank_0": (
        "csrc/cuda/reduce.cuh", "    return q == own_at ? own :", "    return q == 0 ? own :", P2P_TEST,
        "the direct kernels' fold takes the rank's own input as rank 0's and the slots for the rest"),
    "fold_prefetch_skips_last_source": (
        "csrc/cuda/reduce.cuh", "      if (q + 1 < ns) load(w, q + 1);", "      if (q + 2 < ns) load(w, q + 1);",
        P2P_TEST, "with three or more sources the fold's last source is never loaded (the one before counts twice)"),
    "copy_allgather_slot_misaligned": (
        "csrc/cuda/p2p_copy.cpp", "const int64_t at_out = c.coll == Coll::AllGather ? r * span + begin : begin;",
        "const int64_t at_out = begin;", COPY_TEST,
        "all_gather's sender puts a piece where the receiver does not look when chunks are not 16-byte multiples"),
    "copy_timeout_names_no_peer": (
        "csrc/cuda/p2p_copy.cpp", "__ATOMIC_ACQUIRE) < reached)", "__ATOMIC_ACQUIRE) > reached)",
        COPY_FAILURES, "the copy algorithm's timeout names no rank (or the wrong one) as missing"),
    "copy_one_inbox_slot": (
        "csrc/cuda/p2p.h", "constexpr int kCopyDepth = 2;", "constexpr int kCopyDepth = 1;", COPY_TEST,
        "a sender overwrites the receiver's only slot for it while the receiver still folds it"),
    "copy_release_all_ones": (
        "csrc/cuda/p2p.h", "constexpr uint64_t kReleased = uint64_t{1} << 62;",
        "constexpr uint64_t kReleased = ~uint64_t{0};", COPY_FAILURES,
        "released stream waits never pass the driver's cyclic compare: the ranks hang"),
    "copy_headers_unchecked": (
        KERNEL, "      const uint32_t cause = check_header(got, mine);\n      if (cause != kOk) {\n        stop = abort_word(cause, r);",
        "      const uint32_t cause = kOk;\n      if (cause != kOk) {\n        stop = abort_word(cause, r);",
        COPY_FAILURES, "mismatched calls fold each other's pieces silently, or wait forever"),
    "copy_watchdog_releases_nothing": (
        "csrc/cuda/p2p_copy.cpp",
        "    for (int s = 0; s < opt_.nranks; ++s) __atomic_store_n(&cctl_->arrived[q][s].value, kReleased, __ATOMIC_SEQ_CST);",
        "    (void)q;", COPY_FAILURES,
        "a timed-out or aborted rank leaves every stream waiting (no kernel runs to release them)"),
    "copy_watchdog_never_fires": (
        "csrc/cuda/p2p_copy.cpp",
        "  if (now - watch_.since < std::chrono::duration<double>(opt_.timeout_s)) return;",
        "  return;", COPY_FAILURES, "a rank that never calls leaves its peers' streams waiting forever"),
    "copy_kernel_skips_abort_word": (
        KERNEL, "    uint32_t stop = ld_relaxed_sys(&a.self->abort);\n    if (!stop && a.cctl) stop = ld_relaxed_sys(&a.cctl->abort);\n    bool local = stop && abort_rank(stop) == r;",
        "    uint32_t stop = 0;\n    bool local = false;", COPY_FAILURES,
        "a rank whose waits were released (a peer timed out or aborted) folds stale inboxes as a result"),
    "error_records_for_ring_blocks_only": (
        "csrc/cuda/p2p.h",
        "  alignas(kLine) ErrorRecord err[kMaxBlocks];  // by block index",
        "  alignas(kLine) ErrorRecord err[kMaxChannels];  // by block index",
        ("test_cuda_kernels_emu", ["test_timeout_with_every_block"]),
        "direct blocks past the 32nd record their stops past the end of the host-mapped records"),
    "plan_ignores_resident_blocks": (
        "csrc/cuda/p2p.cpp",
        "  const int resident = o.max_blocks > 0 ? o.max_blocks : kMaxChannels + kMaxDirectBlocks;",
        "  const int resident = kMaxChannels + kMaxDirectBlocks;",
        ("test_cuda_kernels_emu", ["test_ranks_share_a_device"]),
        "ranks sharing a device launch more blocks than it holds: some wait for blocks that never end"),
    "replay_after_close_notifies_peers": (
        KERNEL,
        "  if (ld_relaxed_sys(&a.ctl->abort) != kCtlClosed) {",
        "  if (true) {",
        ("test_cuda_kernels_emu", ["test_replay_after_close_of_a_pinned_ring"]),
        "a graph replayed after close writes its abort word into peers that may have freed it"),
    "close_frees_a_pinned_ring": (
        "csrc/cuda/p2p.cpp",
        "  const bool replayable = area_ && pins_->load() > 0;",
        "  const bool replayable = false;",
        ("test_cuda_kernels_emu", ["test_replay_after_close_of_a_pinned_ring"]),
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
    "direct_no_wait_for_gather": (
        KERNEL,
        "    if (!wait_all(a, 1, seq, i, [&](int q) { return part(q, i).count * es; })) return false;",
        "",
        P2P_TEST, "two-shot copies the gathered chunks before they have arrived"),
    "twoshot_gather_into_wrong_chunk": (
        KERNEL,
        "      dst[0] = out + sp.begin;\n      span_multi<T, RedOp::Sum>(dst, 1, only(dslot<T>(a, a.self_data, seq, 1, q, sp.begin))",
        "      dst[0] = out + part(r, i).begin;\n      span_multi<T, RedOp::Sum>(dst, 1, only(dslot<T>(a, a.self_data, seq, 1, q, sp.begin))",
        P2P_TEST, "every gathered chunk lands on this rank's own chunk"),
    "oneshot_skips_last_rank": (
        KERNEL,
        "      span_multi<T, Op>(dst, 1, ranks(seq, 0, P.begin, in + P.begin), n, P.count, a.divisor, tid, nt);",
        "      span_multi<T, Op>(dst, 1, ranks(seq, 0, P.begin, in + P.begin), n - 1, P.count, a.divisor, tid, nt);",
        P2P_TEST, "one-shot leaves the last rank's input out of the sum"),
    "flag_without_system_fence": (
        KERNEL,
        "    fence_acq_rel_sys();\n    for (int p = 0; p < a.nranks; ++p)\n"
        "      if (p != a.rank) st_relaxed_sys(&a.peer[p]->direct[blockIdx.x].arrived[ph].from[a.rank], seq);",
        "    for (int p = 0; p < a.nranks; ++p)\n"
        "      if (p != a.rank) st_relaxed_sys(&a.peer[p]->direct[blockIdx.x].arrived[ph].from[a.rank], seq);",
        WEAK_DIRECT, "one-/two-shot flags raised with a relaxed store and no fence: data and headers land after them"),
    "ring_post_without_fence": (
        KERNEL,
        "    fence_acq_rel_sys();\n    if (send) st_relaxed_sys(&a.down->ring[k].posted.value, c.sent + 1);",
        "    if (!send) fence_acq_rel_sys();\n    if (send) st_relaxed_sys(&a.down->ring[k].posted.value, c.sent + 1);",
        WEAK_RING, "the ring's posted count raised with a relaxed store and no fence: the slot lands after it"),
    "ring_wait_without_acquire": (
        KERNEL,
        "  fence_acq_rel_sys();\n  note_wait(ctr);",
        "  if (a.algo != static_cast<uint8_t>(Algo::Ring)) fence_acq_rel_sys();\n  note_wait(ctr);",
        WEAK_RING, "NOT expected: the weak mode's stale loads are cleared by the fence every step_end makes, so "
        "a missing acquire after the poll does not show (a limit of the model, README)"),
    "oneshot_post_relaxed": (
        KERNEL,
        "    fence_acq_rel_sys();\n    for (int p = 0; p < a.nranks; ++p)\n"
        "      if (p != a.rank) st_relaxed_sys(&a.peer[p]->direct[blockIdx.x].arrived[ph].from[a.rank], seq);",
        "    if (a.algo != static_cast<uint8_t>(Algo::OneShot)) fence_acq_rel_sys();\n"
        "    for (int p = 0; p < a.nranks; ++p)\n"
        "      if (p != a.rank) st_relaxed_sys(&a.peer[p]->direct[blockIdx.x].arrived[ph].from[a.rank], seq);",
        ("test_cuda_kernels_emu", ["weak_oneshot"]),
        "one-shot's flags raised relaxed, without the fence: the inputs written into the peers land after them"),
    "twoshot_gather_post_relaxed": (
        KERNEL,
        "    fence_acq_rel_sys();\n    for (int p = 0; p < a.nranks; ++p)\n"
        "      if (p != a.rank) st_relaxed_sys(&a.peer[p]->direct[blockIdx.x].arrived[ph].from[a.rank], seq);",
        "    if (ph == 0) fence_acq_rel_sys();\n    for (int p = 0; p < a.nranks; ++p)\n"
        "      if (p != a.rank) st_relaxed_sys(&a.peer[p]->direct[blockIdx.x].arrived[ph].from[a.rank], seq);",
        ("test_cuda_kernels_emu", ["weak_twoshot"]),
        "two-shot's gather flags (phase 1) raised relaxed, without the fence: the reduced chunks land after them"),
    "direct_write_ahead_past_depth": (
        KERNEL,
        [("(((seq % kDirectDepth) * 2 + ph)", "(((seq % 2) * 2 + ph)"),
         ("direct_hdr[seq % kDirectDepth]", "direct_hdr[seq % 2]")],
        None, P2P_TEST,
        "two slots per source with rounds written two ahead: a round overwrites one a peer has not read yet"),
    "allgather_sends_before_collecting": (
        KERNEL,
        "      ok = collect(i);\n      if (ok && i + W < a.steps) send(i + W);",
        "      if (i + W < a.steps) send(i + W);\n      ok = collect(i);",
        P2P_TEST,
        "all-gather alone sends round i + 2 before it has read round i: needs 5 slots, has 4"),
    "twoshot_collects_two_behind": (
        KERNEL,
        "  const int64_t W = a.direct_ahead, L = W - 1;",
        "  const int64_t W = a.direct_ahead, L = W;",
        P2P_TEST,
        "two-shot collects round i - 2 after sending round i + 2: needs 5 slots, has 4"),
    "nccl_reduce_on_default_stream": (
        "csrc/cuda/nccl_ring.cpp",
        "        launch_reduce(c.dtype, c.op, dst, rbuf, in + rp.begin * es, rp.count, last ? divisor : 1,\n"
        "                      stream);",
        "        launch_reduce(c.dtype, c.op, dst, rbuf, in + rp.begin * es, rp.count, last ? divisor : 1,\n"
        "                      nullptr);",
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
        "csrc/cuda/nccl_ring.cpp",
        "        mismatch = p.descs ? check_descs(p) : std::string();",
        "        mismatch = std::string();",
        ("test_nccl_ring_emu", ["test_size_mismatch"]),
        "a mismatched call fails only the ranks NCCL tells (the receiver of a truncated message): the "
        "sender's call succeeds"),
    "nccl_descriptors_one_way": (
        "csrc/cuda/nccl_ring.cpp",
        "      gops_.push_back({true, ds.dev + opt_.rank * sizeof(Desc), sizeof(Desc), o.peer});\n"
        "      gops_.push_back({false, ds.dev + o.peer * sizeof(Desc), sizeof(Desc), o.peer});\n"
        "      next_.from.push_back(o.peer);",
        "      if (o.send) {\n"
        "        gops_.push_back({true, ds.dev + opt_.rank * sizeof(Desc), sizeof(Desc), o.peer});\n"
        "      } else {\n"
        "        gops_.push_back({false, ds.dev + o.peer * sizeof(Desc), sizeof(Desc), o.peer});\n"
        "        next_.from.push_back(o.peer);\n"
        "      }",
        ("test_nccl_ring_emu", ["test_size_mismatch"]),
        "descriptors go only where data goes: the ring's rank before the mismatched one finishes its "
        "call without an error"),
    "nccl_wrong_staging_buffer": (
        "csrc/cuda/nccl_ring.cpp",
        "        const void* sbuf = s == 0 ? in + sp.begin * es : staging_[(s - 1) & 1];",
        "        const void* sbuf = s == 0 ? in + sp.begin * es : staging_[s & 1];",
        NCCL_TEST, "step s forwards the buffer being received into, not what step s-1 reduced"),
    "harness_fills_on_legacy_stream": (
        "tests/native/cuda_check.h",
        [("  RR_CUDA_CHECK(cudaMemcpyAsync(dst, host.data(), host.size(), cudaMemcpyHostToDevice, s));",
          "  (void)s;\n  RR_CUDA_CHECK(cudaMemcpy(dst, host.data(), host.size(), cudaMemcpyHostToDevice));"),
         ("  RR_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, s));",
          "  (void)s;\n  RR_CUDA_CHECK(cudaMemset(dst, byte, bytes));")],
        None, ("test_cuda_kernels_emu", ["test_deterministic", "test_replayed"]),
        "the test's own race (issue 35): inputs and outputs filled on the legacy stream, which the "
        "ranks' non-blocking streams do not wait for"),
    "registered_reads_before_handshake": (
        KERNEL,
        "  if (wait_all(a, 0, seq, 0, tag)) {",
        "  if (true) {",
        ("test_cuda_kernels_emu", ["test_registered"]),
        "the registered all_reduce reads the peers' copies before they say their inputs are there"),
    "registered_returns_before_peers_wrote": (
        KERNEL,
        "    post_all(a, 1, seq, 0, tag);\n    wait_all(a, 1, seq, 0, tag);",
        "    post_all(a, 1, seq, 0, tag);",
        ("test_cuda_kernels_emu", ["test_registered_result_in_stream_order"]),
        "a rank's call ends while peers still write their results into its copy: the next call's "
        "input is overwritten"),
    "registered_tag_not_in_headers": (
        KERNEL,
        "  auto tag = [&](int) { return a.reg_tag; };",
        "  auto tag = [&](int) { return uint64_t{0}; };",
        ("test_cuda_kernels_emu", ["test_registered_mismatch"]),
        "ranks whose tensors sit at other offsets read and write each other's wrong elements, "
        "silently"),
    "registered_plan_past_the_end": (
        "csrc/cuda/p2p.cpp",
        "      if (!g.mapped || p < base || p + bytes > base + g.bytes) continue;",
        "      if (!g.mapped || p < base || p >= base + g.bytes) continue;",
        ("test_cuda_kernels_emu", ["test_registered"]),
        "a tensor that runs past its buffer's end is reduced in the peers' copies past theirs"),
    "direct_ignores_ring_messages": (
        KERNEL,
        "      if (ring_call && ring_runs_this_call(a, ring_call)) return abort_word(kMismatch, a.rank);",
        "",
        ("test_cuda_kernels_emu", ["test_mismatch_direct_against_ring"]),
        "a rank running the ring and one running a direct algorithm for the same call wait for each "
        "other until the timeout"),
    "ring_message_of_a_later_call_is_a_mismatch": (
        KERNEL,
        "  return got->op_seq == a.op_seq && got->algo == static_cast<uint8_t>(Algo::Ring);",
        "  return got->algo == static_cast<uint8_t>(Algo::Ring);",
        ("test_cuda_kernels_emu", ["test_ring", "test_registered"]),
        "upstream, done with a direct call, starts the next call (the ring) while this rank still "
        "waits in the direct one: no mismatch, but this check would call it one"),
    "wait_outcome_for_thread0_only": (
        KERNEL,
        "        record_stop(a, stop, true, q, w, false, mine, &got);\n      }\n    }\n    s_stop = stop;\n"
        "  }\n  __syncthreads();\n  return s_stop == 0;",
        "        record_stop(a, stop, true, q, w, false, mine, &got);\n      }\n    }\n    s_stop = stop;\n"
        "  }\n  __syncthreads();\n  return threadIdx.x != 0 || s_stop == 0;",
        ("test_cuda_kernels_emu", ["test_mismatch"]),
        "on a failed wait thread 0 stops and the other threads go on to the next barrier (the class of "
        "session 15's outcome-word bug): divergent barriers, which the emulator now names"),
    "fold_rounds_every_step": (
        "csrc/cuda/reduce.cuh",
        "        for (int k = 0; k < K; ++k) acc[u][k] = apply<Op>(acc[u][k], N::up(x[k]));",
        "        for (int k = 0; k < K; ++k) acc[u][k] = N::up(N::down(apply<Op>(acc[u][k], N::up(x[k]))));",
        ("test_nccl_ring_emu", ["test_deterministic"]),
        "the rank-order fold rounds fp16/bf16 after every rank instead of once"),
    "fold_unrolled_rereads_first_source": (
        "csrc/cuda/reduce.cuh",
        "      const uint4* sq = vsrc(q);",
        "      const uint4* sq = vsrc(0);",
        ("test_cuda_kernels_emu", ["test_ring"]),
        "the fold's unrolled body (several loads in flight) reads the first source for every source"),
    "fold_unrolled_stores_one_lane": (
        "csrc/cuda/reduce.cuh",
        "      for (int d = 0; d < nd; ++d) __stcg(reinterpret_cast<uint4*>(dst[d] + head) + i + u * nthreads, r);",
        "      for (int d = 0; d < nd; ++d) __stcg(reinterpret_cast<uint4*>(dst[d] + head) + i, r);",
        ("test_cuda_kernels_emu", ["test_ring"]),
        "the fold's unrolled body stores every lane's result at the first lane's index"),
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
            r = subprocess.run([str(BUILD / test), *args], capture_output=True, text=True, timeout=600)
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
