"""ModelRunner: owns the model, its KV cache and the sampler; turns a SchedulerOutput into tokens."""
import numpy as np
import torch

from nanovllm.config import Config
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import Attention, AttentionMetadata
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from nanovllm.model.loader import init_dummy_weights, load_model
from nanovllm.model.qwen3 import QwenForCausalLM

CPU_KV_CACHE_BYTES = 4 << 30   # vLLM's default CPU KV-cache space


class ModelRunner:
    def __init__(self, config: Config, eos_token_ids: set[int]):
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.eos_token_ids = sorted(eos_token_ids)
        hf = config.hf_config
        self.vocab_size = hf.vocab_size
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with torch.device(self.device):
                self.model = QwenForCausalLM(hf)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_model(self.model, config.model_path, hf.tie_word_embeddings)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.num_kvcache_blocks = self._allocate_kv_cache()

    # ---- KV cache -------------------------------------------------------------------------
    def _kv_block_bytes(self) -> int:
        attn = self._attention_layers()[0]
        per_layer = 2 * self.block_size * attn.num_kv_heads * attn.head_dim
        return per_layer * len(self._attention_layers()) * self.config.torch_dtype.itemsize

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def _allocate_kv_cache(self) -> int:
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                used = total - free
                budget = int(total * self.config.gpu_memory_utilization) - used
            else:
                budget = CPU_KV_CACHE_BYTES
            num_blocks = budget // self._kv_block_bytes()
            if num_blocks < 1:
                raise ValueError("no memory is left for the KV cache; "
                                 "raise gpu_memory_utilization or use a smaller model.")
        layers = self._attention_layers()
        attn = layers[0]
        # kv_cache: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.empty(2, len(layers), num_blocks, self.block_size, attn.num_kv_heads,
                                    attn.head_dim, dtype=self.config.torch_dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    # ---- one step -----------------------------------------------------------------------
    def _to_device(self, data, dtype) -> torch.Tensor:
        return torch.as_tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare_inputs(self, out: SchedulerOutput):
        """Flatten the scheduled tokens of all sequences into one batch."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        query_start_loc, seq_lens = [0], []
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            pos = np.arange(start, end)
            input_ids.extend(seq.token_ids[start:end])
            positions.append(pos)
            slots.append(np.asarray(seq.block_table)[pos // bs] * bs + pos % bs)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
        max_blocks = max(len(seq.block_table) for seq in out.seqs)
        block_tables = np.zeros((len(out.seqs), max_blocks), dtype=np.int32)
        for i, seq in enumerate(out.seqs):
            block_tables[i, :len(seq.block_table)] = seq.block_table
        meta = AttentionMetadata(
            slot_mapping=self._to_device(np.concatenate(slots), torch.int64),
            block_tables=self._to_device(block_tables, torch.int32),
            query_start_loc=self._to_device(query_start_loc, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=max(out.num_scheduled_tokens),
            max_seq_len=max(seq_lens),
        )
        return (self._to_device(input_ids, torch.int64),
                self._to_device(np.concatenate(positions), torch.int64), meta)

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingMetadata:
        params = [seq.sampling_params for seq in seqs]
        vocab = self.vocab_size
        md = SamplingMetadata(
            temperatures=self._to_device([1.0 if p.is_greedy else p.temperature for p in params],
                                         torch.float32),
            is_greedy=self._to_device([p.is_greedy for p in params], torch.bool),
            all_greedy=all(p.is_greedy for p in params),
            top_k=None, top_p=None, min_p=None, row_seeds=[], banned_rows=None, banned_tokens=None,
        )
        if any(p.top_k > 0 for p in params):
            md.top_k = self._to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                                       torch.int64)
        if any(p.top_p < 1.0 for p in params):
            md.top_p = self._to_device([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params):
            md.min_p = self._to_device([p.min_p for p in params], torch.float32)
        # Seeded rows: the noise of output token t depends only on (seed, t).
        md.row_seeds = [(i, (p.seed * 1_000_003 + seq.num_output_tokens) % (1 << 63))
                        for i, (seq, p) in enumerate(zip(seqs, params)) if p.seed is not None]
        banned = [(i, t) for i, (seq, p) in enumerate(zip(seqs, params))
                  if seq.num_output_tokens < p.min_tokens
                  for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))]
        if banned:
            rows, tokens = zip(*banned)
            md.banned_rows = self._to_device(rows, torch.int64)
            md.banned_tokens = self._to_device(tokens, torch.int64)
        if any(p.has_penalties for p in params):
            counts = torch.zeros(len(seqs), vocab, dtype=torch.int32)
            prompt_mask = torch.zeros(len(seqs), vocab, dtype=torch.bool)
            for i, seq in enumerate(seqs):
                out_ids = torch.tensor(seq.output_token_ids, dtype=torch.int64)
                counts[i].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.int32))
                prompt_mask[i, seq.token_ids[:seq.num_prompt_tokens]] = True
            md.output_token_counts = counts.to(self.device)
            md.prompt_token_mask = prompt_mask.to(self.device)
            md.presence_penalties = self._to_device([p.presence_penalty for p in params], torch.float32)
            md.frequency_penalties = self._to_device([p.frequency_penalty for p in params], torch.float32)
            md.repetition_penalties = self._to_device([p.repetition_penalty for p in params], torch.float32)
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(num_logprobs) if num_logprobs else None
        return md

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sampling_seqs: list[Sequence]) -> SamplerOutput | None:
        """Run the model on the scheduled tokens; sample one token for each of `sampling_seqs`
        (the sequences whose scheduled tokens reach their end). None if none sample."""
        input_ids, positions, meta = self.prepare_inputs(out)
        hidden = self.model(input_ids, positions, meta)
        if not sampling_seqs:
            return None
        sampling = set(id(s) for s in sampling_seqs)
        last_rows = [meta.query_start_loc_cpu[i + 1] - 1
                     for i, seq in enumerate(out.seqs) if id(seq) in sampling]
        logits = self.model.compute_logits(hidden[self._to_device(last_rows, torch.int64)])
        return self.sampler(logits, self.prepare_sampling(sampling_seqs))
