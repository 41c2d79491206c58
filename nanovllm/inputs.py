"""The prompt forms LLM.generate takes, by vLLM's names (vllm.inputs): a string, a list of token
ids, TextPrompt {"prompt": ...} or TokensPrompt {"prompt_token_ids": [...]}, or a list of these.
The dict types are plain dicts at run time; they exist so that vLLM scripts import them."""
from typing import Callable, TypedDict


class TextPrompt(TypedDict):
    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    prompt: str     # optional: the text the ids came from, reported back in RequestOutput.prompt


PromptType = str | list[int] | TextPrompt | TokensPrompt

# Keys of vLLM's prompt dicts that ask for something nanovllm does not do: refused, not ignored.
UNSUPPORTED_KEYS = {"multi_modal_data": "multimodal inputs (nanovllm runs text-only models)",
                    "mm_processor_kwargs": "multimodal inputs (nanovllm runs text-only models)",
                    "multi_modal_uuids": "multimodal inputs (nanovllm runs text-only models)",
                    "cache_salt": "cache_salt (prefix-cache isolation)",
                    "token_type_ids": "token_type_ids (pooling models)"}


def parse_prompts(prompts, encode: Callable[[int, str], list[int]]) -> list[tuple[str | None, list[int]]]:
    """-> [(prompt text or None, prompt token ids)] for every accepted prompt form; encode(index,
    text) tokenizes a text prompt."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a token-id list, a dict with "
                         f"'prompt_token_ids' or 'prompt', or a list of these; got {type(prompts).__name__}.")
    parsed = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            for key in p:
                if key in UNSUPPORTED_KEYS:
                    raise ValueError(f"prompt {i}: {key!r} is not supported: {UNSUPPORTED_KEYS[key]}.")
                if key not in ("prompt", "prompt_token_ids"):
                    raise ValueError(f"prompt {i}: unknown key {key!r}; a prompt dict has 'prompt' and/or "
                                     f"'prompt_token_ids'.")
        if isinstance(p, dict) and "prompt_token_ids" in p:
            parsed.append((p.get("prompt"), list(p["prompt_token_ids"])))
        elif isinstance(p, dict) and "prompt" in p:
            parsed.append((p["prompt"], encode(i, p["prompt"])))
        elif isinstance(p, str):
            parsed.append((p, encode(i, p)))
        elif isinstance(p, (list, tuple)):
            parsed.append((None, list(p)))
        else:
            raise ValueError(f"prompt {i} must be a string, a token-id list or a dict with "
                             f"'prompt_token_ids' or 'prompt'; got {p!r:.80}.")
    return parsed
