"""LoRA adapters (vLLM's `enable_lora=True` and `lora_request=LoRARequest(...)`): request.py names an
adapter, adapter.py reads and checks its PEFT files, layers.py adds its products to the base model's."""
from nanovllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
