"""ModelConfig: vLLM's read-only view of the model's settings, over Config."""
import torch
from transformers import PretrainedConfig

from nanovllm.config import Config, sliding_window


class ModelConfig:
    """vLLM's LLM.model_config and LLMEngine.model_config, read-only: the model's settings by
    vLLM's names (e.g. lm-eval reads llm.llm_engine.model_config.max_model_len). Config's fields
    read through (model, tokenizer, max_model_len, hf_config, runner_type, convert_type, ...); dtype is
    the resolved torch dtype, as vLLM's."""
    is_multimodal_model = False
    is_encoder_decoder = False

    def __init__(self, config: Config):
        self._config = config

    def __getattr__(self, name: str):   # (only for what the class does not define)
        if name.startswith("_"):   # not _config itself, which copy and pickle ask for before it is set
            raise AttributeError(name)
        return getattr(self._config, name)

    @property
    def is_matryoshka(self) -> bool:
        hf = self._config.hf_config
        return bool(getattr(hf, "matryoshka_dimensions", None)) or getattr(hf, "is_matryoshka", False)

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        return getattr(self._config.hf_config, "matryoshka_dimensions", None)

    @property
    def embedding_size(self) -> int:
        return self._config.hf_config.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self._config.torch_dtype

    @property
    def hf_text_config(self) -> PretrainedConfig:
        return self._config.hf_config

    @property
    def served_model_name(self) -> str:
        name = self._config.served_model_name
        return (name[0] if isinstance(name, list) else name) or self._config.model

    @property
    def architecture(self) -> str:
        return self._config.hf_config.architectures[0]

    def get_vocab_size(self) -> int:
        return self._config.hf_config.vocab_size

    def get_hidden_size(self) -> int:
        return self._config.hf_config.hidden_size

    def get_head_size(self) -> int:
        hf = self._config.hf_config
        return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads

    def get_total_num_kv_heads(self) -> int:
        return self._config.hf_config.num_key_value_heads

    def get_num_kv_heads(self, parallel_config=None) -> int:
        """KV heads per tensor-parallel rank (parallel_config, vLLM's argument, is not needed here)."""
        return max(1, self.get_total_num_kv_heads() // self._config.tensor_parallel_size)

    def get_num_attention_heads(self, parallel_config=None) -> int:
        return self._config.hf_config.num_attention_heads // self._config.tensor_parallel_size

    def get_total_num_hidden_layers(self) -> int:
        return self._config.hf_config.num_hidden_layers

    def get_num_layers(self, parallel_config=None) -> int:
        return self.get_total_num_hidden_layers()   # no pipeline parallelism: every rank runs every layer

    def get_sliding_window(self) -> int | None:
        return sliding_window(self._config.hf_config)
