"""The head of a sequence classifier (vLLM's convert="classify"; LLM.classify and cross-encoder
LLM.score): a linear map from a pooled hidden state to num_labels logits, then an activation that
makes them probabilities.

A *ForSequenceClassification checkpoint holds the head as score.weight. A causal LM becomes a
classifier without one when hf_overrides name tokens of its vocabulary (vLLM's recipe for
Qwen3-Reranker, an LM that answers "yes" or "no"): the head is made of those tokens' LM-head rows,
so the logits are the LM's logits of those tokens. method "from_2_way_softmax" makes one label, the
"yes" row minus the "no" row: its sigmoid is the LM's softmax probability of "yes" against "no".
method "no_post_processing" keeps one label a token.

A reward model (vLLM's Qwen2ForRewardModel and Qwen2ForProcessRewardModel) scores every token with a head of
two layers: score.0 (hidden -> hidden, with bias), ReLU, score.2 (hidden -> num_labels, with bias); one label
for an outcome reward model, two (wrong, right) for a process reward model, which the pooler reads at the
tokens that end the steps of a solution (pooling_params.py: STEP pooling)."""
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")   # vLLM's
REWARD_ARCHITECTURES = {"Qwen2ForRewardModel": 1, "Qwen2ForProcessRewardModel": 2}   # -> their number of labels
HEAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ClassifierConfig:
    num_labels: int
    dtype: torch.dtype                 # the head's (vLLM's head_dtype: float32 for pooling models)
    activation: str                    # "classify" (softmax, or sigmoid for one label), "identity", "sigmoid",
                                       # or the qualified name of a torch.nn.modules activation
    use_sep_token: bool                # a cross-encoder's pair of texts tokenized as a pair (else joined)
    from_token_ids: list[int] | None = None   # the LM-head rows the head is made of (None: score.weight)
    method: str | None = None
    rows_dtype: torch.dtype | None = None     # those rows rounded to it first: the model's, in which vLLM
                                              # holds the loaded LM head it takes them from
    reward: bool = False                      # a reward model's head of two layers (score.0, score.2)

    @classmethod
    def resolve(cls, hf_config, model_dtype: torch.dtype, tokenizer_path: str) -> "ClassifierConfig":
        """The classifier an HF config asks for (with its hf_overrides applied), as vLLM reads it.
        hf_config.num_labels is set to the head's size. ValueError for what cannot be built."""
        reward = [name for name in getattr(hf_config, "architectures", None) or [] if name in REWARD_ARCHITECTURES]
        if reward:   # (as vLLM: the architecture fixes the number of labels)
            hf_config.num_labels = REWARD_ARCHITECTURES[reward[0]]
            return cls(hf_config.num_labels, head_dtype(hf_config, model_dtype), activation_name(hf_config), False,
                       reward=True)
        tokens = getattr(hf_config, "classifier_from_token", None)
        method = getattr(hf_config, "method", None)
        if getattr(hf_config, "is_original_qwen3_reranker", False):
            if tokens is None or len(tokens) != 2:
                raise ValueError(f"is_original_qwen3_reranker needs classifier_from_token, the two tokens "
                                 f"[no, yes] (e.g. ['no', 'yes']), got {tokens!r}.")
            method = "from_2_way_softmax"
        if method is not None and method not in SEQ_CLS_METHODS:
            raise ValueError(f"method must be one of {', '.join(SEQ_CLS_METHODS)}, got {method!r}.")
        if (method is None) != (tokens is None):
            raise ValueError(f"a classifier made of LM-head rows needs both classifier_from_token and method, "
                             f"got classifier_from_token={tokens!r}, method={method!r}.")
        token_ids = None
        if method is not None:
            if method == "from_2_way_softmax" and len(tokens) != 2:
                raise ValueError(f"method 'from_2_way_softmax' needs two classifier_from_token, [false, true], "
                                 f"got {tokens!r}.")
            token_ids = token_ids_of(tokens, tokenizer_path)
            hf_config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)
        num_labels = getattr(hf_config, "num_labels", 0)
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"a classifier needs num_labels >= 1 in config.json, got {num_labels!r}.")
        # (vLLM's default: an LM used as a reranker joins query and document; a cross-encoder pairs them)
        use_sep_token = getattr(hf_config, "use_pad_token", None)
        if use_sep_token is None:
            use_sep_token = getattr(hf_config, "use_sep_token", method is None)
        return cls(num_labels, head_dtype(hf_config, model_dtype), activation_name(hf_config), bool(use_sep_token),
                   token_ids, method, model_dtype if method is not None else None)


def token_ids_of(tokens: list, tokenizer_path: str) -> list[int]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    vocab = tokenizer.get_vocab()
    unknown = [token for token in tokens if token not in vocab]
    if unknown:
        raise ValueError(f"classifier_from_token {unknown} not in the tokenizer's vocabulary ({tokenizer_path!r}).")
    return [vocab[token] for token in tokens]


def head_dtype(hf_config, model_dtype: torch.dtype) -> torch.dtype:
    """vLLM's head_dtype for a pooling model: float32, or hf_overrides' head_dtype ("model": the model's)."""
    value = getattr(hf_config, "head_dtype", None)
    if value is None:
        return torch.float32
    if value == "model":
        return model_dtype
    if isinstance(value, torch.dtype):
        return value
    if value not in HEAD_DTYPES:
        raise ValueError(f"head_dtype must be 'model' or one of {', '.join(HEAD_DTYPES)}, got {value!r}.")
    return HEAD_DTYPES[value]


def activation_name(hf_config) -> str:
    """The activation of the classifier's logits, as vLLM (and transformers' losses) read the config:
    problem_type first, then a sentence-transformers cross-encoder's activation_fn."""
    problem = getattr(hf_config, "problem_type", None) or ""
    if problem == "regression":
        return "identity"
    if problem == "single_label_classification":
        return "classify"
    if problem == "multi_label_classification":
        return "sigmoid"
    sentence_transformers = getattr(hf_config, "sentence_transformers", None)
    name = (sentence_transformers.get("activation_fn") if isinstance(sentence_transformers, dict) else None) \
        or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if name is None:
        return "classify"
    if not name.startswith("torch.nn.modules."):
        raise ValueError(f"Loading of activation functions is restricted to torch.nn.modules for security "
                         f"reasons, got {name!r}.")
    module_name, _, class_name = name.rpartition(".")
    if class_name in ("Sigmoid", "Softmax"):
        return "classify"
    if class_name == "Identity":
        return "identity"
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    if not isinstance(getattr(module, class_name, None), type):
        raise ValueError(f"activation_fn {name!r} is not a torch.nn.modules class.")
    return name


def activation_fn(name: str):
    """activation_name's name -> a function of logits [..., num_labels]."""
    if name == "classify":
        return lambda x: torch.sigmoid(x) if x.shape[-1] < 2 else F.softmax(x, dim=-1)
    if name == "identity":
        return lambda x: x
    if name == "sigmoid":
        return torch.sigmoid
    module_name, _, class_name = name.rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)()


def classifier_head(hidden_size: int, config: ClassifierConfig) -> nn.Module:
    return RewardHead(hidden_size, config) if config.reward else ClassifierHead(hidden_size, config)


class ClassifierHead(nn.Module):
    """score: hidden states [n, hidden] -> logits [n, num_labels] in the head's dtype (the same on every
    tensor-parallel rank: the pooler runs on rank 0 only)."""

    def __init__(self, hidden_size: int, config: ClassifierConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_labels, hidden_size, dtype=config.dtype),
                                   requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.weight.dtype), self.weight)

    @torch.no_grad()
    def load_from_lm_head(self, lm_head):
        """The head made of the LM head's rows (the vocabulary's: [vocab, hidden]) of config.from_token_ids.
        lm_head: a tensor, or a safetensors slice (only those rows are read)."""
        rows = torch.cat([lm_head[i:i + 1] for i in self.config.from_token_ids]).to(self.config.rows_dtype).float()
        if self.config.method == "from_2_way_softmax":   # [false, true] -> true - false
            rows = rows[1:] - rows[:1]
        self.weight.copy_(rows)


class RewardHead(nn.Sequential):
    """A reward model's score: hidden states [n, hidden] -> logits [n, num_labels] in the head's dtype, through
    Linear(hidden, hidden), ReLU, Linear(hidden, num_labels)."""

    def __init__(self, hidden_size: int, config: ClassifierConfig):
        super().__init__(nn.Linear(hidden_size, hidden_size, dtype=config.dtype), nn.ReLU(),
                         nn.Linear(hidden_size, config.num_labels, dtype=config.dtype))
        self.requires_grad_(False)
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden.to(self[0].weight.dtype))
