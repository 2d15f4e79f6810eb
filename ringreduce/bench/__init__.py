"""The benchmark suite: ``python -m ringreduce.bench`` (nccl-tests style).

Runs all_reduce, reduce_scatter and all_gather over a sweep of sizes on every backend, alternating
the backends iteration by iteration so that drift (other load, frequency changes) hits all alike,
and prints one row per (collective, size, backend) in the nccl-tests layout::

    size(B) count type redop backend | time(us) algbw(GB/s) busbw(GB/s) #wrong   (out-of-place)
                                     | time(us) algbw(GB/s) busbw(GB/s) #wrong   (in-place)

then a summary: average busbw per backend and collective, the time ratio of each baseline to
ringreduce per size, and the peak memory bandwidth measured in the same run (the physical limit).

Where it runs
    No arguments: with no GPU, one CPU rank per core (2 to 4) over shared memory; with two or more
    GPUs, one rank per GPU; with one GPU, 4 ranks sharing it (at most one per core). More ranks
    than cores (--nranks) run with a note: they wait for a core, and their ratios swing. CPU ranks are forked from the launcher (which imported
    torch and ran nothing of it), GPU ranks by a fork server that imported torch; all are joined
    by a Gloo group on a FileStore in a temporary directory (no ports). Under ``torchrun`` (RANK,
    WORLD_SIZE and MASTER_ADDR set) the process is one of the ranks and rank 0 prints.
    ringreduce/shm joins ranks of one host only; on several hosts use the GPU transports.

What it says and writes
    Before the tables: the load average, a legend of the backends it runs, and a line for each
    peer it leaves out and why ("torch/nccl  no GPU", MPI or DeepSpeed not installed or not asked
    for). After them: the load average again, then the results folder it wrote (default
    bench-results/<date>-<time> in the current folder; --results DIR, --no-results):
    results.json (every row, the machine, the flags), summary.md (the tables in markdown) and,
    with matplotlib, busbw.png (and time_vs_n.png for several --nranks).

Backends
    ``ringreduce`` (CPU: transport shm; GPU: p2p and nccl, each a backend of its own, chosen with
    RINGREDUCE_TRANSPORT; a transport that fails a first tiny call on any rank is skipped with a
    note), ``torch`` (torch.distributed on Gloo for CPU tensors, NCCL for CUDA tensors) and ``ps``
    (parameter server from torch.distributed ops: all_reduce = reduce to rank 0 + broadcast,
    reduce_scatter = reduce to rank 0 + scatter, all_gather = gather to rank 0 + broadcast; rank 0
    moves 2(N-1) tensors where a ring rank moves 2(N-1)/N, so the gap grows with N). torch and ps
    skip integer ``avg`` (torch.distributed has none), with a note. ``torch/symm`` (GPU only;
    without one a note says so and the run goes on): torch's SymmetricMemory all-reduces, the peer
    that runs two ranks on one GPU (the launcher sets TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
    where ranks share a GPU), as four rows: torch/symm-oneshot and -twoshot on ordinary tensors
    (copied into a symmetric buffer, as vLLM calls them), -oneshot-sym and -twoshot-sym on
    symmetric tensors (beside ringreduce/p2p-shared); all_reduce, sum, float and bfloat16 only
    (other cases skip with a note).

Definitions (nccl-tests)
    bytes = the full tensor (all_reduce: the tensor; reduce_scatter: the input; all_gather: the
    output). algbw = bytes / time in GB/s (1e9). busbw = algbw * 2(N-1)/N for all_reduce and
    algbw * (N-1)/N for reduce_scatter and all_gather. For reduce_scatter and all_gather the element
    count is rounded down to a multiple of N (at least N). time = median over the timed iterations
    of the slowest rank's time per call (each rank times -m calls back to back, starting together
    after a barrier, and divides by -m; the calls are over when the last rank is done). -m
    defaults to enough calls to move 1 MiB, at most 32, so the barrier's skew (tens of us on a
    loaded host) does not swamp calls that take a few; at 1 MiB and above it is 1. On CUDA the timed region ends with a device
    synchronize.

Out-of-place and in-place
    reduce_scatter and all_gather have both forms natively: out-of-place uses separate input and
    output tensors, in-place makes this rank's chunk of the big tensor the small one (nccl-tests'
    recvbuff = sendbuff + rank * count). all_reduce is in place only, in ringreduce and in
    torch.distributed. nccl-tests' out-of-place all_reduce reads one buffer and writes another, so
    the cost of producing the result somewhere else is inside the measured call. The honest
    emulation is therefore ``out.copy_(input); all_reduce(out)`` with the copy INSIDE the timed
    region, for every backend alike (copying before the timer starts would just measure the
    in-place call a second time). The same holds for the ps reduce_scatter, whose reduce step
    needs a scratch copy of the input to leave the input intact. The summary ratios use in-place.

Checking (-c 1, the default)
    Every timed result is checked; warmup results are not. Rank r's element i is a deterministic
    function of (r, i) (small integers or multiples of 1/8, chosen so that sums, products, minima
    and maxima are exact in every dtype for the rank counts used), so the expected result is
    computed on each rank from the same formula, in float64 or int64. Before every call the
    output is filled with a sentinel value, so a call that writes nothing cannot pass on a previous
    result. Floats are wrong when ``|out - expected| > eps(dtype) * (N(N-1)/2 + 1)`` (a bound on
    the rounding of N-1 partial sums of magnitude <= N, plus avg's division) or NaN; integers
    must be exact (integer avg truncates toward zero, as NCCL). #wrong = wrong elements summed
    over ranks, in the worst timed iteration; with -c 0 it prints N/A. The exit status is 1 when
    any element was wrong. ``--corrupt-for-test BACKEND`` (hidden, test-only) adds 100 to element
    0 of rank 0's result after the first timed call of that backend in every row, so the tests can
    see the check fail. ``--stall-for-test MS`` (hidden, test-only) has rank 0 sleep MS inside
    every batch of the first warm-up iterations, as a descheduled rank would, so the tests can see
    that a stalled warm-up does not leave short timed batches. ``--crash-at-exit-for-test RANK``
    (hidden, test-only) has that rank abort after its sweep and teardown: a rank that dies there
    (not in the sweep or ringreduce's close) is a warning, and its results are kept.

Peak memory bandwidth
    CPU: rank 0 copies a 256 MiB tensor with torch (all cores), counting read + write (2 x bytes)
    per copy, median of 5, while the other ranks wait; measured before and after the sweep, the
    larger is reported. GPU: the same with a device-to-device copy on rank 0's GPU, timed with
    CUDA events.

Defaults
    CPU: sizes 4 KiB .. 64 MiB, factor 4; 10 iterations after 2 warmup; about 3 minutes for 4
    ranks on 2 cores (the default there is 2). GPU: 4 KiB .. 256 MiB, factor 4, 20 iterations after 5 warmup. ``--quick``:
    1 KiB .. 64 KiB, factor 8, 3 iterations after 1 warmup. Explicit flags override either.
"""
