"""Fixtures: tiny random Qwen3 / Qwen2 checkpoints (real architecture, small sizes) with a small
byte-level BPE tokenizer saved beside them, and HF transformers as the reference."""
import contextlib
import json
import logging
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

VOCAB_SIZE = 384
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks.",
    "A scheduler batches sequences; a block manager hands out blocks and caches full prefixes.",
    "Hello world! Stop strings may span several tokens, so detokenization is incremental.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { } are here too.",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 16, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def build_model_dir(path, arch: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0, **sizes):
    """sizes override the tiny defaults (hidden_size, num_hidden_layers, head_dim, ...)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=None, initializer_range=0.1)
    common |= {k: v for k, v in sizes.items() if k != "head_dim"}
    if arch == "qwen3":
        config = Qwen3Config(head_dim=sizes.get("head_dim", 16), tie_word_embeddings=True, **common)
        cls = Qwen3ForCausalLM
    elif arch == "qwen3_moe":   # 4 experts, 2 per token; layer 1 of 2 is a dense MLP
        config = Qwen3MoeConfig(head_dim=sizes.get("head_dim", 16), tie_word_embeddings=True, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                                norm_topk_prob=True, **common)
        cls = Qwen3MoeForCausalLM
    elif arch == "qwen2_moe":   # 4 experts, 2 per token, not renormalised, plus a gated shared expert
        config = Qwen2MoeConfig(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, shared_expert_intermediate_size=96, **common)
        cls = Qwen2MoeForCausalLM
    elif arch == "mistral":
        config = MistralConfig(head_dim=sizes.get("head_dim", 16), tie_word_embeddings=False, **common)
        cls = MistralForCausalLM
    elif arch == "llama":   # with Llama 3's RoPE scaling, and biases (q/k/v/o) to load
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=64)
        config = LlamaConfig(head_dim=sizes.get("head_dim", 16), tie_word_embeddings=False, attention_bias=True,
                             rope_scaling=rope, **common)
        cls = LlamaForCausalLM
    else:
        config, cls = Qwen2Config(tie_word_embeddings=False, **common), Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(eos_token_id=eos, do_sample=False).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


FP8_BLOCK = (24, 40)   # (output rows, input columns) a scale: the tiny weights' edges fall in part blocks


def block_scales(scale: torch.Tensor, shape) -> torch.Tensor:
    """One scale an FP8_BLOCK, spread over a weight of this shape."""
    rows, cols = FP8_BLOCK
    return scale.repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(cols, 1)[:, :shape[1]]


def fp8_checkpoints(src, tmp_path, scheme: str = "block") -> tuple[str, str]:
    """src's projections in float8 e4m3, and the same weights dequantized in a plain checkpoint: (fp8 dir,
    reference dir). scheme "block": a scale an FP8_BLOCK (quant_method "fp8", `<name>_scale_inv`, as vLLM's
    fp8 checkpoints and Qwen3-*-FP8 hold them; here in a file of their own); "channel": a scale an output row
    (compressed-tensors, `<name>_scale`, as llm-compressor writes them)."""
    fp8_dir, ref_dir = tmp_path / f"fp8_{scheme}", tmp_path / f"ref_{scheme}"
    shutil.copytree(src, fp8_dir)
    shutil.copytree(src, ref_dir)
    quantized, scales, dequantized = load_file(f"{src}/model.safetensors"), {}, {}
    for name, w in list(quantized.items()):
        if name.endswith("_proj.weight"):
            if scheme == "block":
                grid = [-(-n // b) for n, b in zip(w.shape, FP8_BLOCK)]
                padded = torch.nn.functional.pad(w, (0, grid[1] * FP8_BLOCK[1] - w.shape[1],
                                                     0, grid[0] * FP8_BLOCK[0] - w.shape[0]))
                amax = padded.reshape(grid[0], FP8_BLOCK[0], grid[1], FP8_BLOCK[1]).abs().amax(dim=(1, 3))
                scale = amax / torch.finfo(torch.float8_e4m3fn).max
                full, scales[f"{name}_scale_inv"] = block_scales(scale, w.shape), scale
            else:
                amax = w.abs().amax(dim=1, keepdim=True)
                full = scales[f"{name}_scale"] = amax / torch.finfo(torch.float8_e4m3fn).max
            quantized[name] = (w / full).to(torch.float8_e4m3fn)
            dequantized[name] = quantized[name].float() * full
    if scheme == "block":
        save_file(quantized, f"{fp8_dir}/model.safetensors", metadata={"format": "pt"})
        save_file(scales, f"{fp8_dir}/scales.safetensors", metadata={"format": "pt"})
        quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                        "weight_block_size": list(FP8_BLOCK)}
    else:
        save_file(quantized | scales, f"{fp8_dir}/model.safetensors", metadata={"format": "pt"})
        quantization = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                            "type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False},
                            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                                  "dynamic": True}}}}
    save_file(load_file(f"{src}/model.safetensors") | dequantized, f"{ref_dir}/model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    return str(fp8_dir), str(ref_dir)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


def checkpoint_fixture(arch: str):
    """A session fixture `<arch>_dir`: the tiny checkpoint of that architecture."""
    @pytest.fixture(scope="session", name=f"{arch}_dir")
    def checkpoint(tmp_path_factory, tokenizer):
        return build_model_dir(tmp_path_factory.mktemp(arch), arch, tokenizer)
    return checkpoint


ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe", "qwen2_moe")
qwen3_dir, qwen2_dir, llama_dir, qwen3_moe_dir, qwen2_moe_dir = (checkpoint_fixture(arch) for arch in ARCHS)


@pytest.fixture(params=ARCHS)
def model_dir(request):
    """Every architecture in turn."""
    return request.getfixturevalue(f"{request.param}_dir")


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from HF transformers' generate, EOS ignored."""
    model = hf_model(path)
    model.generation_config.eos_token_id = None
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                           max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs


def make_prompts(seed: int = 0, num: int = 16) -> list[list[int]]:
    """Varied lengths (1 to ~150 tokens); prompts 8+ share a 70-token prefix in pairs and triples."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()
    lengths = [1, 2, 7, 16, 17, 33, 64, 150]
    prompts = [rand(n) for n in lengths]
    shared = rand(70)
    prompts += [shared + rand(n) for n in (1, 5, 16, 40)]
    shared2 = rand(48)
    prompts += [shared2 + rand(n) for n in (3, 9, 20, 31)]
    return prompts[:num]


def as_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in prompts]


def assert_pooling_idle(llm):
    """A pooling engine with nothing left: no request, every block free, no token task's rows kept."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.model_runner.pooler.chunks


@contextlib.contextmanager
def log_lines(logger_name: str):
    """Yields the list of messages logged under logger_name inside the block (nanovllm's logger
    does not propagate to pytest's caplog)."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def watch_overlap(llm):
    """-> a list that gets, for each step the engine launches, whether the step before was still
    unread at the launch (async scheduling: the host reads a step while the next one runs)."""
    engine = llm.llm_engine
    execute, overlapped = engine.model_runner.execute, []

    def watched(*args, **kwargs):
        overlapped.append(engine.in_flight is not None)
        return execute(*args, **kwargs)

    engine.model_runner.execute = watched
    try:
        yield overlapped
    finally:
        engine.model_runner.execute = execute


def tokens_and_tops(outputs) -> list[tuple[list[int], list[dict[int, float]]]]:
    """check_logprobs_close's form of RequestOutputs: each first completion's tokens and its top-N
    logprobs a step."""
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
            for o in outputs]


def check_logprobs_close(ours, ref):
    """As vLLM's check: where the greedy tokens first differ, each side's token must be in the
    other side's top-N; after that the sequences are not compared. Returns how many matched fully."""
    full = 0
    for i, ((our_tokens, our_tops), (ref_tokens, ref_tops)) in enumerate(zip(ours, ref)):
        for t, (a, b) in enumerate(zip(our_tokens, ref_tokens)):
            if a != b:
                assert a in ref_tops[t] and b in our_tops[t], \
                    f"prompt {i}, token {t}: ours {a} (top {our_tops[t]}) vs HF {b} (top {ref_tops[t]})"
                break
        else:
            full += 1
    return full


def check_within_top_k_top_p(outputs, top_k: int, top_p: float) -> int:
    """Every sampled token (temperature 1, logprobs >= top_k requested) is among its step's top_k
    and, of those renormalised, the tokens more likely than it hold less than top_p. Returns
    the number of tokens checked."""
    checked = 0
    for out in outputs:
        for completion in out.outputs:
            for token, step in zip(completion.token_ids, completion.logprobs):
                rank = step[token].rank
                assert rank <= top_k, (token, step)
                best = [lp for lp in step.values() if lp.rank <= top_k]
                total = sum(math.exp(lp.logprob) for lp in best)
                ahead = sum(math.exp(lp.logprob) for lp in best if lp.rank < rank) / total
                assert ahead < top_p + 1e-5, (token, step)
                checked += 1
    return checked
