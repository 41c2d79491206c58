"""Is a grid-wide barrier inside one persistent kernel cheaper than a kernel boundary? The premise
of a decode layer as one kernel at batch 1 (docs/perf_notes.md, Next 6a), measured before any
such kernel is written (a developer tool, not a test).

Per phase, in a CUDA graph, one program per SM: a chain of kernels, one a phase (with and without
programmatic dependent launch), against one kernel whose programs pass a grid barrier after each
phase (an arrival counter in global memory that every program spins on). Each phase either does
nothing or reads its own slice of a weight-sized buffer (fresh from HBM: the phases cycle through
more bytes than L2 holds), summed so the reads stay; "early" variants load a phase's slice before
the wait for the phase before (PDL's wait, or the barrier), as a decode layer could load weights.

    PYTHONPATH=. python3 tests/bench_barrier.py
"""
import torch
import triton
import triton.language as tl

from gpu_timing import us_per_call_in_graph
from nanovllm.kernels import pdl

BLOCK = 16384         # elements a program can read in one phase (bf16: 32 KB, all loads in flight at once)
NUM_PHASES = 64


@triton.jit
def _load_slice(src_ptr, phase, slice_elems, BLOCK: tl.constexpr):
    """This program's share of phase `phase`'s slice of src (at most BLOCK elements), loaded."""
    program, num_programs = tl.program_id(0), tl.num_programs(0)
    per_program = tl.multiple_of(slice_elems // num_programs, 64)   # (main makes it so: 16-byte loads)
    offs = tl.arange(0, BLOCK)
    return tl.load(src_ptr + phase * slice_elems + program * per_program + offs, mask=offs < per_program, other=0.0)


@triton.jit
def _phase_kernel(src_ptr, out_ptr, phase, slice_elems, BLOCK: tl.constexpr, PDL: tl.constexpr,
                  EARLY: tl.constexpr):
    """One phase. EARLY: the slice is loaded before the wait for the kernel before (it does not
    depend on it), as the projection kernels prefetch their weights."""
    if EARLY:
        x = _load_slice(src_ptr, phase, slice_elems, BLOCK)
    pdl.begin(PDL)
    if not EARLY:
        x = _load_slice(src_ptr, phase, slice_elems, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x.to(tl.float32), 0))


@triton.jit
def _grid_barrier(counter_ptr, phase):
    """Every program arrives, then waits until all have (the counter counts arrivals since zeroed)."""
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    target = (phase + 1) * tl.num_programs(0)
    while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target:
        pass


@triton.jit
def _persistent_kernel(src_ptr, out_ptr, counter_ptr, num_phases, slice_elems, BLOCK: tl.constexpr,
                       BARRIER: tl.constexpr, EARLY: tl.constexpr):
    """Every phase in one kernel. EARLY: the next phase's slice is loaded before the barrier."""
    total = 0.0
    x = _load_slice(src_ptr, 0, slice_elems, BLOCK)
    for phase in range(num_phases):
        if EARLY:
            current = x
            x = _load_slice(src_ptr, (phase + 1) % num_phases, slice_elems, BLOCK)
        else:
            current = _load_slice(src_ptr, phase, slice_elems, BLOCK)
        total += tl.sum(current.to(tl.float32), 0)
        if BARRIER:
            _grid_barrier(counter_ptr, phase)
    tl.store(out_ptr + tl.program_id(0), total)


def main():
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(num_sms, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    columns = ["kernels", "+PDL", "+PDL early", "barriers", "barr. early", "no barrier"]
    print(f"us per phase, {NUM_PHASES} phases, {num_sms} programs, in a CUDA graph; early: the phase's "
          f"slice loaded before the wait")
    print(f"{'slice':>8} " + " ".join(f"{c:>11}" for c in columns))
    for slice_kb in (0, 1024, 2048, 4096):
        slice_elems = slice_kb * 1024 // 2 // (64 * num_sms) * (64 * num_sms)
        assert slice_elems // num_sms <= BLOCK
        src = torch.randn(max(1, NUM_PHASES * slice_elems), device="cuda").to(torch.bfloat16)
        row = []
        for use_pdl, early in ((False, False), (True, False), (True, True)):
            options = dict(PDL=True, launch_pdl=True) if use_pdl else dict(PDL=False)
            calls = [lambda p=p: _phase_kernel[(num_sms,)](src, out, p, slice_elems, BLOCK=BLOCK, EARLY=early,
                                                           num_warps=8, **options)
                     for p in range(NUM_PHASES)]
            row.append(us_per_call_in_graph(calls) if pdl.enabled() or not use_pdl else float("nan"))
        for barrier, early in ((True, False), (True, True), (False, False)):
            def persistent(barrier=barrier, early=early):
                counter.zero_()
                _persistent_kernel[(num_sms,)](src, out, counter, NUM_PHASES, slice_elems, BLOCK=BLOCK,
                                               BARRIER=barrier, EARLY=early, num_warps=8)
            row.append(us_per_call_in_graph([persistent]) / NUM_PHASES)
        print(f"{slice_kb / 1024:5.0f} MB " + " ".join(f"{v:11.2f}" for v in row))


if __name__ == "__main__":
    main()
