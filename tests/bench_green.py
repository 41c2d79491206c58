"""Can a large decode step hide its projections and norms under its attention? The premise of a
decode step split in two halves that take turns (a developer tool, not a test; docs/perf_notes.md
row 65).

A decode layer at 256 sequences spends most of its time in the attention kernel, which is bound
by HBM, and the rest in cuBLAS products and small kernels, which are bound by their fixed costs.
Split the batch in two halves A and B, and run every attention kernel on one stream (A0, B0, A1,
B1, ...) and everything else on another: while B's attention of layer l streams the KV cache,
A's o_proj, MLP and next qkv_proj run beside it. Row 28 tried two halves on two plain streams,
and lost: the attention kernels fill every SM, so the other stream's kernels mostly wait. Here
the two streams can also live in CUDA green contexts, which give each stream its own SMs.

For L layers of the Qwen3-0.6B shape (cuBLAS products, the engine's Triton norms, q/k norm + RoPE
+ store, SiLU and decode attention on a scattered paged cache), in CUDA graphs, us per layer:
the whole batch on one stream (what the engine does), the two halves one after the other, and
the two halves taking turns on plain streams and on green contexts of several SM splits; also
attention alone and the rest alone on each green context.

    PYTHONPATH=. python3 tests/bench_green.py [--layers 8] [--seqs 256]
"""
import argparse
import ctypes
import random

import torch
import torch.nn.functional as F

from gpu_timing import us_per_call_in_graph
from nanovllm.kernels import triton_attention as ta
from nanovllm.kernels.triton_fused import qk_norm_rope_store, rms_norm, silu_and_mul

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, PAGE = 1024, 16, 8, 128, 3072, 256
EPS = 1e-6


def green_streams(first_sms: int) -> tuple[list[torch.cuda.ExternalStream], list[int]]:
    """Two streams on disjoint SMs: a green context of first_sms SMs (rounded up by the driver)
    and one of the SMs left over. -> (streams, their SM counts). CUDA driver API through ctypes."""
    cu = ctypes.CDLL("libcuda.so.1")

    def check(result, what):
        if result != 0:
            name = ctypes.c_char_p()
            cu.cuGetErrorString(result, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {result} {name.value}")

    torch.zeros(1, device="cuda")                      # the primary context exists and is current
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()), "cuDeviceGet")
    resource_bytes = 1024                              # more than sizeof(CUdevResource) in CUDA 12 and 13
    whole, group, rest = ((ctypes.c_ubyte * resource_bytes)() for _ in range(3))
    check(cu.cuDeviceGetDevResource(dev, whole, 1), "cuDeviceGetDevResource")     # 1: CU_DEV_RESOURCE_TYPE_SM
    num_groups = ctypes.c_uint(1)
    check(cu.cuDevSmResourceSplitByCount(group, ctypes.byref(num_groups), whole, rest, 0, first_sms),
          "cuDevSmResourceSplitByCount")
    streams, counts = [], []
    for resource in (group, rest):
        desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(cu.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1), "cuDevResourceGenerateDesc")
        check(cu.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, 1), "cuGreenCtxCreate")   # 1: default stream
        check(cu.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, 1, 0), "cuGreenCtxStreamCreate")  # non-blocking
        streams.append(torch.cuda.ExternalStream(stream.value))
        counts.append(ctypes.c_uint.from_buffer(resource, 96).value)      # CUdevResource.sm.smCount
    return streams, counts


class Layers:
    """L decode layers of the Qwen3-0.6B shape, each with its own weights and its own scattered
    paged KV cache (so both come from HBM), over `lens` contexts."""

    def __init__(self, num_layers: int, lens: list[int]):
        dev, bf16 = "cuda", torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(0)

        def weight(*shape):
            return (torch.randn(*shape, device=dev, generator=gen) * shape[-1] ** -0.5).to(bf16)

        self.num_layers = num_layers
        self.qkv = [weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN) for _ in range(num_layers)]
        self.o = [weight(HIDDEN, HEADS * HEAD_DIM) for _ in range(num_layers)]
        self.gate_up = [weight(2 * INTER, HIDDEN) for _ in range(num_layers)]
        self.down = [weight(HIDDEN, INTER) for _ in range(num_layers)]
        self.norm = torch.ones(HIDDEN, device=dev, dtype=bf16)
        self.head_norm = torch.ones(HEAD_DIM, device=dev, dtype=bf16)
        pos = torch.arange(4096, device=dev, dtype=torch.float32)[:, None]
        freqs = pos * 1e6 ** (-torch.arange(0, HEAD_DIM, 2, device=dev) / HEAD_DIM)
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
        width = max(-(-n // PAGE) for n in lens)
        num_blocks = len(lens) * width + 64
        self.k_cache, self.v_cache = [], []
        for _ in range(num_layers):
            self.k_cache.append(torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, device=dev, generator=gen).to(bf16))
            self.v_cache.append(torch.randn_like(self.k_cache[-1]))
        perm = torch.randperm(num_blocks, device=dev, generator=gen)[:len(lens) * width]
        self.tables = perm.view(len(lens), width).to(torch.int32)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.positions = self.seq_lens.long() - 1
        last = self.positions
        self.slots = (self.tables.gather(1, (last // PAGE)[:, None]).squeeze(1).long() * PAGE + last % PAGE)
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def half(self, rows: slice) -> dict:
        """The per-sequence inputs of a slice of the batch."""
        return dict(tables=self.tables[rows], seq_lens=self.seq_lens[rows], positions=self.positions[rows],
                    slots=self.slots[rows])

    def pre(self, x, res, layer, part):
        """add + RMSNorm, qkv_proj, q/k norm + RoPE + K/V store -> (q, residual)."""
        h, res = (rms_norm(x, self.norm, EPS), x) if res is None else rms_norm(x, self.norm, EPS, res)
        qkv = F.linear(h, self.qkv[layer])
        q = qk_norm_rope_store(qkv, part["positions"], self.cos_sin, HEADS, KV_HEADS, HEAD_DIM, self.head_norm,
                               self.head_norm, EPS, self.k_cache[layer], self.v_cache[layer], part["slots"])
        return q, res

    def attend(self, q, layer, part):
        splits = ta.decode_split_config(q.shape[0], KV_HEADS, self.num_sms, 4096)
        return ta.decode_attention(q, self.k_cache[layer], self.v_cache[layer], part["tables"], part["seq_lens"],
                                   HEAD_DIM ** -0.5, *splits, fuse_merge=False)

    def post(self, o, res, layer):
        """o_proj, add + RMSNorm, gate_up, SiLU x up, down -> (x, residual)."""
        x = F.linear(o.view(o.shape[0], -1), self.o[layer])
        h, res = rms_norm(x, self.norm, EPS, res)
        return F.linear(silu_and_mul(F.linear(h, self.gate_up[layer])), self.down[layer]), res


def one_stream(model: Layers, x, parts: list[dict], keep: list):
    """The layers for each part in turn, on the current stream (one part: the engine's step)."""
    rows = 0
    for part in parts:
        n = part["seq_lens"].shape[0]
        xp, res = x[rows:rows + n], None
        for layer in range(model.num_layers):
            q, res = model.pre(xp, res, layer, part)
            o = model.attend(q, layer, part)
            xp, res = model.post(o, res, layer)
            keep += [q, o, xp, res]
        rows += n


def taking_turns(model: Layers, x, parts: list[dict], attn_stream, rest_stream, keep: list):
    """Every attention kernel on attn_stream (A0, B0, A1, B1, ...), everything else on rest_stream
    (pre A0, pre B0, post A0 + pre A1, post B0 + pre B1, ...), ordered by events: while one half's
    attention runs, the other half's products and norms can."""
    here = torch.cuda.current_stream()
    attn_stream.wait_stream(here)
    rest_stream.wait_stream(here)
    state, ready = [], []
    rows = 0
    with torch.cuda.stream(rest_stream):
        for part in parts:
            n = part["seq_lens"].shape[0]
            q, res = model.pre(x[rows:rows + n], None, 0, part)
            state.append([q, res])
            ready.append(rest_stream.record_event())
            rows += n
    for layer in range(model.num_layers):
        done = []
        for i, part in enumerate(parts):
            with torch.cuda.stream(attn_stream):
                attn_stream.wait_event(ready[i])
                o = model.attend(state[i][0], layer, part)
                done.append(attn_stream.record_event())
            state[i][0] = o
            keep.append(o)
        for i, part in enumerate(parts):
            with torch.cuda.stream(rest_stream):
                rest_stream.wait_event(done[i])
                xp, res = model.post(state[i][0], state[i][1], layer)
                if layer + 1 < model.num_layers:
                    q, res = model.pre(xp, res, layer + 1, part)
                    state[i] = [q, res]
                ready[i] = rest_stream.record_event()
                keep += [xp, res]
    here.wait_stream(attn_stream)
    here.wait_stream(rest_stream)


def us_per_layer(model: Layers, run, replays: int = 20) -> float:
    """Microseconds per layer of `run(keep)` captured in one CUDA graph (keep: a list that holds
    every tensor it makes, so that none is reused inside the capture)."""
    keep: list = []
    return us_per_call_in_graph([lambda: run(keep)], replays) / model.num_layers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=1800)
    parser.add_argument("--rest-sms", default="16,24,32,40")
    args = parser.parse_args()
    random.seed(0)
    lens = [random.randint(args.min_len, args.max_len) for _ in range(args.seqs)]
    model = Layers(args.layers, lens)
    x = torch.randn(args.seqs, HIDDEN, device="cuda", dtype=torch.bfloat16)
    half = args.seqs // 2
    whole = [model.half(slice(0, args.seqs))]
    halves = [model.half(slice(0, half)), model.half(slice(half, args.seqs))]
    kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * 2
    print(f"{args.seqs} sequences of {args.min_len}-{args.max_len} tokens (mean {sum(lens) / len(lens):.0f}), "
          f"{args.layers} layers, K/V {kv_bytes / 1e9:.2f} GB a layer; us per layer in CUDA graphs")
    rows = []

    def measure(name, run):
        try:
            us = us_per_layer(model, run)
            rows.append((name, f"{us:8.1f}"))
        except Exception as e:                 # report and go on: a variant the driver refuses
            rows.append((name, f"failed: {type(e).__name__}: {str(e)[:150]}"))
            torch.cuda.synchronize()
        print(f"  {rows[-1][0]:55} {rows[-1][1]}", flush=True)

    q_in = torch.randn(args.seqs, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def on(stream, work):
        """work() on stream (the current one if None), joined to the current stream before and after."""
        here = torch.cuda.current_stream()
        stream = stream or here
        stream.wait_stream(here)
        with torch.cuda.stream(stream):
            work()
        here.wait_stream(stream)

    def attention_only(parts, stream=None):
        def work(keep):
            rows = 0
            for part in parts:
                n = part["seq_lens"].shape[0]
                for layer in range(model.num_layers):
                    keep.append(model.attend(q_in[rows:rows + n], layer, part))
                rows += n
        return lambda keep: on(stream, lambda: work(keep))

    def rest_only(parts, stream=None):
        def work(keep):
            rows = 0
            for part in parts:
                n = part["seq_lens"].shape[0]
                o, res = q_in[rows:rows + n], x[rows:rows + n]
                for layer in range(model.num_layers):
                    xp, res = model.post(o, res, layer)
                    q, res = model.pre(xp, res, (layer + 1) % model.num_layers, part)
                    keep += [xp, res, q]
                rows += n
        return lambda keep: on(stream, lambda: work(keep))

    for _ in range(2):                         # twice: the spread between identical runs
        measure("whole batch, one stream (the engine)", lambda keep: one_stream(model, x, whole, keep))
    measure("halves one after the other, one stream", lambda keep: one_stream(model, x, halves, keep))
    measure("attention alone, whole batch", attention_only(whole))
    measure("attention alone, halves", attention_only(halves))
    measure("rest alone, whole batch", rest_only(whole))
    measure("rest alone, halves", rest_only(halves))
    plain = [torch.cuda.Stream(), torch.cuda.Stream()]
    measure("halves taking turns, plain streams",
            lambda keep: taking_turns(model, x, halves, plain[0], plain[1], keep))
    high = torch.cuda.Stream(priority=-1)
    measure("halves taking turns, plain streams, rest high priority",
            lambda keep: taking_turns(model, x, halves, plain[0], high, keep))
    for rest_sms in map(int, args.rest_sms.split(",")):
        try:
            (rest_stream, attn_stream), (got_rest, got_attn) = green_streams(rest_sms)
        except Exception as e:
            print(f"  green contexts of {rest_sms} SMs: {type(e).__name__}: {e}")
            continue
        tag = f"green {got_attn} + {got_rest} SMs"
        measure(f"{tag}: attention alone, halves", attention_only(halves, attn_stream))
        measure(f"{tag}: rest alone, halves", rest_only(halves, rest_stream))
        measure(f"{tag}: halves taking turns",
                lambda keep: taking_turns(model, x, halves, attn_stream, rest_stream, keep))
    for _ in range(1):
        measure("whole batch, one stream (the engine), again", lambda keep: one_stream(model, x, whole, keep))
    print(f"\nsummary ({args.seqs} sequences, us per layer)")
    for name, value in rows:
        print(f"  {name:55} {value}")


if __name__ == "__main__":
    main()
