"""Qwen3, Qwen3-MoE, Qwen2, Qwen2-MoE, Llama and Mistral (Llama's architecture) in one file.

They differ only in the attention block and the MLP: Qwen3 normalises q and k per head (q_norm,
k_norm) and has no qkv bias by default; Qwen2 has a qkv bias and no q/k norm; Llama has neither
(and Llama 3.1+ scales its RoPE frequencies for long contexts); the MoE variants put a mixture
of experts in place of the MLP of most layers (layers/moe.py).
"""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.distributed import SINGLE, TPGroup
from nanovllm.layers.attention import Attention, AttentionMetadata
from nanovllm.layers.classifier import ClassifierConfig, classifier_head
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import ColumnParallelLinear, Partials, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.mlp import GatedMLP
from nanovllm.layers.moe import SparseMoeBlock, is_moe_layer
from nanovllm.layers.rotary import RotaryEmbedding, max_positions, rope_settings


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class QwenAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPGroup, rotary_emb: RotaryEmbedding):
        """rotary_emb: the model's one RotaryEmbedding, shared by all layers (its cos/sin table is
        [max positions, head_dim] floats: 21 MB for Qwen3-0.6B, 67 MB with YaRN to 131k)."""
        super().__init__()
        tp_size = tp.size
        self.is_qwen3 = config.model_type in ("qwen3", "qwen3_moe")
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        if config.model_type in ("qwen2", "qwen2_moe"):    # biases on q/k/v only
            qkv_bias, o_bias = getattr(config, "qkv_bias", True), False
        else:
            qkv_bias = o_bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=o_bias, tp=tp, to_norm=True)   # the decoder layer's norm next
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        if self.is_qwen3:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor | Partials:
        # x: [num_tokens, hidden_size]; the result goes to the decoder layer's norm
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if qkv.is_cuda:   # one fused kernel: q/k norms, RoPE, and k/v written into the KV cache
            from nanovllm.kernels.triton_fused import qk_norm_rope_store
            q = qk_norm_rope_store(qkv, positions, self.rotary_emb.cos_sin_cache, self.num_heads,
                                   self.num_kv_heads, self.head_dim, self.q_norm.weight if self.is_qwen3 else None,
                                   self.k_norm.weight if self.is_qwen3 else None,
                                   self.q_norm.eps if self.is_qwen3 else 0.0,
                                   self.attn.k_cache, self.attn.v_cache, meta.slot_mapping,
                                   out=self.attn.query_out(len(qkv)))
            k = v = None
        else:
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            if self.is_qwen3:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)                     # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.flatten(1))


class QwenDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPGroup, index: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = QwenAttention(config, tp, rotary_emb)
        if is_moe_layer(config, index):
            self.mlp = SparseMoeBlock(config, tp, to_norm=True)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config, tp, to_norm=True)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class QwenModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        rotary_emb = RotaryEmbedding(head_dim_of(config), max_positions(config), *rope_settings(config))
        self.layers = nn.ModuleList([QwenDecoderLayer(config, tp, i, rotary_emb)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta, embeds=None):
        x, residual = self.embed_tokens(input_ids), None
        if embeds is not None:   # (rows, vectors): rows whose input is given as a vector (prompt_embeds)
            x = x.index_copy(0, *embeds)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class QwenForCausalLM(nn.Module):
    # checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, tp: TPGroup = SINGLE, lm_head: bool = True,
                 classifier: ClassifierConfig | None = None):
        """tp: this rank's tensor-parallel group; each rank holds its shard of every layer.
        lm_head: False for a pooling model (runner="pooling"), which returns hidden states only;
        classifier: a classifier's head (score), which the pooler applies."""
        super().__init__()
        self.model = QwenModel(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp) if lm_head else None
        if lm_head and config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.score = classifier_head(config.hidden_size, classifier) if classifier is not None else None
        # the checkpoint tensor a head made of LM-head rows comes from (the LM head, or the embedding it is tied to)
        self.score_source = None
        if classifier is not None and classifier.from_token_ids is not None:
            self.score_source = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]. embeds: (rows,
        vectors [len(rows), hidden_size]) that those rows take instead of their tokens' embeddings."""
        return self.model(input_ids, positions, meta, embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_seqs, hidden_size] -> logits [num_seqs, vocab_size] (None on ranks > 0)."""
        return self.lm_head(hidden)


def build_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup = SINGLE,
                fp8: bool = False, **heads) -> QwenForCausalLM:
    """A QwenForCausalLM made on device with its parameters in dtype (torch's default dtype while it is made);
    fp8: the decoder's projections (q/k/v, o, gate/up, down; not the MoE experts and routers) in fp8, with fp8
    products (layers/linear.py); heads: lm_head and classifier, as QwenForCausalLM takes them."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = QwenForCausalLM(config, tp, **heads)
    finally:
        torch.set_default_dtype(default_dtype)
    if fp8:
        for module in model.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.use_fp8()
    return model

Qwen3ForCausalLM = Qwen3MoeForCausalLM = Qwen2ForCausalLM = Qwen2MoeForCausalLM = LlamaForCausalLM = \
    MistralForCausalLM = QwenForCausalLM
