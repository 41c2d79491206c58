"""Config: every engine setting in one place, validated up front (vLLM's names and defaults)."""
import difflib
import os
import random
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.engine.profiler import ProfilerConfig
from nanovllm.engine.reasoning import ReasoningConfig, reasoning_markers
from nanovllm.engine.speculative import SpeculativeConfig
from nanovllm.engine.structured_output import StructuredOutputsConfig
from nanovllm.layers.classifier import REWARD_ARCHITECTURES, ClassifierConfig
from nanovllm.layers.rotary import max_positions, rope_settings
from nanovllm.logger import init_logger
from nanovllm.model.fp8 import FP8Checkpoint, fp8_checkpoint
from nanovllm.pooling_params import CLASSIFY_TASKS, EMBED_TASKS, PoolerConfig, is_sentence_transformers_model
from nanovllm.utils.hub import check_directory_or_hub_id, resolve_model_path
from nanovllm.utils.validation import check_field_types, check_known_keys
from nanovllm.vllm_only_arguments import IDLE_ARGUMENTS, IGNORED_ARGUMENTS

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")   # vLLM's

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
                           "LlamaForCausalLM", "MistralForCausalLM")
# The same models without their LM head (Qwen3Model, ...): embedding models only (runner="pooling").
BASE_ARCHITECTURES = tuple(name.removesuffix("ForCausalLM") + "Model" for name in SUPPORTED_ARCHITECTURES)
# ...and with a classifier head instead (Qwen3ForSequenceClassification, ...): classifiers (convert="classify").
SEQ_CLS_ARCHITECTURES = tuple(name.replace("ForCausalLM", "ForSequenceClassification")
                              for name in SUPPORTED_ARCHITECTURES)
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vLLM's
ATTENTION_BACKENDS = ("auto", "triton", "flash_attn", "torch")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "half": torch.float16, "float": torch.float32}
# The generation-config fields that default sampling parameters come from (vLLM's), with their
# SamplingParams names.
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# What block_size=None (vLLM's "the engine's default") means here.
DEFAULT_BLOCK_SIZE = 256
# Fields where None (vLLM's default for them) means the field's own default here.
NONE_MEANS_DEFAULT = ("enable_chunked_prefill", "enable_prefix_caching", "attention_backend")
# vLLM's kv_cache_dtype values ("auto": the model's dtype). fp8 values are stored unscaled
# (vLLM's k_scale = v_scale = 1.0 for checkpoints without scales), clamped to the format's range.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

logger = init_logger(__name__)


def batch_defaults(device: str) -> tuple[int, int]:
    """vLLM's (max_num_batched_tokens, max_num_seqs) for an offline LLM on device ('cuda' or 'cpu'):
    (16384, 1024) on a GPU of at least 70 GiB that is not an A100 (H100, H200, ...), else (8192, 256)."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
            return 16384, 1024
    return 8192, 256


@dataclass
class Config:
    model: str
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"            # "auto": the fast tokenizer; "slow": ask for the Python one
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    revision: str | None = None             # of a hub model: branch, tag or commit
    tokenizer_revision: str | None = None   # of a hub tokenizer given by `tokenizer`
    download_dir: str | None = None         # hub cache directory (default: Hugging Face's)
    hf_token: str | bool | None = None      # for gated or private hub models (True: the saved login)
    hf_overrides: dict | None = None        # attributes set on the model's HF config after loading it
                                            # (a dict attribute is updated with a dict)
    chat_template: str | None = None        # LLM.chat's template when a call gives none: a Jinja template
                                            # or a file holding one (the tokenizer's when None)
    # Where LLM.get_default_sampling_params() (generate without sampling params) takes its
    # defaults from: "auto" the model's generation_config.json, "vllm" none (SamplingParams'
    # own), or a folder holding a generation_config.json. override_generation_config sets some of
    # GENERATION_FIELDS on top (with "vllm": alone).
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # LLM.start_profile() / stop_profile(): vLLM's ProfilerConfig, or a dict of its fields
    # (engine/profiler.py); None: profiling off
    profiler_config: object = None
    # A reasoning model's thinking markers, for SamplingParams.thinking_token_budget
    # (engine/reasoning.py): a parser's name ("qwen3", ...), or vLLM's ReasoningConfig (or a dict of
    # its fields: reasoning_start_str, reasoning_end_str, reasoning_parser).
    reasoning_parser: str = ""
    reasoning_config: object = None
    # SamplingParams.structured_outputs' engine settings (engine/structured_output.py): vLLM's
    # StructuredOutputsConfig, or a dict of its fields
    structured_outputs_config: object = None
    dtype: str | torch.dtype = "auto"       # "auto", a name in DTYPES, or one of their torch dtypes
    quantization: str | None = None         # None, or "fp8": an fp8 checkpoint's (read from it when None), or on an
                                            # unquantized one the projections in fp8, with fp8 products (layers/linear.py)
    device: str = "auto"
    seed: int | None = 0                    # None: a random seed (vLLM's meaning)
    max_model_len: int | None = None        # None: the model's; -1: the model's, cut to what the KV cache holds
    # True: a sliding-window model attends to its whole context, max_model_len capped at the window
    # (vLLM's meaning). nanovllm has no sliding-window attention, so without it a longer max_model_len
    # is refused.
    disable_sliding_window: bool = False
    served_model_name: str | list[str] | None = None   # the metrics' model_name (None: the model argument)
    # None: vLLM's defaults for an offline LLM (batch_defaults): 1,024 sequences and 16,384 tokens a step
    # on a GPU of at least 70 GiB that is not an A100, else 256 and 8,192
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = True   # False: a prompt is computed in one step or waits (None: True)
    scheduling_policy: str = "fcfs"         # "fcfs" | "priority": generate(..., priority=[...]), lower first
    block_size: int | None = None               # None: 256 tokens a KV-cache block
    enable_prefix_caching: bool | None = True   # None: True
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None   # the KV cache per GPU, instead of sizing it from the above
    num_kvcache_blocks: int | None = None
    num_gpu_blocks_override: int | None = None   # vLLM's name for num_kvcache_blocks
    # Accepted so that vLLM scripts run: preemption recomputes (as vLLM's V1 engine does), so no
    # CPU swap space is used; nothing is offloaded to the CPU.
    swap_space: float = 4
    cpu_offload_gb: float = 0
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1                  # only 1
    distributed_executor_backend: str | None = None  # None or "mp": tensor-parallel worker processes
    # LoRA adapters (lora/): requests name theirs with lora_request=LoRARequest(...); up to max_loras adapters
    # of rank <= max_lora_rank run in one step, max_cpu_loras (default max_loras) stay read on the host.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"                # "auto" (the model's dtype), "float16" or "bfloat16"
    # The modules that take adapters (lora/adapter.py's LORA_MODULES, by vLLM's names); None: all
    lora_target_modules: list[str] | None = None
    # Prompts given as the model's input vectors ({"prompt_embeds": tensor}, inputs.py), as vLLM's flag
    enable_prompt_embeds: bool = False
    # Speculative decoding by n-gram prompt lookup (engine/speculative.py): vLLM's SpeculativeConfig for
    # method "ngram", or a dict of its fields; spec_method / spec_model / spec_tokens are vLLM's flags for
    # its method, model and num_speculative_tokens.
    speculative_config: object = None
    # Custom logits processors (nanovllm/logits_processor.py, vLLM's): LogitsProcessor classes, or their names
    # ("package.module.Class" or "package.module:Class"), one of each made by the engine
    logits_processors: list[str | type] | None = None
    spec_method: str | None = None
    spec_model: str | None = None
    spec_tokens: int | None = None
    # "generate": a generative model (LLM.generate); "pooling": an embedding model or a classifier
    # (LLM.embed, classify, encode, score; pooling_params.py). "auto" (vLLM's): pooling for a
    # sentence-transformers model (one with a modules.json), a base model without LM head (Qwen3Model,
    # ...), a classifier (Qwen3ForSequenceClassification, ...) or a convert; else generate.
    runner: str = "auto"
    # "auto" | "none" | "embed" | "classify": run a *ForCausalLM checkpoint as an embedding model or a
    # classifier ("auto": "classify" for a *ForSequenceClassification checkpoint, else "embed" when pooling)
    convert: str = "auto"
    pooler_config: object = None  # a pooling engine's PoolerConfig (pooling_params.py), or a dict of its fields
    model_impl: str = "auto"                         # "auto" or "vllm": the engine's own model code
    enable_expert_parallel: bool = False             # MoE experts are split like the dense MLP
    enable_sleep_mode: bool = False
    # What logprobs report (vLLM's): the model's raw distribution ("raw_logprobs") or its logits ("raw_logits");
    # or the distribution tokens are drawn from, after logit edits, temperature, min-p, top-k and top-p
    # ("processed_logprobs"), or its logits ("processed_logits"). Prompt tokens are scored unprocessed in every
    # mode (as logits in the two "_logits" modes).
    logprobs_mode: str = "raw_logprobs"
    # False (vLLM's default): on CUDA, the symmetric-memory all-reduce (custom_all_reduce.py) for
    # tensors up to 16 MB, NCCL for the rest; True: NCCL for every all-reduce.
    disable_custom_all_reduce: bool = False
    load_format: str = "auto"
    max_logprobs: int = 20
    attention_backend: str | None = "auto"   # "auto" (or None) | "triton" | "flash_attn" | "torch"
    kv_cache_dtype: str = "auto"        # "auto" (the model's dtype) | "bfloat16" | "fp8" | "fp8_e4m3" | "fp8_e5m2"
    async_scheduling: bool | None = None   # None: on with CUDA (overlaps host work with the GPU)
    disable_log_stats: bool = True         # False: log throughput, queues and cache use every 10 s
    # Derived in __post_init__.
    model_path: str = field(init=False)
    hf_config: PretrainedConfig = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    kv_cache_torch_dtype: torch.dtype = field(init=False)
    reasoning_markers: tuple[str, str] | None = field(init=False)   # (start, end); None: no budget
    fit_max_model_len: bool = field(init=False)   # max_model_len=-1: cut to the KV cache once it is sized
    fp8_checkpoint: FP8Checkpoint | None = field(init=False)   # fp8 weights, dequantized as they load
    fp8_products: bool = field(init=False)   # quantization="fp8" on an unquantized checkpoint (layers/linear.py)
    runner_type: str = field(init=False)    # "generate" or "pooling": what runner resolved to
    convert_type: str = field(init=False)   # "none", "embed" or "classify": what convert resolved to
    reward_model: bool = field(init=False, default=False)   # a reward model's checkpoint (classifier.py)
    classifier: ClassifierConfig | None = field(init=False)   # a classifier's head (convert_type "classify")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "Config":
        """Config from LLM()'s keyword arguments: vLLM's names, with those nanovllm has no use for
        (vllm_only_arguments.py) taken out first."""
        for name, (idle, lack) in IDLE_ARGUMENTS.items():
            if name in kwargs and not _asks_nothing(kwargs.pop(name), idle):
                raise ValueError(f"{name} is not supported ({lack}); leave it at {idle!r}.")
        for name in sorted(IGNORED_ARGUMENTS.keys() & kwargs.keys()):
            logger.info(f"{name}={kwargs.pop(name)!r:.80} is not used: {IGNORED_ARGUMENTS[name][1]}.")
        names = {f.name for f in fields(cls) if f.init}
        if kwargs.get("task") in ("embed", "embedding", "encode"):   # (older vLLM's way to ask for embeddings)
            raise ValueError(f"LLM() got an unexpected keyword argument 'task' ({kwargs['task']!r}): vLLM 0.26 makes "
                             f"an embedding model with runner='pooling'; pass that instead.")
        for name in sorted(set(kwargs) - names):
            known = names | IDLE_ARGUMENTS.keys() | IGNORED_ARGUMENTS.keys()
            guess = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            raise ValueError(f"LLM() got an unexpected keyword argument {name!r}{hint}: it is not one of "
                             f"vLLM's engine arguments.")
        return cls(model=model, **kwargs)

    def __post_init__(self):
        for name in ("model", "tokenizer", "download_dir", "chat_template"):   # a pathlib.Path is a path too
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        check_field_types(self)
        if self.num_gpu_blocks_override is not None:
            if self.num_kvcache_blocks not in (None, self.num_gpu_blocks_override):
                raise ValueError(f"num_gpu_blocks_override ({self.num_gpu_blocks_override}) and num_kvcache_blocks "
                                 f"({self.num_kvcache_blocks}) name the same setting; give one.")
            self.num_kvcache_blocks = self.num_gpu_blocks_override
        if self.seed is None:
            self.seed = random.randrange(2**31)
        if self.block_size is None:
            self.block_size = DEFAULT_BLOCK_SIZE
        for f in fields(self):   # vLLM's None for these: the engine's choice, i.e. the field's default
            if f.name in NONE_MEANS_DEFAULT and getattr(self, f.name) is None:
                setattr(self, f.name, f.default)
        self._validate_scalars()
        self.profiler_config = ProfilerConfig.parse(self.profiler_config)
        self.reasoning_config = ReasoningConfig.parse(self.reasoning_config)
        self.reasoning_markers = reasoning_markers(self.reasoning_parser, self.reasoning_config)
        self.structured_outputs_config = StructuredOutputsConfig.parse(self.structured_outputs_config)
        structured = self.structured_outputs_config   # as vLLM's EngineArgs: LLM's reasoning parser is its too
        structured.reasoning_parser = (structured.reasoning_parser or self.reasoning_parser
                                       or getattr(self.reasoning_config, "reasoning_parser", ""))
        reasoning_markers(structured.reasoning_parser, None)   # an unknown name refused here
        if self.chat_template is not None:
            self.chat_template = load_chat_template(self.chat_template)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is 'cuda', but no CUDA device is available.")
        self.speculative_config = SpeculativeConfig.from_engine_args(self.speculative_config, self.spec_method,
                                                                     self.spec_model, self.spec_tokens)
        if self.async_scheduling is None:   # (with n-gram speculation too: engine/speculative.py)
            self.async_scheduling = self.device == "cuda"
        self.model_path = resolve_model_path(self.model, need_weights=self.load_format != "dummy",
                                             revision=self.revision, cache_dir=self.download_dir,
                                             token=self.hf_token)
        self.hf_config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        for name, value in (self.hf_overrides or {}).items():
            if name == "rope_scaling" and isinstance(getattr(self.hf_config, "rope_parameters", None), dict):
                name = "rope_parameters"    # transformers 5's name for it (the old one is deprecated)
            current = getattr(self.hf_config, name, None)
            if isinstance(current, dict) and isinstance(value, dict):   # a dict attribute is updated, not replaced
                value = {**current, **value}
            setattr(self.hf_config, name, value)
        self.fp8_checkpoint = fp8_checkpoint(getattr(self.hf_config, "quantization_config", None))
        if self.fp8_checkpoint:
            if self.quantization not in (None, "fp8"):
                raise ValueError(f"quantization={self.quantization!r} does not match the checkpoint's "
                                 f"quant_method 'fp8'.")
            self.quantization = "fp8"   # (as vLLM's model_config reads it)
        self.fp8_products = self.quantization == "fp8" and not self.fp8_checkpoint   # (vLLM's online quantization)
        self.runner_type = self._resolve_runner()
        if self.runner_type == "pooling" and self.speculative_config is not None:
            raise ValueError(f"speculative_config is for generative models; a pooling model (runner='pooling') "
                             f"computes prompts only, got {self.speculative_config!r:.120}.")
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            self._resolve_draft_model()
        if self.logits_processors:
            self._resolve_logits_processors()
        if self.runner_type == "pooling" and self.enable_lora and set(self.lora_target_modules or ()) == {"lm_head"}:
            raise ValueError(f"lora_target_modules {self.lora_target_modules}: a pooling model (runner='pooling') has "
                             f"no LM head to adapt.")
        self._validate_tensor_parallel()
        self.torch_dtype = self._resolve_dtype()
        if self.enable_lora and self.lora_dtype not in ("auto", str(self.torch_dtype).removeprefix("torch.")):
            raise ValueError(f"lora_dtype {self.lora_dtype!r} must be 'auto' or the model's dtype "
                             f"({self.torch_dtype}): the adapters' products run in the model's dtype.")
        self.kv_cache_torch_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype
        rope_settings(self.hf_config)   # an unsupported RoPE variant refused here, before any worker starts
        max_len = max_positions(self.hf_config)
        self.fit_max_model_len = self.max_model_len == -1
        explicit_len = self.max_model_len not in (None, -1)
        if not explicit_len:
            self.max_model_len = max_len
        elif self.max_model_len > max_len:
            scaled = ", with its RoPE scaling" if max_len != self.hf_config.max_position_embeddings else ""
            raise ValueError(f"max_model_len ({self.max_model_len}) is greater than the model's "
                             f"max_position_embeddings ({max_len}{scaled}).")
        window = sliding_window(self.hf_config)
        if window and self.disable_sliding_window and not explicit_len:
            self.max_model_len = min(self.max_model_len, window)
        if window and self.max_model_len > window:
            raise ValueError(f"the model attends within a sliding window of {window} tokens, which nanovllm does "
                             f"not implement; up to the window it equals full attention: set max_model_len "
                             f"<= {window} (got {self.max_model_len}).")
        if self.tokenizer is None:
            self.tokenizer = self.model_path
        elif not self.skip_tokenizer_init:
            check_directory_or_hub_id(self.tokenizer, "tokenizer")
        self.classifier = None
        if self.convert_type == "classify":
            self.classifier = ClassifierConfig.resolve(self.hf_config, self.torch_dtype, self.tokenizer)
        if self.runner_type == "pooling" and self.pooler_config.needs_whole_prompts:   # (as vLLM)
            for name in ("enable_chunked_prefill", "enable_prefix_caching"):
                if getattr(self, name):
                    logger.info(f"{name} turned off: {self.pooler_config.seq_pooling_type} pooling needs the "
                                f"whole prompt computed in one step.")
                    setattr(self, name, False)
        self._resolve_batch_limits()
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            why = "with enable_chunked_prefill=False a prompt must fit one step"
            if self.runner_type == "pooling" and self.pooler_config.needs_whole_prompts:
                why = f"{self.pooler_config.seq_pooling_type} pooling computes each prompt in one step"
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                             f"max_model_len ({self.max_model_len}): {why}. Raise max_num_batched_tokens or "
                             f"lower max_model_len.")

    def _resolve_batch_limits(self):
        """max_num_seqs and max_num_batched_tokens left at None, as vLLM's EngineArgs resolves them: the
        device's defaults, a step's tokens at least max_model_len without chunked prefill and at most
        what max_num_seqs full-length sequences hold, and no more sequences than tokens."""
        default_tokens, default_seqs = batch_defaults(self.device)
        seqs_unset = self.max_num_seqs is None
        if seqs_unset:
            self.max_num_seqs = default_seqs
        if self.max_num_batched_tokens is None:
            tokens = default_tokens if self.enable_chunked_prefill else max(default_tokens, self.max_model_len)
            self.max_num_batched_tokens = min(tokens, self.max_num_seqs * self.max_model_len)
        if seqs_unset:
            self.max_num_seqs = min(self.max_num_seqs, self.max_num_batched_tokens)

    def _validate_scalars(self):
        def check(ok: bool, message: str):
            if not ok:
                raise ValueError(message)

        check(self.device in ("auto", "cuda", "cpu"),
              f"device must be 'auto', 'cuda' or 'cpu', got {self.device!r}.")
        check(self.dtype == "auto" or self.dtype in DTYPES or self.dtype in DTYPES.values(),
              f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}.")
        check(self.generation_config in ("auto", "vllm") or os.path.isdir(self.generation_config),
              f"generation_config must be 'auto', 'vllm' or a folder with a generation_config.json, "
              f"got {self.generation_config!r}.")
        check_known_keys("override_generation_config", self.override_generation_config or {}, GENERATION_FIELDS)
        check(self.load_format in ("auto", "safetensors", "dummy"),
              f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}.")
        check(self.max_model_len is None or self.max_model_len >= 1 or self.max_model_len == -1,
              f"max_model_len must be at least 1, or -1 (what the KV cache holds), got {self.max_model_len}.")
        check(self.max_num_seqs is None or self.max_num_seqs >= 1,
              f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
              f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        check(self.block_size >= 1 and self.block_size % 16 == 0,
              f"block_size must be a positive multiple of 16, got {self.block_size}.")
        check(0.0 < self.gpu_memory_utilization <= 1.0,
              f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        check(self.num_kvcache_blocks is None or self.num_kvcache_blocks >= 1,
              f"num_kvcache_blocks must be at least 1, got {self.num_kvcache_blocks}.")
        check(self.tensor_parallel_size >= 1,
              f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}.")
        check(self.attention_backend in ATTENTION_BACKENDS,
              f"attention_backend must be 'auto', 'triton', 'flash_attn' or 'torch', "
              f"got {self.attention_backend!r}.")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"kv_cache_dtype must be one of {', '.join(repr(k) for k in KV_CACHE_DTYPES)}, "
              f"got {self.kv_cache_dtype!r}.")
        check(self.max_logprobs >= -1, f"max_logprobs must be non-negative or -1 (no cap), got {self.max_logprobs}.")
        check(self.scheduling_policy in ("fcfs", "priority"),
              f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        check(self.tokenizer_mode in ("auto", "slow"),
              f"tokenizer_mode must be 'auto' or 'slow', got {self.tokenizer_mode!r}.")
        check(self.quantization in (None, "fp8"),
              f"quantization={self.quantization!r} is not supported: nanovllm loads unquantized checkpoints "
              f"and fp8 ones (an fp8 KV cache is kv_cache_dtype='fp8').")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes >= 1,
              f"kv_cache_memory_bytes must be at least 1, got {self.kv_cache_memory_bytes}.")
        check(self.swap_space >= 0, f"swap_space must be non-negative, got {self.swap_space}.")
        check(self.cpu_offload_gb == 0, f"cpu_offload_gb must be 0 (no CPU offloading), got {self.cpu_offload_gb}.")
        check(self.pipeline_parallel_size == 1,
              f"pipeline_parallel_size must be 1 (nanovllm has tensor parallelism only), "
              f"got {self.pipeline_parallel_size}.")
        check(self.distributed_executor_backend in (None, "mp"),
              f"distributed_executor_backend must be None or 'mp' (worker processes), "
              f"got {self.distributed_executor_backend!r}.")
        check(isinstance(self.max_loras, int) and self.max_loras >= 1,
              f"max_loras must be a positive integer, got {self.max_loras!r}.")
        check(self.max_lora_rank in MAX_LORA_RANKS,
              f"max_lora_rank must be one of {MAX_LORA_RANKS}, got {self.max_lora_rank!r}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        check(self.max_cpu_loras >= self.max_loras,
              f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        check(self.lora_dtype in ("auto", "float16", "bfloat16"),
              f"lora_dtype must be 'auto', 'float16' or 'bfloat16', got {self.lora_dtype!r}.")
        if self.lora_target_modules is not None:
            from nanovllm.lora.adapter import LORA_MODULES
            modules = self.lora_target_modules
            check(isinstance(modules, (list, tuple)) and modules and all(m in LORA_MODULES for m in modules),
                  f"lora_target_modules must be a non-empty list of {', '.join(LORA_MODULES)}, got {modules!r:.120}.")
            self.lora_target_modules = list(modules)
        check(self.runner in ("auto", "generate", "pooling"),
              f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}.")
        check(self.convert in ("auto", "none", "embed", "classify"),
              f"convert must be 'auto', 'none', 'embed' or 'classify', got {self.convert!r}.")
        check(self.model_impl in ("auto", "vllm"),
              f"model_impl must be 'auto' or 'vllm' (nanovllm runs its own model code), got {self.model_impl!r}.")
        check(not self.enable_expert_parallel, "enable_expert_parallel=True is not supported: MoE experts are "
                                               "split across tensor-parallel ranks like the dense MLP.")
        check(self.logprobs_mode in LOGPROBS_MODES,
              f"logprobs_mode must be one of {', '.join(map(repr, LOGPROBS_MODES))}, got {self.logprobs_mode!r}.")

    def _resolve_logits_processors(self):
        """logits_processors as classes; ValueError for an entry that is none, or where vLLM refuses them too."""
        from nanovllm.logits_processor import resolve_processor
        if not isinstance(self.logits_processors, (list, tuple)):
            raise ValueError(f"logits_processors must be a list of LogitsProcessor classes or their names, "
                             f"got {self.logits_processors!r:.80}.")
        if self.runner_type == "pooling":
            raise ValueError("logits_processors: pooling models (runner='pooling') do not support custom logits "
                             "processors.")
        if self.speculative_config is not None:
            raise ValueError("logits_processors: custom logits processors are not supported when speculative "
                             "decoding is enabled (speculative_config).")
        self.logits_processors = [resolve_processor(entry, f"logits_processors[{i}]")
                                  for i, entry in enumerate(self.logits_processors)]

    def _resolve_draft_model(self):
        """speculative_config's draft model (engine/draft_model.py; with tensor parallelism on the first rank's
        GPU): its files and config (draft_path, draft_hf_config); ValueError for one the engine cannot run beside
        the model."""
        spec = self.speculative_config
        spec.draft_path = resolve_model_path(spec.model, need_weights=self.load_format != "dummy",
                                             cache_dir=self.download_dir, token=self.hf_token)
        draft = spec.draft_hf_config = AutoConfig.from_pretrained(spec.draft_path,
                                                                  trust_remote_code=self.trust_remote_code)
        architectures = getattr(draft, "architectures", None) or []
        if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
            raise ValueError(f"speculative_config model {spec.model!r}: architectures {architectures} are not "
                             f"supported for a draft model; supported: {', '.join(SUPPORTED_ARCHITECTURES)}.")
        if draft.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"speculative_config model {spec.model!r} has vocab_size {draft.vocab_size}, the model "
                             f"{self.hf_config.vocab_size}: a draft model must share the model's vocabulary.")
        rope_settings(draft)
        spec.draft_fp8_checkpoint = fp8_checkpoint(getattr(draft, "quantization_config", None))

    def _resolve_runner(self) -> str:
        """runner and convert "auto" resolved as vLLM resolves them -> "generate" or "pooling" (and
        convert_type); a pooling engine's pooler_config filled in. ValueError for an architecture or a
        combination nanovllm cannot run."""
        architectures = getattr(self.hf_config, "architectures", None) or []
        kinds = [kind for kind, names in (("causal", SUPPORTED_ARCHITECTURES), ("base", BASE_ARCHITECTURES),
                                          ("classifier", SEQ_CLS_ARCHITECTURES), ("reward", REWARD_ARCHITECTURES))
                 if set(architectures) & set(names)]
        if not kinds:
            supported = SUPPORTED_ARCHITECTURES + BASE_ARCHITECTURES + SEQ_CLS_ARCHITECTURES + tuple(REWARD_ARCHITECTURES)
            raise ValueError(f"model architectures {architectures} are not supported; supported: "
                             f"{', '.join(supported)}.")
        kind, runner, convert = kinds[0], self.runner, self.convert
        if runner == "auto":
            pooling = (convert in ("embed", "classify") or kind != "causal"
                       or is_sentence_transformers_model(self.model_path))
            runner = "pooling" if pooling else "generate"
        self.convert_type = "none"
        if runner == "generate":
            if kind != "causal":
                raise ValueError(f"This model does not support `--runner generate` (architectures {architectures}: "
                                 f"a model without LM head); use runner='pooling'.")
            if convert in ("embed", "classify"):
                raise ValueError(f"convert={convert!r} makes a pooling model: it needs runner 'pooling' or 'auto', "
                                 f"got runner='generate'.")
            if self.pooler_config is not None:
                raise ValueError(f"pooler_config is for pooling models (runner='pooling'), got "
                                 f"{self.pooler_config!r:.80} with runner='generate'.")
            return runner
        if convert == "auto":
            convert = {"causal": "embed", "base": "none", "classifier": "classify", "reward": "classify"}[kind]
        if kind == "base" and convert == "classify":
            raise ValueError(f"convert='classify' needs a causal LM or a classifier checkpoint; architectures "
                             f"{architectures} have neither an LM head nor a classifier head.")
        if kind in ("classifier", "reward") and convert != "classify":
            raise ValueError(f"a classifier checkpoint (architectures {architectures}) runs with convert 'classify' "
                             f"or 'auto', got convert={convert!r}.")
        self.convert_type = "none" if kind == "base" else convert
        self.reward_model = kind == "reward"
        self.pooler_config = PoolerConfig.parse(self.pooler_config) or PoolerConfig()
        if self.reward_model:
            self.pooler_config.reward_defaults(architectures)
        self.pooler_config.resolve(self.model_path)
        if self.pooler_config.enable_chunked_processing or self.pooler_config.max_embed_len is not None:
            logger.warning("pooler_config.enable_chunked_processing and max_embed_len act in vLLM's API server only; "
                           "the offline calls (vLLM's and these) refuse a prompt longer than max_model_len.")
        tasks = self.pooling_tasks
        if self.pooler_config.task is not None and self.pooler_config.task not in tasks:
            fix = "--convert classify" if tasks == EMBED_TASKS else "--convert embed"
            raise ValueError(f"pooler_config.task={self.pooler_config.task!r} is not a task of this model "
                             f"(supported: {', '.join(tasks)}); try converting the model using `{fix}`.")
        return runner

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """What a pooling engine does: an embedding model embeds, a classifier classifies, a reward model scores
        every token (vLLM's: its pooler is a token classifier's)."""
        if self.reward_model:
            return ("token_classify",)
        return CLASSIFY_TASKS if self.convert_type == "classify" else EMBED_TASKS

    def _validate_tensor_parallel(self):
        n, hf = self.tensor_parallel_size, self.hf_config
        if n == 1:
            return
        if self.device == "cuda" and n > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size ({n}) is greater than the number of visible GPUs "
                             f"({torch.cuda.device_count()}).")
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                     "shared_expert_intermediate_size"):
            value = getattr(hf, name, None) or 0
            if value % n:
                raise ValueError(f"the model's {name} ({value}) is not divisible by "
                                 f"tensor_parallel_size ({n}).")

    def fit_to_kv_cache(self, num_blocks: int):
        """max_model_len=-1 (vLLM's auto-fit): the model's length, cut to the tokens num_blocks blocks hold."""
        capacity = num_blocks * self.block_size
        if self.fit_max_model_len and capacity < self.max_model_len:
            logger.info(f"max_model_len {self.max_model_len} cut to {capacity}, the tokens the KV cache holds.")
            self.max_model_len = capacity

    @property
    def logprobs_cap(self) -> int:
        """The most logprobs a request may ask for (max_logprobs; -1: the whole vocabulary)."""
        return self.hf_config.vocab_size if self.max_logprobs == -1 else self.max_logprobs

    def _resolve_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.device == "cpu":
            return torch.float32  # half-precision matmuls are slow on most CPUs
        config_dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(config_dtype, str):
            config_dtype = DTYPES.get(config_dtype)
        return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def sliding_window(hf_config: PretrainedConfig) -> int | None:
    """The window a sliding-window model attends within; None for full attention (Qwen2 and Qwen3
    configs carry a window with use_sliding_window=False)."""
    if not getattr(hf_config, "use_sliding_window", True):
        return None
    return getattr(hf_config, "sliding_window", None)


def _asks_nothing(value, idle) -> bool:
    """Whether an argument's value is vLLM's default, None and an empty container counting alike."""
    def empty(v):
        return v is None or (isinstance(v, (dict, list, set, tuple)) and not v)
    return value == idle or (empty(value) and empty(idle))


def load_chat_template(template: str) -> str:
    """A chat template given as a file path (read) or as the Jinja text itself (as vLLM takes it)."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{{" in template or "{%" in template:
        return template
    raise ValueError(f"chat_template must be a Jinja template or the path of a file holding one; "
                     f"{template!r:.80} is neither (no such file).")
