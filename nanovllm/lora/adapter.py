"""A LoRA adapter's PEFT files, read and checked against the base model.

PEFT saves adapter_config.json (r, lora_alpha, ...) and adapter_model.safetensors with two tensors per
adapted projection, e.g. `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]; the projection computes x @ W.T + scaling * (x @ A.T) @ B.T, with scaling
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). The LM head (`base_model.model.lm_head.lora_A.weight`)
is such a projection too, hidden -> vocabulary; the token embedding's pair is `...embed_tokens.lora_embedding_A`
[r, vocab] and `lora_embedding_B` [hidden, r], which is the same formula with x a token's one-hot row: its
embedding gains scaling * A.T[token] @ B.T.

In a mixture-of-experts layer the MLP's projections are each expert's (`...layers.3.mlp.experts.7.gate_proj`)
and, in Qwen2-MoE, the shared expert's (`...mlp.shared_expert.gate_proj`); the router is not adapted. An adapter
trained on transformers v5's fused experts (PEFT's `target_parameters`, e.g. `mlp.experts.gate_up_proj`, whose
parameter is [experts, 2 x intermediate, hidden]) has one pair for all experts of a fused parameter instead,
under the experts module's name (`...mlp.experts.lora_A.weight`, the next parameter's under `experts.base_layer.`:
PEFT nests its wrappers): A [r x experts, in], expert e's rows e r .. e r + r - 1, and B [out, r x experts],
expert e's columns e, e + experts, ... (`split_fused_experts` turns them into the per-expert pairs). vLLM's
"shared-outer" layout (its enable_moe_shared_loras) stacks each projection's experts instead: `mlp.experts.w1`
(gate), `w3` (up) and `w2` (down), each an A [experts, r, in] and a B [experts, out, r], where a factor that all
experts share has one entry (vLLM's have gate's and up's A and down's B shared; `split_stacked_experts` reads any).
"""
import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig

from nanovllm.layers.moe import is_moe_layer
from nanovllm.logger import init_logger
from nanovllm.lora.request import LoRARequest
from nanovllm.model.qwen3 import head_dim_of

logger = init_logger(__name__)

# A projection's LoRA tensor, as PEFT names it (".default" where an adapter was saved under its name).
TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                         r"((?:experts\.\d+\.|shared_expert\.)?\w+)\.lora_([AB])(?:\.default)?\.weight$")
# A fused experts parameter's LoRA tensor (transformers v5, PEFT's target_parameters), its parameter told by its shape
FUSED_EXPERTS_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)"
                                r"lora_([AB])(?:\.default)?\.weight$")
# A stacked experts factor (vLLM's shared-outer layout): w1 gate_proj, w2 down_proj, w3 up_proj
STACKED_EXPERTS_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.experts\.(w[123])\."
                                  r"lora_([AB])(?:\.default)?\.weight$")
STACKED_TARGETS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# The token embedding's and the LM head's (vLLM's "embedding modules")
MODEL_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(?:model\.(embed_tokens)\.lora_embedding_|(lm_head)\.lora_)"
                               r"([AB])(?:\.default)?(?:\.weight)?$")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
MODEL_TARGETS = ("embed_tokens", "lm_head")
# The modules that take adapters, by vLLM's names (its lora_target_modules; module_of: an adapter target's)
LORA_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "experts", "embed_tokens", "lm_head")


def module_of(target: str) -> str:
    """The module (of LORA_MODULES) that an adapter's target is part of: "q_proj" -> "qkv_proj", "up_proj" (a
    shared expert's too) -> "gate_up_proj", "experts.7.down_proj" -> "experts"."""
    if target.startswith("experts."):
        return "experts"
    name = target.removeprefix("shared_expert.")
    return {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj"}.get(name, name)


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    scaling: float
    # (layer index, target such as "q_proj") -> (A [rank, in_features], B [out_features, rank]), full size;
    # layer None for embed_tokens (in_features: the vocabulary) and lm_head
    weights: dict[tuple[int | None, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shapes(hf: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """target -> (in_features, out_features) of the base model's projection, before sharding (the embedding's
    inputs are the vocabulary's one-hot rows). A mixture of experts' targets are "expert_" and "shared_expert_"
    and the MLP target (see target_shape)."""
    head_dim = head_dim_of(hf)
    q, kv, hidden = hf.num_attention_heads * head_dim, hf.num_key_value_heads * head_dim, hf.hidden_size
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "embed_tokens": (hf.vocab_size, hidden), "lm_head": (hidden, hf.vocab_size)}
    for prefix, key in (("", "intermediate_size"), ("expert_", "moe_intermediate_size"),
                        ("shared_expert_", "shared_expert_intermediate_size")):
        inter = getattr(hf, key, None)
        if inter:
            shapes |= {prefix + "gate_proj": (hidden, inter), prefix + "up_proj": (hidden, inter),
                       prefix + "down_proj": (inter, hidden)}
    return shapes


def target_shape(shapes: dict[str, tuple[int, int]], target: str) -> tuple[int, int]:
    """projection_shapes' entry for a target as layer_targets names it ("experts.7.gate_proj": "expert_gate_proj",
    "shared_expert.gate_proj": "shared_expert_gate_proj")."""
    return shapes[re.sub(r"^experts\.\d+\.", "expert_", target).replace(".", "_")]


def layer_targets(hf: PretrainedConfig, layer: int) -> list[str]:
    """The targets an adapter may have in decoder layer `layer`: the attention projections, then the MLP's, or
    in a mixture-of-experts layer each expert's ("experts.<e>.gate_proj", ...) and the shared expert's
    ("shared_expert.gate_proj", ...) if the model has one."""
    if not is_moe_layer(hf, layer):
        return [*ATTENTION_TARGETS, *MLP_TARGETS]
    experts = [f"experts.{e}.{t}" for e in range(hf.num_experts) for t in MLP_TARGETS]
    shared = [f"shared_expert.{t}" for t in MLP_TARGETS] if getattr(hf, "shared_expert_intermediate_size", 0) else []
    return [*ATTENTION_TARGETS, *experts, *shared]


def peft_names(layer: int | None, target: str) -> tuple[str, str]:
    """The names PEFT saves target's A and B under (layer None: embed_tokens or lm_head)."""
    if target == "embed_tokens":
        name = "base_model.model.model.embed_tokens.lora_embedding_"
        return name + "A", name + "B"
    block = "self_attn" if target in ATTENTION_TARGETS else "mlp"
    name = "lm_head" if target == "lm_head" else f"model.layers.{layer}.{block}.{target}"
    return f"base_model.model.{name}.lora_A.weight", f"base_model.model.{name}.lora_B.weight"


def _pop_expert_pairs(tensors: dict[str, torch.Tensor], pattern: re.Pattern, hf: PretrainedConfig, where: str,
                      describe) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, str]]:
    """The tensors whose names match pattern (groups: layer, a key, A or B), taken out of tensors ->
    {(layer, key): (A, B, the pair described)}; describe(layer, key) names a pair in errors. ValueError for a
    pair missing a half or on a layer that is not a mixture of experts."""
    halves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name in [name for name in tensors if pattern.match(name)]:
        match = pattern.match(name)
        halves.setdefault((match[1], match[2]), {})[match[3]] = tensors.pop(name)
    pairs = {}
    for (layer, key), pair in halves.items():
        what = describe(layer, key)
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: {what} has no lora_{({'A', 'B'} - set(pair)).pop()} tensor.")
        if int(layer) >= hf.num_hidden_layers or not is_moe_layer(hf, int(layer)):
            raise ValueError(f"{where}: {what}: layer {layer} of the base model is not a mixture of experts.")
        pairs[int(layer), key] = (pair["A"], pair["B"], what)
    return pairs


def _add_expert_pair(tensors: dict[str, torch.Tensor], layer: int, target: str, a: torch.Tensor, b: torch.Tensor,
                     what: str, where: str):
    """tensors[target's PEFT names] = a, b (target: "experts.<e>.<projection>"), unless the adapter has them
    already (a ValueError: the experts adapted in two layouts)."""
    a_name, b_name = peft_names(layer, target)
    if a_name in tensors:
        raise ValueError(f"{where}: layer {layer}'s experts are adapted twice: by {what} and by {a_name!r}.")
    tensors[a_name], tensors[b_name] = a.contiguous(), b.contiguous()


def split_fused_experts(tensors: dict[str, torch.Tensor], hf: PretrainedConfig, shapes: dict[str, tuple[int, int]],
                        rank: int, where: str) -> dict[str, torch.Tensor]:
    """tensors with each fused experts pair (FUSED_EXPERTS_NAME) replaced by its experts' pairs under their
    per-expert names: gate_up_proj's A [r x experts, hidden] and B [2 x intermediate, r x experts] give each
    expert's gate_proj and up_proj (B's first and second halves of rows, the same A), down_proj's A [r x experts,
    intermediate] and B [hidden, r x experts] its down_proj (shapes: projection_shapes'). ValueError for a pair
    that is neither."""
    pairs = _pop_expert_pairs(tensors, FUSED_EXPERTS_NAME, hf, where, lambda layer, nesting:
                              f"layer {layer}'s fused experts pair (mlp.experts.{nesting}lora_A / lora_B)")
    for (layer, _), (a, b, what) in pairs.items():   # (on a mixture of experts only: hf.num_experts)
        num_experts, (hidden, inter) = hf.num_experts, shapes["expert_gate_proj"]
        columns = rank * num_experts
        targets = {((columns, hidden), (2 * inter, columns)): ("gate_proj", "up_proj"),
                   ((columns, inter), (hidden, columns)): ("down_proj",)}.get((tuple(a.shape), tuple(b.shape)))
        if targets is None:
            raise ValueError(f"{where}: {what} has shapes {tuple(a.shape)} and {tuple(b.shape)}; at r={rank} a fused "
                             f"gate_up_proj's are ({columns}, {hidden}) and ({2 * inter}, {columns}), a fused "
                             f"down_proj's ({columns}, {inter}) and ({hidden}, {columns}).")
        a = a.reshape(num_experts, rank, -1)                          # [experts, r, in]
        b = b.reshape(b.shape[0], rank, num_experts).permute(2, 0, 1)  # [experts, out, r]
        for expert in range(num_experts):
            for target, rows in zip(targets, b[expert].chunk(len(targets))):
                _add_expert_pair(tensors, layer, f"experts.{expert}.{target}", a[expert], rows, what, where)
    return tensors


def split_stacked_experts(tensors: dict[str, torch.Tensor], hf: PretrainedConfig,
                          shapes: dict[str, tuple[int, int]], rank: int, where: str) -> dict[str, torch.Tensor]:
    """tensors with each stacked experts pair (STACKED_EXPERTS_NAME, vLLM's shared-outer layout) replaced by its
    experts' pairs under their per-expert names: expert e's A is A[e] and its B is B[e], or the one entry of a
    factor all experts share. ValueError for other shapes."""
    pairs = _pop_expert_pairs(tensors, STACKED_EXPERTS_NAME, hf, where, lambda layer, stack:
                              f"layer {layer}'s stacked experts pair mlp.experts.{stack} (lora_A / lora_B)")
    for (layer, stack), (a, b, what) in pairs.items():
        num_experts, target = hf.num_experts, STACKED_TARGETS[stack]
        in_features, out_features = shapes["expert_" + target]
        if (a.dim() != 3 or b.dim() != 3 or tuple(a.shape[1:]) != (rank, in_features)
                or tuple(b.shape[1:]) != (out_features, rank) or {len(a), len(b)} - {1, num_experts}):
            raise ValueError(f"{where}: {what} has shapes {tuple(a.shape)} and {tuple(b.shape)}; at r={rank} a "
                             f"{target}'s are ({num_experts} or 1, {rank}, {in_features}) and ({num_experts} or 1, "
                             f"{out_features}, {rank}).")
        for expert in range(num_experts):
            _add_expert_pair(tensors, layer, f"experts.{expert}.{target}", a[expert % len(a)], b[expert % len(b)],
                             what, where)
    return tensors


def save_adapter(path: str, tensors: dict[str, torch.Tensor], rank: int, alpha: int, targets: list[str], **config):
    """An adapter's two files as PEFT writes them, into the directory path (for tests and benchmarks: the engine
    only reads adapters). config: more adapter_config.json keys."""
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                   "bias": "none", "modules_to_save": None, "use_rslora": False, "use_dora": False} | config, f)


def read_adapter(request: LoRARequest, hf: PretrainedConfig, max_lora_rank: int, path: str,
                 target_modules: list[str] | None = None) -> LoRAAdapter:
    """request's adapter from the directory `path` (request.lora_path resolved) -> LoRAAdapter, or a
    ValueError that names the request and what is wrong. target_modules (lora_target_modules, less lm_head in a
    pooling model): the adapter's weights for other modules are left out, with a warning (all of them: a
    ValueError)."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{where}: no adapter_config.json in {path!r}.")
    with open(config_file) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not a LoRA adapter.")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: adapter_config.json r must be a positive integer, got {rank!r:.80}.")
    if rank > max_lora_rank:
        raise ValueError(f"{where}: LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
    for key, idle in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("modules_to_save", None),
                      ("rank_pattern", {}), ("alpha_pattern", {})):
        if config.get(key) not in (None, idle):
            raise ValueError(f"{where}: adapter_config.json {key}={config[key]!r:.80} is not supported "
                             f"(only {idle!r}).")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank

    shapes = projection_shapes(hf)
    tensors = _load_tensors(path, where)
    for split in (split_fused_experts, split_stacked_experts):
        tensors = split(tensors, hf, shapes, rank, where)
    parts: dict[tuple[int | None, str], dict[str, torch.Tensor]] = {}
    allowed: dict[int, set[str]] = {}   # layer -> its targets
    for name, tensor in tensors.items():
        match, model_match = TENSOR_NAME.match(name), MODEL_TENSOR_NAME.match(name)
        if model_match is not None:
            layer, target, ab = None, model_match[1] or model_match[2], model_match[3]
        elif match is None:
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA A or B matrix of a decoder layer's "
                             f"projection ({', '.join(ATTENTION_TARGETS + MLP_TARGETS)}), the token embedding or "
                             f"the LM head; nanovllm adapts those only.")
        else:
            layer, block, target, ab = int(match[1]), match[2], match[3], match[4]
            if layer >= hf.num_hidden_layers or (block == "self_attn") != (target in ATTENTION_TARGETS):
                raise ValueError(f"{where}: tensor {name!r} names no projection of the base model.")
            if target not in allowed.setdefault(layer, set(layer_targets(hf, layer))):
                if target in MLP_TARGETS:
                    raise ValueError(f"{where}: tensor {name!r}: layer {layer}'s MLP is a mixture of experts; name "
                                     f"its experts' projections (mlp.experts.<e>.{target}).")
                raise ValueError(f"{where}: tensor {name!r} names no projection of the base model.")
        in_features, out_features = target_shape(shapes, target)
        expected = (rank, in_features) if ab == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}.")
        parts.setdefault((layer, target), {})[ab] = tensor
    weights = {}
    for (layer, target), ab in parts.items():
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            what = target if layer is None else f"layer {layer} {target}"
            kind = "lora_embedding_" if target == "embed_tokens" else "lora_"
            raise ValueError(f"{where}: {what} has no {kind}{missing} tensor.")
        weights[layer, target] = (ab["A"], ab["B"])
    if not weights:
        raise ValueError(f"{where}: the adapter holds no LoRA tensors.")
    if target_modules is not None:
        left_out = sorted({module_of(target) for _, target in weights} - set(target_modules))
        weights = {key: pair for key, pair in weights.items() if module_of(key[1]) in target_modules}
        if not weights:
            raise ValueError(f"{where}: the adapter adapts {', '.join(left_out)}, none of the modules this engine "
                             f"adapts ({', '.join(target_modules)}).")
        if left_out:
            logger.warning("%s: its weights for %s are left out (this engine adapts %s).", where,
                           ", ".join(left_out), ", ".join(target_modules))
    return LoRAAdapter(request, rank, scaling, weights)


def _load_tensors(path: str, where: str) -> dict[str, torch.Tensor]:
    safetensors_file = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(safetensors_file):
        return load_file(safetensors_file)
    bin_file = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_file):
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise ValueError(f"{where}: no adapter_model.safetensors or adapter_model.bin in {path!r}.")


class AdapterCache:
    """Adapters read so far, by lora_int_id: up to `capacity` (max_cpu_loras), the least recently used
    dropped first; pinned ones stay. Each rank keeps its own."""

    def __init__(self, hf: PretrainedConfig, max_lora_rank: int, capacity: int, download_dir: str | None = None,
                 token: str | bool | None = None, target_modules: list[str] | None = None):
        self.hf, self.max_lora_rank, self.capacity = hf, max_lora_rank, capacity
        self.target_modules = target_modules
        self.download_dir, self.token = download_dir, token
        self.adapters: dict[int, LoRAAdapter] = {}   # in order of use, the latest last
        self.pinned: set[int] = set()

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """request's adapter, read now unless it is here (by id; a different name or path under a known id
        is a ValueError)."""
        adapter = self.adapters.pop(request.lora_int_id, None)
        if adapter is not None and (adapter.request.lora_name, adapter.request.lora_path) != (
                request.lora_name, request.lora_path):
            self.adapters[request.lora_int_id] = adapter
            raise ValueError(f"lora_int_id {request.lora_int_id} is adapter {adapter.request.lora_name!r} "
                             f"({adapter.request.lora_path}); LoRARequest {request.lora_name!r} "
                             f"({request.lora_path}) needs an id of its own.")
        if adapter is None:
            adapter = read_adapter(request, self.hf, self.max_lora_rank, self._local_path(request),
                                   self.target_modules)
            unpinned = [i for i in self.adapters if i not in self.pinned]
            while len(self.adapters) >= self.capacity and unpinned:
                del self.adapters[unpinned.pop(0)]
        self.adapters[request.lora_int_id] = adapter
        return adapter

    def _local_path(self, request: LoRARequest) -> str:
        if os.path.isdir(request.lora_path):
            return request.lora_path
        from nanovllm.utils.hub import check_directory_or_hub_id, resolve_model_path
        try:
            check_directory_or_hub_id(request.lora_path, "lora_path")
            return resolve_model_path(request.lora_path, cache_dir=self.download_dir, token=self.token)
        except ValueError as e:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {e}") from None

    def remove(self, lora_int_id: int) -> bool:
        self.pinned.discard(lora_int_id)
        return self.adapters.pop(lora_int_id, None) is not None
