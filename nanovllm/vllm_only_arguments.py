"""vLLM 0.26's engine arguments (LLM(), EngineArgs) that nanovllm has no use for, so that a vLLM
script that passes them still runs. Config.from_kwargs takes them out before building the Config.

IDLE_ARGUMENTS are accepted only at vLLM's default, the value that asks for nothing: any other
value asks for a feature nanovllm does not have, and is a ValueError naming it. IGNORED_ARGUMENTS
are accepted at any value: they tune how vLLM does something nanovllm does its own way, and the
outputs do not depend on them."""


def _group(reason: str, **defaults) -> dict:
    return {name: (default, reason) for name, default in defaults.items()}


# name -> (vLLM's default, what nanovllm lacks). Where vLLM's default is one of its own config
# objects (eplb_config, kernel_config, mamba_config, ...), None stands for it.
IDLE_ARGUMENTS = {
    **_group("tensor parallelism on one host only", data_parallel_size=1, data_parallel_rank=None,
             data_parallel_start_rank=None, data_parallel_size_local=None, data_parallel_address=None,
             data_parallel_rpc_port=None, data_parallel_hybrid_lb=False, data_parallel_external_lb=False,
             data_parallel_multi_port_external_lb=False, data_parallel_backend="mp",
             disable_nccl_for_dp_synchronization=None, prefill_context_parallel_size=1,
             decode_context_parallel_size=1, dcp_comm_backend="ag_rs", dcp_kv_cache_interleave_size=1,
             cp_kv_cache_interleave_size=1, master_addr="127.0.0.1", master_port=29501, nnodes=1, node_rank=0,
             device_ids=None, ray_workers_use_nsight=False, _api_process_count=1, _api_process_rank=0),
    **_group("the worker processes are nanovllm's own", worker_cls="auto", worker_extension_cls="",
             distributed_timeout_seconds=None, cpu_distributed_timeout_seconds=None, numa_bind=False,
             numa_bind_nodes=None, numa_bind_cpus=None),
    **_group("MoE experts are split across tensor-parallel ranks like the dense MLP", enable_ep_weight_filter=False,
             enable_elastic_ep=False, eplb_config=None, enable_eplb=False, expert_placement_strategy="linear",
             all2all_backend="allgather_reducescatter"),
    **_group("the kernels are nanovllm's own; choose attention's with attention_backend", moe_backend="auto",
             linear_backend="auto", kernel_config=None, ir_op_priority=None, enable_flashinfer_autotune=None,
             enable_bf16x3_router_gemm=None, gdn_prefill_backend=None, attention_config=None,
             override_attention_dtype=None, use_fp64_gumbel=False),
    **_group("the scheduler is nanovllm's own", scheduler_cls=None, max_num_scheduled_tokens=None,
             max_num_partial_prefills=1, max_long_partial_prefills=1, long_prefill_token_threshold=0,
             scheduler_reserve_full_isl=True, prefill_schedule_interval=1, watermark=0.0, stream_interval=1),
    **_group("no CPU offloading", offload_group_size=0, offload_num_in_group=1, offload_prefetch_step=1,
             offload_params=None, offload_backend="auto", cpu_offload_params=None, kv_offloading_size=None,
             kv_offloading_backend="native"),
    **_group("no KV-cache or weight transfer between engines", kv_transfer_config=None, kv_events_config=None,
             ec_transfer_config=None, kv_sharing_fast_prefill=False, weight_transfer_config=None),
    **_group("text-only models", mm_processor_kwargs=None, allowed_local_media_path="", allowed_media_domains=None,
             limit_mm_per_prompt=None, enable_mm_embeds=False, interleave_mm_strings=False, media_io_kwargs=None,
             mm_processor_cache_gb=4, mm_processor_cache_type="lru", mm_shm_cache_max_object_size_mb=128,
             mm_encoder_only=False, mm_encoder_tp_mode="weights", mm_encoder_attn_backend=None,
             mm_encoder_attn_dtype=None, mm_encoder_fp8_scale_path=None, mm_encoder_fp8_scale_save_path=None,
             mm_encoder_fp8_scale_save_margin=1.5, skip_mm_profiling=False, video_pruning_rate=None,
             mm_tensor_ipc="direct_rpc", mm_ipc_gpu_memory_gb=0, disable_chunked_mm_input=False,
             io_processor_plugin=None, enable_mm_processor_stats=False),
    **_group("no Mamba or diffusion models", mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto",
             mamba_block_size=None, mamba_cache_mode="none", mamba_backend="triton",
             enable_mamba_cache_stochastic_rounding=False, mamba_cache_philox_rounds=0, mamba_config=None,
             prefix_match_unit=None, diffusion_config=None),
    **_group("MoE routing is not returned", enable_return_routed_experts=False),
    **_group("no quantization settings: fp8 checkpoints load dequantized", quantization_config=None,
             allow_deprecated_quantization=False, calculate_kv_scales=False, kv_cache_dtype_skip_layers=None),
    **_group("the model is a local folder or a hub id with a config.json, run by nanovllm's own model code",
             model_weights="", hf_config_path=None, config_format="auto", code_revision=None,
             model_class_overrides=None, model_loader_extra_config=None, additional_config=None),
    **_group("the reasoning parsers are engine/reasoning.py's", reasoning_parser_plugin=None),
    **_group("the tokenizer is loaded unless skip_tokenizer_init=True", tokens_only=False),
    **_group("memory is freed by sleep mode's own allocator (enable_sleep_mode)", enable_cumem_allocator=False),
    **_group("the metrics are get_metrics()'s; no tracing", show_hidden_metrics_for_version=None,
             otlp_traces_endpoint=None, collect_detailed_traces=None, kv_cache_metrics=False,
             kv_cache_metrics_sample=0.01, cudagraph_metrics=False, enable_layerwise_nvtx_tracing=False,
             enable_mfu_metrics=False, enable_logging_iteration_details=False, aggregate_engine_logging=False,
             jit_monitor_mode="warn", jit_monitor_verbose=False),
    **_group("LoRA on every attention and MLP projection, the embedding and the LM head of text-only models",
             default_mm_loras=None, enable_tower_connector_lora=False),
}

# vLLM's settings that leave nanovllm's outputs as they are, accepted at any value and not used:
# name -> (vLLM's default, what nanovllm does instead); None stands for a vLLM config object, as above.
IGNORED_ARGUMENTS = {
    **_group("the safetensors files of the model folder are read one by one", max_parallel_loading_workers=None,
             safetensors_load_strategy=None, safetensors_prefetch_num_threads=8,
             safetensors_prefetch_block_size=16 * 1024 * 1024, use_tqdm_on_load=True, pt_load_map_location="cpu",
             ignore_patterns=["original/**/*"]),
    **_group("each rank adds its shard's part of the adapters' products", fully_sharded_loras=False,
             specialize_active_lora=False),
    **_group("an MoE adapter is read in any of its layouts (PEFT's per-expert pairs, its fused experts' pairs, "
             "vLLM's shared-outer stacks), whatever the engine's settings", enable_mixed_moe_lora_format=False,
             enable_moe_shared_loras=False),
    **_group("the prefix cache hashes with xxhash and compares a hit's tokens", prefix_caching_hash_algo="sha256"),
    **_group("shared prefixes are read once a run where that pays (engine/shared_prefix.py)",
             disable_cascade_attn=True),
    **_group("decode graphs are captured for every batch size up to max_num_seqs", cudagraph_capture_sizes=None,
             max_cudagraph_capture_size=None),
    **_group("the engine compiles and captures CUDA graphs its own way; enforce_eager=True turns the graphs off",
             compilation_config=None, optimization_level=2, performance_mode="balanced"),
    **_group("a step runs as one batch, not as overlapped micro-batches", enable_dbo=False, ubatch_size=0,
             dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512),
    **_group("text-only, non-hybrid models", language_model_only=False, disable_hybrid_kv_cache_manager=None),
    **_group("prompts are tokenized in the caller's process", renderer_num_workers=1),
    **_group("tensor-parallel workers end when the LLM is closed", shutdown_timeout=0),
    **_group("no VLLM_* environment variables are read", fail_on_environ_validation=False),
}
