"""The prompt forms LLM.generate takes, by vLLM's names (vllm.inputs): a string, a list of token
ids, TextPrompt {"prompt": ...} or TokensPrompt {"prompt_token_ids": [...]}, or a list of these.
The dict types are plain dicts at run time; they exist so that vLLM scripts import them.

Either dict may carry a "cache_salt" string: its blocks then hit in the prefix cache only for
requests with the same salt (vLLM's isolation of tenants sharing one engine)."""
import numbers
from typing import Callable, NamedTuple, TypedDict

from nanovllm.utils.validation import as_python


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    cache_salt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    prompt: str     # the text the ids came from, reported back in RequestOutput.prompt
    cache_salt: str


class Prompt(NamedTuple):
    """A parsed prompt."""
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


PromptType = str | list[int] | TextPrompt | TokensPrompt

# Keys of vLLM's prompt dicts that ask for something nanovllm does not do: refused, not ignored.
UNSUPPORTED_KEYS = {"multi_modal_data": "multimodal inputs (nanovllm runs text-only models)",
                    "mm_processor_kwargs": "multimodal inputs (nanovllm runs text-only models)",
                    "multi_modal_uuids": "multimodal inputs (nanovllm runs text-only models)",
                    "token_type_ids": "token_type_ids (pooling models)"}
KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def parse_prompts(prompts, encode: Callable[[int, str], list[int]]) -> list[Prompt]:
    """Every accepted prompt form as a Prompt; encode(index, text) tokenizes a text prompt."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, numbers.Integral) for t in prompts)):
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
                if key not in KEYS:
                    raise ValueError(f"prompt {i}: unknown key {key!r}; a prompt dict has 'prompt' and/or "
                                     f"'prompt_token_ids', and may have 'cache_salt'.")
            salt = p.get("cache_salt")
            if salt is not None and not (isinstance(salt, str) and salt):
                raise ValueError(f"prompt {i}: cache_salt must be a non-empty string, got {salt!r:.80}.")
        if isinstance(p, dict) and "prompt_token_ids" in p:
            parsed.append(Prompt(p.get("prompt"), _token_ids(i, p["prompt_token_ids"]), p.get("cache_salt")))
        elif isinstance(p, dict) and "prompt" in p:
            parsed.append(Prompt(p["prompt"], encode(i, p["prompt"]), p.get("cache_salt")))
        elif isinstance(p, str):
            parsed.append(Prompt(p, encode(i, p)))
        elif isinstance(p, (list, tuple)) or _is_array(p):
            parsed.append(Prompt(None, _token_ids(i, p)))
        else:
            raise ValueError(f"prompt {i} must be a string, a token-id list or a dict with "
                             f"'prompt_token_ids' or 'prompt'; got {p!r:.80}.")
    return parsed


def _is_array(x) -> bool:
    """A numpy array or torch tensor (told apart by duck typing: neither is imported here)."""
    return hasattr(x, "tolist") and hasattr(x, "shape") and not isinstance(x, (list, tuple))


def _token_ids(index: int, ids) -> list[int]:
    """Prompt index's token ids as Python ints, from a list or tuple, or a 1-D numpy array or torch
    tensor; a bool, float or other non-integer id is refused."""
    if _is_array(ids):
        if len(ids.shape) != 1:
            raise ValueError(f"prompt {index}: token ids must be one-dimensional, got shape {tuple(ids.shape)}.")
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt {index}: prompt_token_ids must be a list of ints, got {ids!r:.80}.")
    if set(map(type, ids)) == {int}:
        # The usual case, checked at C speed: the per-id loop below costs ~1.5 us an id, 0.8 s of
        # host time for a 256-request, 2k-token-prompt batch (docs/perf_notes.md row 27).
        return list(ids)
    ids = [as_python(t) for t in ids]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"prompt {index}: token ids must be ints, got {t!r:.40} ({type(t).__name__}).")
    return ids
