"""ModelRunner: owns the model, its KV cache, the attention backend, the CUDA graphs (decode steps
whole, other steps in pieces) and the sampler; turns a SchedulerOutput into sampled tokens."""
import bisect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from nanovllm.config import Config
from nanovllm.distributed import SINGLE, TPGroup
from nanovllm.engine import kv_cache
from nanovllm.engine.block_table_sync import BlockTableReceiver, BlockTableSender
from nanovllm.engine.cuda_graph import DecodeGraphs, graph_buckets
from nanovllm.engine.draft_model import DraftModel
from nanovllm.engine.logits_processors import ProcessorBatch
from nanovllm.engine.penalty_counts import PenaltyCounts
from nanovllm.engine import piecewise_graphs
from nanovllm.engine.prompt_logprobs import PromptScores, score_prompts
from nanovllm.engine.sampling_inputs import build_sampling_metadata
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sleep import SLEEP_TAGS, ArenaMemory, Hibernation, Storages
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.shared_prefix import SharedPrefixPlan, plan_arrays, plan_shared_prefixes
from nanovllm.engine.speculative import sampling_rows
from nanovllm.engine.step_inputs import (HostBatch, StepInputs, build_step, embed_rows, mixed_step_decodes,
                                         prompt_spans, token_rows)
from nanovllm.engine.structured_output import BitmaskFiller
from nanovllm.engine.upload import upload
from nanovllm.kernels import compile_ahead, device as device_info
from nanovllm.kernels.counters import NUM_COUNTERS
from nanovllm.layers.attention import Attention, AttentionMetadata, MixedDecodes, SharedPrefixes, select_backend
from nanovllm.layers.pooler import Pooler
from nanovllm.layers.sampler import Sampler
from nanovllm.layers.sampling_metadata import SamplerOutput, SamplingMetadata
from nanovllm.engine.profiler import ProfilerConfig, RankProfiler
from nanovllm.logger import init_logger
from nanovllm.lora.adapter import LORA_MODULES, AdapterCache
from nanovllm.lora.layers import LoRAModel, SlotTable
from nanovllm.model.loader import init_dummy_weights, load_model
from nanovllm.model.qwen3 import build_model
from nanovllm.utils.cuda_vmm import Arena, place_in_arena
from nanovllm.sampling_params import SamplingParams

logger = init_logger(__name__)

MAX_GRAPH_BATCH_SIZE = 512


def runner_device(config: Config, rank: int) -> torch.device:
    return torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")


@dataclass(frozen=True)
class SplitRules:
    """How the attention kernels cut a step of num_seqs sequences' work, for the runner and the decode
    graphs. (An object of its own: the graphs keeping the runner's bound methods would tie them to the
    runner in a reference cycle, and an engine dropped with `del llm` would hold its GPU memory until
    the garbage collector ran.)"""
    num_kv_heads: int
    num_sms: int
    max_model_len: int
    shared_prefix_tile_seqs: int | None   # sequences a shared-prefix tile (None: no shared-prefix kernel)

    def decode_split(self, num_seqs: int) -> tuple[int, int]:
        from nanovllm.kernels.triton_attention import decode_split_config
        return decode_split_config(num_seqs, self.num_kv_heads, self.num_sms, self.max_model_len)

    def shared_prefix_splits(self, num_seqs: int) -> int:
        """The most parts the shared-prefix kernel reads a tile's prefix in, for a step of num_seqs
        sequences (as if they made one run: whole tiles, the GPU filled by their parts)."""
        from nanovllm.kernels.triton_attention import shared_prefix_splits
        return shared_prefix_splits(-(-num_seqs // self.shared_prefix_tile_seqs), self.num_kv_heads, self.num_sms)


class ModelRunner:
    def __init__(self, config: Config, eos_token_ids: set[int], tp: TPGroup = SINGLE, workers=None,
                 sampling_defaults: SamplingParams | None = None):
        """tp: this rank's tensor-parallel group. workers: on rank 0 with tensor parallelism,
        the TPWorkers that mirror every step. sampling_defaults: the requests' default
        SamplingParams (the model's generation config): the sampler's kernels are compiled at
        start-up for the model's dtype, with its top_k / top_p if it sets them (Qwen3's own
        defaults are top_k 20, top_p 0.95)."""
        self.config = config
        self.tp, self.workers = tp, workers
        self.table_sender = BlockTableSender() if workers is not None else None
        self.table_receiver = BlockTableReceiver() if tp.rank > 0 else None
        self.device = runner_device(config, tp.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.block_size = config.block_size
        self.eos_token_ids = sorted(eos_token_ids)
        hf = config.hf_config
        self.vocab_size = hf.vocab_size
        self.pooling = config.runner_type == "pooling"   # an embedding model or a classifier: no sampling
        self.timings: dict[str, float] = {}
        self.profiler = RankProfiler(config.profiler_config or ProfilerConfig(), tp.rank, self.device)
        start = time.perf_counter()
        torch.manual_seed(config.seed)
        self.model = build_model(hf, config.torch_dtype, self.device, tp, fp8=config.fp8_products,
                                 lm_head=not self.pooling, classifier=config.classifier)
        self._load_weights()
        # sleep mode on CUDA: the weights and the KV cache in arenas, so that they can be freed
        # and mapped again at the same addresses (engine/sleep.py)
        self.arenas: dict[str, Arena] | None = None
        if config.enable_sleep_mode and self.device.type == "cuda":
            self.arenas = {"weights": place_in_arena(list(self.model.parameters()), self.device)}
            torch.cuda.empty_cache()   # the weights' first copies
        self.timings["load_s"] = time.perf_counter() - start
        self.backend = select_backend(config.attention_backend, self.device, config.block_size,
                                      config.kv_cache_torch_dtype.itemsize == 1)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.shared_prefix_tile_seqs = None   # sequences a shared-prefix tile (None: each context read whole)
        if self.backend.supports_shared_prefixes:
            from nanovllm.kernels.triton_attention import shared_prefix_tile_rows
            layer = self.attention_layers[0]
            self.shared_prefix_tile_seqs = shared_prefix_tile_rows(layer.num_heads, layer.num_kv_heads)
        self.num_sms = device_info.num_sms(self.device) if self.device.type == "cuda" else 1
        self.splits = SplitRules(self.attention_layers[0].num_kv_heads, self.num_sms, config.max_model_len,
                                 self.shared_prefix_tile_seqs)
        # speculative decoding's draft model (engine/draft_model.py), its layers on this backend; with tensor
        # parallelism on the first rank alone, which sends the other ranks its drafts with the step
        self.draft = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and tp.rank == 0:
            self.draft = DraftModel(config, self.device, self.backend,
                                    lambda kv_heads: SplitRules(kv_heads, self.num_sms, config.max_model_len, None))
        # A decode step has a row a sequence; with speculative decoding a row a token (its last and its drafts,
        # step_inputs.token_rows), up to decode_query_len a sequence, while the rows fit a decode graph's.
        self.decode_query_len = 1 if spec is None else 1 + spec.num_speculative_tokens
        self.max_decode_rows = max(config.max_num_seqs,
                                   min(config.max_num_seqs * self.decode_query_len, MAX_GRAPH_BATCH_SIZE))
        self.lora = self.adapters = self.lora_slot_table = None
        if config.enable_lora:   # (lora/layers.py) the projections' slots, written from each step's inputs
            modules = config.lora_target_modules or list(LORA_MODULES)
            if self.pooling:   # no LM head (a classifier made of its rows keeps them as loaded)
                modules = [module for module in modules if module != "lm_head"]
            self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank,
                                  max(config.max_num_batched_tokens, self.max_decode_rows), modules)
            self.adapters = AdapterCache(hf, config.max_lora_rank, config.max_cpu_loras, config.download_dir,
                                         config.hf_token, modules)
            self.lora_slot_table = SlotTable(config.max_loras) if tp.rank == 0 else None
        samples = tp.rank == 0 and not self.pooling
        self.sampler = (Sampler(torch.Generator(device=self.device).manual_seed(config.seed), config.logprobs_mode)
                        if samples else None)
        self.penalty_counts = PenaltyCounts(self.vocab_size, self.device, config.max_num_seqs) if samples else None
        self.logits_processors = (ProcessorBatch(config.logits_processors, config, self.device)
                                  if samples and config.logits_processors else None)
        self.bitmask_filler = BitmaskFiller() if samples else None
        self.pooler = Pooler(config.pooler_config, self.model.score) if self.pooling and tp.rank == 0 else None
        self.last_sampled: torch.Tensor | None = None   # the latest step's sampled token ids, on the device

        start = time.perf_counter()
        self.num_kvcache_blocks = self._allocate_kv_cache()
        self.timings["kv_cache_s"] = time.perf_counter() - start
        self.graphs = None
        self.pieces: piecewise_graphs.PiecewiseGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.supports_cuda_graphs:
            start = time.perf_counter()
            if tp.size == 1:   # (not yet run with tensor parallelism)
                self.pieces = piecewise_graphs.PiecewiseGraphs(
                    self.model, min(config.max_num_batched_tokens, piecewise_graphs.MAX_TOKENS),
                    hf.hidden_size, config.torch_dtype, self.device)
            if not self.pooling:   # (a pooling engine's steps are prompts)
                self.graphs = self._capture_graphs()
            if self.draft is not None:
                self.draft.capture_graphs(min(self.max_decode_rows, MAX_GRAPH_BATCH_SIZE), self.max_blocks_per_seq,
                                          self.graphs.pool)
            self.timings["cuda_graphs_s"] = time.perf_counter() - start
            self._add_compile_ahead(self.graphs.compile_s if self.graphs is not None else None)
        self.hibernations: dict[str, Hibernation] | None = None   # sleep mode's, made by the first sleep()
        # the LM head computes the logits of n rows for logits_bucket(n) rows (see there)
        on_gpu = self.device.type == "cuda" and not self.pooling
        self.logits_buckets = graph_buckets(self.max_decode_rows) if on_gpu else []
        # Prompt tokens scored a logits pass (prompt_logprobs): the rows whose logits and sampling
        # the KV cache's sizing ran (_profile_kv_budget), so that a part fits what it measured.
        self.prompt_logits_rows = min(config.max_num_seqs, config.max_num_batched_tokens)
        if self.logits_buckets:
            start = time.perf_counter()
            self._warm_up_logits(hf.hidden_size, config.torch_dtype)
            self.timings["logits_warm_up_s"] = time.perf_counter() - start
        if self.sampler is not None and sampling_defaults is not None:
            start = time.perf_counter()
            if self.sampler.warm_up(self.vocab_size, config.torch_dtype, config.max_num_seqs,
                                    sampling_defaults.top_k, sampling_defaults.top_p):
                self.timings["sampler_warm_up_s"] = time.perf_counter() - start
        if tp.rank == 0:
            self._log_startup()

    def _load_weights(self):
        cfg = self.config
        if cfg.load_format == "dummy":
            init_dummy_weights(self.model, cfg.seed + self.tp.rank)
        else:
            load_model(self.model, cfg.model_path, cfg.hf_config.tie_word_embeddings, cfg.fp8_checkpoint)

    def _capture_graphs(self) -> DecodeGraphs:
        cfg = self.config
        return DecodeGraphs(self.model, min(self.max_decode_rows, MAX_GRAPH_BATCH_SIZE), self.max_blocks_per_seq,
                            cfg.hf_config.hidden_size, cfg.torch_dtype, self.device, self.splits.decode_split,
                            pool=None if self.pieces is None else self.pieces.pool,
                            shared_prefix_tile_seqs=self.shared_prefix_tile_seqs,
                            shared_prefix_splits_for=self.splits.shared_prefix_splits)

    def _add_compile_ahead(self, seconds: float | None):
        """Counts a dry pass's seconds (None: none ran) into the start-up's compile_ahead_s."""
        if seconds is not None:
            self.timings["compile_ahead_s"] = self.timings.get("compile_ahead_s", 0.0) + seconds

    def _log_startup(self):
        t = self.timings
        kv_gib = self.kv_cache.numel() * self.kv_cache.element_size() / 2**30
        message = (f"model loaded in {t['load_s']:.1f}s; KV cache: {self.num_kvcache_blocks} blocks of "
                   f"{self.block_size} tokens ({kv_gib:.2f} GiB, {self.config.kv_cache_dtype}) sized in "
                   f"{t['kv_cache_s']:.1f}s; attention backend: {type(self.backend).__name__}")
        if self.draft is not None:
            draft_gib = self.draft.kv_cache.numel() * self.draft.kv_cache.element_size() / 2**30
            message += (f"; draft model {self.config.speculative_config.model!r}, its K/V in the same blocks "
                        f"({draft_gib:.2f} GiB)")
        if self.graphs is not None:
            pieces = "" if self.pieces is None else f" and in pieces for {len(self.pieces.buckets)} token counts"
            message += (f"; CUDA graphs for {len(self.graphs.buckets)} batch sizes{pieces} captured in "
                        f"{t['cuda_graphs_s']:.1f}s")
        if self.logits_buckets:
            message += f"; LM head warmed up for {len(self.logits_buckets)} row counts in {t['logits_warm_up_s']:.1f}s"
        if "sampler_warm_up_s" in t:
            message += f"; sampler kernels warmed up in {t['sampler_warm_up_s']:.1f}s"
        if "compile_ahead_s" in t:
            message += f"; {t['compile_ahead_s']:.1f}s of sizing and capture compiled the model's kernels ahead"
        logger.info(message)

    # ---- LM head -----------------------------------------------------------------------------
    # cuBLAS chooses a kernel for each GEMM shape it meets and loads it on first use: ~1 ms of host
    # time, during which the GPU waits. A run meets every row count up to max_num_seqs (decode
    # batches shrink one by one), so a process's first run paid ~0.25 s for the LM head alone
    # (docs/perf_notes.md row 41). Padded to the graph buckets' sizes, which are warmed at start-up,
    # it meets none; the padding rows cost little, the product being bound by the weight's bytes.
    def logits_bucket(self, num_rows: int) -> int:
        """The row count the LM head computes num_rows rows' logits for (num_rows itself above the
        largest bucket and on the CPU)."""
        i = bisect.bisect_left(self.logits_buckets, num_rows)
        return self.logits_buckets[i] if i < len(self.logits_buckets) else num_rows

    @torch.inference_mode()
    def _warm_up_logits(self, hidden_size: int, dtype: torch.dtype):
        """The LM head once at every logits bucket (on every rank: with TP it gathers)."""
        for rows in self.logits_buckets:
            if self.lora is not None:
                self.lora.slots.select_rows(slice(0, rows))
            self.model.compute_logits(torch.zeros(rows, hidden_size, dtype=dtype, device=self.device))

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.config.max_model_len // self.block_size)

    # ---- KV cache (engine/kv_cache.py) ---------------------------------------------------------
    def _allocate_kv_cache(self) -> int:
        cfg = self.config
        num_blocks = cfg.num_kvcache_blocks
        own_bytes = kv_cache.block_bytes(self.attention_layers, self.block_size, cfg.kv_cache_torch_dtype)
        # (a draft model's K/V in the same blocks: a tensor of its own, which sleep mode does not free)
        block_bytes = own_bytes + (self.draft.block_bytes(cfg.kv_cache_torch_dtype) if self.draft is not None else 0)
        if num_blocks is None:
            if cfg.kv_cache_memory_bytes is not None:
                budget = cfg.kv_cache_memory_bytes
            elif self.device.type == "cuda":
                budget = self._profile_kv_budget()
            else:
                budget = kv_cache.CPU_KV_CACHE_BYTES
            # More blocks than max_num_seqs full-length sequences could ever use is waste.
            num_blocks = min(budget // block_bytes, cfg.max_num_seqs * self.max_blocks_per_seq)
            num_blocks = self.tp.min_over_ranks(num_blocks, self.device)   # every rank holds the same blocks
            if num_blocks < 1:
                setting = (f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes} (one block takes {block_bytes})"
                           if cfg.kv_cache_memory_bytes is not None
                           else f"gpu_memory_utilization={cfg.gpu_memory_utilization}")
                raise ValueError(f"no memory is left for the KV cache at {setting}; raise it or use a smaller model.")
        memory = None
        if self.arenas is not None:
            self.arenas["kv_cache"] = Arena(num_blocks * own_bytes, self.device)
            memory = self.arenas["kv_cache"].tensor()
        self.kv_cache = self._make_kv_cache(num_blocks, memory)
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks, cfg.kv_cache_torch_dtype)
        return num_blocks

    def _make_kv_cache(self, num_blocks: int, memory: torch.Tensor | None = None) -> torch.Tensor:
        return kv_cache.allocate(self.attention_layers, num_blocks, self.block_size,
                                 self.config.kv_cache_torch_dtype, self.device, memory)

    @torch.inference_mode()
    def _profile_kv_budget(self) -> int:
        """Bytes left for the KV cache: run the largest step (max_num_batched_tokens tokens over
        up to max_num_seqs sequences, then logits and sampling on the sampler's largest paths:
        the sorted top-k and, past the logprobs kernels' MAX_TOP, the raw log_softmax kept for the
        logprobs and logprob_token_ids), measure the peak, and keep
        gpu_memory_utilization of the card. Logit edits (penalties, logit_bias, allowed_token_ids,
        min_tokens) on top of those paths also keep a float32 copy of the logits (0.58 GiB at 1,024
        rows of 151,936); that rare combination, as in vLLM, is left to the rest of the card.
        tests/sizing_peak.py shows the step's peak call by call."""
        cfg = self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        num_seqs = min(cfg.max_num_seqs, num_tokens)
        lens = kv_cache.sizing_lens(num_tokens, num_seqs, cfg.max_model_len)
        num_pages = -(-max(lens) // self.block_size)
        self._make_kv_cache(num_pages)   # every dummy sequence uses the same pages

        def host_batch(lens: list[int]) -> HostBatch:
            positions = np.concatenate([np.arange(n) for n in lens])
            return HostBatch(input_ids=np.zeros(sum(lens), np.int64), positions=positions,
                             slot_mapping=positions.copy(),
                             block_tables=np.tile(np.arange(num_pages, dtype=np.int32), (len(lens), 1)),
                             query_start_loc=np.concatenate([[0], np.cumsum(lens)]).tolist(), seq_lens=lens)
        batch = host_batch(lens)
        inputs = self._device_inputs(batch)
        # Its kernels compiled first, with the sampler's, then those of a step of short prompts (kernels
        # chosen by length), those of a step of each power of two below it (kernels chosen by the step's
        # tokens: the small-batch products' rows, the MoE blocks' rows), so that prompt steps of other
        # sizes find them, and those of a decode step of each decode-kernel variant (chosen by the batch
        # size; the decode graphs' dry pass meets them again, an eager engine's steps would not).
        from nanovllm.kernels.triton_attention import decode_variant_sizes
        short = host_batch(kv_cache.even_split(num_tokens, num_seqs))
        powers_of_two = [1 << i for i in range((num_tokens - 1).bit_length())]
        smaller = [host_batch(kv_cache.even_split(n, -(-n // max(lens)))) for n in powers_of_two]
        decodes = [host_batch([1] * n) for n in decode_variant_sizes(self.max_decode_rows, self.splits.decode_split)]
        other_steps = [self._device_inputs(b) for b in [short, *smaller, *decodes]]
        if self.backend.supports_shared_prefixes:   # and each variant's kernels with shared prefixes
            other_steps += [self._device_inputs(b, shared=SharedPrefixPlan(np.zeros(len(b.seq_lens), np.int32),
                                                                           np.zeros((1, 3), np.int32)))
                            for b in decodes]
        # top_k without max_top_k or max_set_top_k sorts every row: the sampler's largest path; and
        # the logprobs at the engine's cap, with logprob_token_ids (a whole log_softmax kept past MAX_TOP).
        # With speculative decoding a sequence samples a row for its last token and one for each draft.
        if self.decode_query_len == 1:
            num_rows = num_seqs
            last_tokens = torch.tensor(batch.query_start_loc[1:], device=self.device) - 1
        else:
            num_rows = min(num_seqs * self.decode_query_len, num_tokens)
            last_tokens = torch.arange(num_rows, device=self.device)
        md = SamplingMetadata(
            temperatures=torch.ones(num_rows, device=self.device),
            is_greedy=torch.zeros(num_rows, dtype=torch.bool, device=self.device), all_greedy=False,
            any_greedy=False, top_k=torch.full((num_rows,), self.vocab_size, device=self.device), max_top_k=None,
            top_p=torch.full((num_rows,), 0.9, device=self.device),
            min_p=torch.full((num_rows,), 0.1, device=self.device),
            row_seeds=[], banned_rows=None, banned_tokens=None, max_num_logprobs=cfg.logprobs_cap,
            logprob_rows=torch.zeros(1, dtype=torch.int64, device=self.device),
            logprob_token_ids=torch.zeros(1, 1, dtype=torch.int64, device=self.device))

        def largest_step():
            hidden = self.model(*inputs)
            if self.pooling:
                return
            if self.lora is not None:
                self.lora.slots.select_rows(last_tokens)
            logits = self.model.compute_logits(hidden[last_tokens])
            if self.sampler is not None:
                self.sampler(logits, md)

        def dry_steps():
            largest_step()
            for step in other_steps:
                self.model(*step)

        self._add_compile_ahead(compile_ahead.dry_run(dry_steps))
        largest_step()
        kv_cache.release(self.attention_layers)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        if self.penalty_counts is not None:   # made by the first penalised request, after this
            peak += self.penalty_counts.reserved_bytes
        return kv_cache.cuda_budget(self.device, cfg.gpu_memory_utilization, peak)

    # ---- one step ---------------------------------------------------------------------------
    def plan_shared_prefixes(self, batch: HostBatch) -> SharedPrefixPlan | None:
        """A decode step's runs of sequences that begin with the same pages, where reading those once
        a run saves enough (engine/shared_prefix.py); None: none, or a backend that reads each
        sequence's context whole."""
        if self.shared_prefix_tile_seqs is None or len(batch.input_ids) != len(batch.seq_lens):
            return None
        if len(batch.seq_lens) * self.attention_layers[0].num_kv_heads > NUM_COUNTERS:   # (the fused merge's)
            return None
        return plan_shared_prefixes(batch.block_tables, batch.seq_lens, self.block_size, self.shared_prefix_tile_seqs)

    def _device_inputs(self, batch: HostBatch, pending: tuple[list[int], list[int]] | None = None,
                       shared: SharedPrefixPlan | None = None, splits: SplitRules | None = None,
                       sampled: torch.Tensor | None = None):
        """-> input_ids, positions, AttentionMetadata on the device, uploaded in one copy.
        pending: (rows, sources), as DecodeGraphs.run takes them: row rows[i] takes sampled[sources[i]] (the
        latest step's sampled tokens if None). shared: a decode step's plan of shared prefixes. splits: the
        attention's SplitRules (the model's if None; the draft model's)."""
        splits = splits or self.splits
        qsl = batch.query_start_loc
        max_query_len = max(b - a for a, b in zip(qsl, qsl[1:]))
        rows, sources = pending or ([], [])
        decode_seqs = []       # one-token sequences in a step with prompt tokens
        if max_query_len > 1 and self.backend.splits_mixed_steps:
            decode_seqs, max_prefill_seq_len = mixed_step_decodes(qsl, batch.seq_lens)
        # The decodes as the batch's first rows (sequences and tokens alike): sliced, not gathered.
        front = slice(0, len(decode_seqs)) if decode_seqs and decode_seqs[-1] == len(decode_seqs) - 1 else None
        gathered = decode_seqs if front is None else []
        arrays = [batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                  np.asarray(qsl, np.int32), np.asarray(batch.seq_lens, np.int32),
                  np.asarray(rows, np.int64), np.asarray(sources, np.int64),
                  np.asarray(gathered, np.int64), np.asarray([qsl[i] for i in gathered], np.int64)]
        if shared is not None:
            arrays += plan_arrays(shared, len(shared.prefix_lens), len(shared.tiles))
        if self.backend.needs_cu_seqlens_k:
            arrays.append(np.concatenate([[0], np.cumsum(batch.seq_lens)]).astype(np.int32))
        (input_ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens, rows, sources, decode_seqs_t,
         decode_rows, *rest) = upload(arrays, self.device)
        if shared is not None:
            prefix_lens, tiles, tile_count, *rest = rest
            shared = SharedPrefixes(prefix_lens, tiles, tile_count, len(tiles),
                                    splits.shared_prefix_splits(len(batch.seq_lens)))
        cu_seqlens_k = rest
        if pending:
            input_ids[rows] = (self.last_sampled if sampled is None else sampled)[sources]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=block_tables, query_start_loc=query_start_loc,
            seq_lens=seq_lens, query_start_loc_cpu=batch.query_start_loc, seq_lens_cpu=batch.seq_lens,
            max_query_len=max_query_len, max_seq_len=max(batch.seq_lens),
            cu_seqlens_k=cu_seqlens_k[0] if cu_seqlens_k else None)
        if max_query_len == 1 and self.device.type == "cuda":
            meta.decode_split = splits.decode_split(len(batch.seq_lens))
            meta.shared_prefixes = shared
        if decode_seqs:
            at, pick = (decode_rows, decode_seqs_t) if front is None else (front, front)   # (a slice: views)
            meta.decodes = MixedDecodes(rows=at, block_tables=block_tables[pick], seq_lens=seq_lens[pick],
                                        split=splits.decode_split(len(decode_seqs)),
                                        max_prefill_seq_len=max_prefill_seq_len)
        return input_ids, positions, meta

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingMetadata:
        """The sampler's inputs: a row per sequence and per draft (engine/speculative.py)."""
        md = build_sampling_metadata(sampling_rows(seqs), self.vocab_size, self.eos_token_ids, self.device,
                                     self.penalty_counts, self.bitmask_filler)
        if self.logits_processors is not None:
            md.processors = self.logits_processors.step(seqs)
        return md

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sampling_seqs: list[Sequence], pending: dict[int, int] | None = None,
                before_sampling: Callable[[], None] | None = None
                ) -> tuple[SamplerOutput | None, PromptScores | None]:
        """Rank 0: run the model on the scheduled tokens and sample one token for each of
        `sampling_seqs` (the sequences whose scheduled tokens reach their end; None if none
        sample), and score the prompt tokens of sequences that asked for prompt logprobs (the scores
        on their way to the host; None if none are scored).

        pending: {seq_id: row in the previous step's sampled tokens} for sequences whose last
        token the host has not read yet (PENDING_TOKEN in token_ids): its id is taken on the device.
        before_sampling: called once the forward pass is launched, before the sampling inputs are
        made from the sequences (the engine reads the previous step's tokens there)."""
        if self.draft is not None and any(seq.spec_token_ids for seq in out.seqs):   # (placeholders until now)
            self.draft.propose([seq for seq in out.seqs if seq.spec_token_ids], self._device_inputs)
        step = build_step(out, sampling_seqs, pending, self.block_size)
        spans = prompt_spans(out, step.batch)
        step.prompt_rows = [row for _, _, rows in spans for row in rows]
        if (embeds := embed_rows(out, step.batch)) is not None:
            rows, parts = embeds
            step.embeds = (rows, torch.cat([part.to(self.config.torch_dtype) for part in parts]))
        if self.lora is not None:
            slots, step.lora_loads = self.lora_slot_table.assign([seq.lora_request for seq in out.seqs])
            step.lora_slots = np.repeat(slots, out.num_scheduled_tokens)
        if self.workers is not None:   # block tables travel as changes
            self.workers.send(("step", replace(step, batch=replace(step.batch, block_tables=None),
                                               table_updates=self.table_sender.updates(out.seqs))))
        try:
            if self.pooler is not None:   # an embedding model: each completed prompt's result, no tokens
                hidden, _ = self.run_step(step)
                return self.pooler(hidden, out.seqs, out.num_scheduled_tokens, step.batch.query_start_loc), None
            logits, prompt_logits = self.run_step(step)
            prompt_scores = None
            if spans:   # on their way to the host while the GPU goes on
                scores = score_prompts(spans, prompt_logits, self.device, self.config.logprobs_mode.endswith("logits"))
                prompt_scores = PromptScores(spans, *self.copy_to_host(scores))
            if logits is None:
                return None, prompt_scores
            if before_sampling is not None:
                before_sampling()
            sampled = self.sampler(logits, self.prepare_sampling(sampling_seqs))
            self.last_sampled = self.tp.broadcast_from_first(sampled.token_ids)
            return sampled, prompt_scores
        except RuntimeError:
            if self.workers is not None:
                self.workers.check_alive(grace_s=5.0)   # a dead worker breaks the collectives: name it
            raise

    @torch.inference_mode()
    def run_worker_step(self, step: StepInputs):
        """Ranks > 0: the same step as rank 0, then receive its sampled tokens."""
        step.batch.block_tables = self.table_receiver.apply(step.table_updates)
        _, prompt_logits = self.run_step(step)
        for _ in prompt_logits:   # (the LM head gathers over the ranks: each computes every part)
            pass
        if step.num_sampling and not self.pooling:
            tokens = torch.empty(step.num_sampling, dtype=torch.int64, device=self.device)
            self.last_sampled = self.tp.broadcast_from_first(tokens)

    def run_step(self, step: StepInputs) -> tuple[torch.Tensor | None, Iterator[torch.Tensor]]:
        """Every rank: the forward pass, then (on rank 0) the logits of the sampling rows, None
        if no row samples, and those of the prompt rows as parts of prompt_logits_rows rows, each
        computed when the iterator reaches it (one part's logits alive at a time). A pooling engine
        returns the hidden states of every row instead of logits, and no prompt logits."""
        batch = step.batch
        num_tokens, num_seqs = len(batch.input_ids), len(batch.seq_lens)
        if self.lora is not None:
            for slot, request in step.lora_loads:
                self.lora.load(slot, self.adapters.get(request))
            self.lora.slots.set_tokens(step.lora_slots)
        if (num_seqs < num_tokens <= self.max_decode_rows
                and max(np.diff(batch.query_start_loc)) <= self.decode_query_len):
            batch = token_rows(batch)   # a speculative step, as a decode step
            num_seqs = num_tokens
        pending = (step.pending_rows, step.pending_sources) if step.pending_rows else None
        shared = self.plan_shared_prefixes(batch)
        from_graph = (self.graphs is not None and num_tokens == num_seqs
                      and num_seqs <= self.graphs.max_batch_size and step.embeds is None)
        if from_graph:
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens,
                                     batch.block_tables, pending, self.last_sampled, shared)
        elif step.embeds is not None:   # (eager: the graphs take token ids only)
            rows, vectors = step.embeds
            embeds = (torch.from_numpy(rows).to(self.device), vectors.to(self.device))
            hidden = self.model(*self._device_inputs(batch, pending, shared), embeds=embeds)
        elif self.pieces is not None and len(batch.input_ids) <= self.pieces.max_tokens:
            hidden = self.pieces.run(*self._device_inputs(batch, pending, shared))
        else:
            hidden = self.model(*self._device_inputs(batch, pending, shared))
        if self.pooling:
            return hidden, iter(())

        def logits_of(rows: list[int] | None) -> torch.Tensor | None:
            """The logits of hidden's rows (None: every row), computed for their number padded to
            a logits bucket and cut back."""
            n = len(hidden) if rows is None else len(rows)
            padded = self.logits_bucket(n)
            if rows is None and from_graph:
                h, index = self.graphs.hidden[:padded], slice(0, padded)   # the graph bucket's padding rows follow
            elif rows is None and padded == n:
                h, index = hidden, slice(0, n)
            else:
                index = np.arange(n) if rows is None else np.asarray(rows, np.int64)
                index = upload([np.pad(index, (0, padded - n), mode="edge")], self.device)[0]
                h = hidden[index]
            if self.lora is not None:   # (the LM head's adapters: those of these rows' tokens)
                self.lora.slots.select_rows(index)
            logits = self.model.compute_logits(h)
            return None if logits is None else logits[:n]

        logits = logits_of(step.logits_rows) if step.num_sampling else None
        rows, size = step.prompt_rows, self.prompt_logits_rows
        return logits, (logits_of(rows[i:i + size]) for i in range(0, len(rows), size))

    # ---- sleep mode (engine/sleep.py) ---------------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        """Free the memory of the KV cache and of the weights; level 1 keeps a host copy of the
        weights, level 2 forgets them (reload_weights() once they are awake) -> the bytes freed."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # no kernel may still be reading what is freed
        if self.hibernations is None:
            memories = ({tag: ArenaMemory(arena) for tag, arena in self.arenas.items()} if self.arenas is not None
                        else {"weights": Storages(self.model.parameters()), "kv_cache": Storages([self.kv_cache])})
            self.hibernations = {tag: Hibernation(memory) for tag, memory in memories.items()}
        freed = 0
        for tag, memory in self.hibernations.items():
            if not memory.asleep:
                memory.sleep(keep=tag == "weights" and level == 1)
                freed += memory.nbytes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def wake_up(self, tags: list[str] | None = None):
        """Allocate the tagged memory again ("weights", "kv_cache"; None: both), at the addresses
        the CUDA graphs read. The KV cache comes back zeroed."""
        for tag in tags or SLEEP_TAGS:
            memory = self.hibernations[tag] if self.hibernations else None
            if memory is not None and memory.asleep:
                memory.wake_up()
                if tag == "kv_cache":
                    self.kv_cache.zero_()

    @property
    def sleeping_tags(self) -> list[str]:
        return [tag for tag, memory in (self.hibernations or {}).items() if memory.asleep]

    def reload_weights(self):
        """Load the weights again from the model's files (load_format="dummy": draw them again), as
        vLLM's collective_rpc("reload_weights") does after a level-2 sleep."""
        if "weights" in self.sleeping_tags:
            raise RuntimeError("the weights are asleep: wake_up(tags=['weights']) before reload_weights().")
        with torch.no_grad():
            self._load_weights()

    def start_profile(self, prefix: str | None = None):
        self.profiler.start(prefix)

    def stop_profile(self):
        self.profiler.stop()

    def apply_model(self, func):
        """func(this rank's model): vLLM's worker method behind LLM.apply_model."""
        return func(self.model)

    def copy_to_host(self, sampled: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
        """Start copying the sampler's outputs to the host; the event marks when they are there."""
        if self.device.type == "cpu":
            return sampled, None
        parts = {f.name: getattr(sampled, f.name) for f in fields(sampled)}
        host = {name: None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for name, t in parts.items()}
        event = torch.cuda.Event()
        event.record()
        return SamplerOutput(**host), event
