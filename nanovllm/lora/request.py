"""vLLM's LoRARequest (`from vllm.lora.request import LoRARequest`)."""
from dataclasses import dataclass


@dataclass
class LoRARequest:
    """An adapter for a request: lora_name and lora_int_id (a positive int that identifies it in the
    engine: requests with the same id share it), and lora_path, a local directory or a hub id holding
    PEFT's adapter_config.json and adapter_model.safetensors."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: str | None = None   # vLLM's older name for lora_path
    long_lora_max_len: int | None = None
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False      # vLLM's MoE layout switch; the layout is read from the tensors' names

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id!r:.80}.")
        if not self.lora_path:
            self.lora_path = self.lora_local_path or ""
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must name the adapter's directory, "
                             f"got {self.lora_path!r:.80}.")
        if self.long_lora_max_len is not None or self.tensorizer_config_dict is not None:
            raise ValueError(f"LoRARequest {self.lora_name!r}: long_lora_max_len and tensorizer_config_dict are "
                             f"not supported; leave them None.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other) -> bool:   # (vLLM's: one name, one adapter)
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
