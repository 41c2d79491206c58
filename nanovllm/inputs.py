"""The prompt forms LLM.generate takes, by vLLM's names (vllm.inputs): a string, a list of token
ids, TextPrompt {"prompt": ...}, TokensPrompt {"prompt_token_ids": [...]} or EmbedsPrompt
{"prompt_embeds": tensor}, or a list of these. The dict types are plain dicts at run time; they
exist so that vLLM scripts import them.

Any dict may carry a "cache_salt" string: its blocks then hit in the prefix cache only for
requests with the same salt (vLLM's isolation of tenants sharing one engine).

An EmbedsPrompt (with LLM(enable_prompt_embeds=True)) gives the model's input vectors instead of
token ids: a [prompt length, hidden size] tensor (or [1, length, hidden size]) that takes the
place of the token embedding's output. Its token ids are unknown: the request reports zeros as
its prompt_token_ids, as vLLM does. vLLM's mixed form also gives "prompt_token_ids" and
"prompt_is_token_ids" (a bool a position): a position marked True takes its token's embedding,
one marked False the tensor's row (the tensor has a row for every position either way)."""
import numbers
from typing import Any, Callable, NamedTuple, TypedDict

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


class _Embeds(TypedDict):
    prompt_embeds: Any   # a torch.Tensor


class EmbedsPrompt(_Embeds, total=False):
    prompt: str
    prompt_token_ids: list[int]       # the mixed form: ids for the positions prompt_is_token_ids marks
    prompt_is_token_ids: list[bool]
    cache_salt: str


class PromptEmbeds:
    """A prompt's input vectors: `values` [length, hidden size] on the CPU, as given, and which
    positions take them (`is_token_ids` False; None: every position)."""

    def __init__(self, values, is_token_ids: list[bool] | None = None):
        self.values, self.is_token_ids = values, is_token_ids

    def __len__(self) -> int:
        return len(self.values)

    def positions(self, start: int, end: int) -> list[int]:
        """The positions in [start, end) that take a vector."""
        end = min(end, len(self.values))
        if self.is_token_ids is None:
            return list(range(start, end))
        return [p for p in range(start, end) if not self.is_token_ids[p]]

    def key(self, start: int, end: int) -> bytes:
        """What positions [start, end) are, for the prefix cache's block hash (their ids are placeholders):
        the vectors of the positions that take one, as float32 (exact for every float dtype)."""
        positions = self.positions(start, end)
        return self.values[positions].float().numpy().tobytes() + bytes(str(positions), "ascii")

    def cut(self, kept: slice) -> "PromptEmbeds":
        return PromptEmbeds(self.values[kept], None if self.is_token_ids is None else self.is_token_ids[kept])


class Prompt(NamedTuple):
    """A parsed prompt (embeds: an EmbedsPrompt's vectors; its token_ids are then placeholders where
    the vectors go)."""
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None
    embeds: PromptEmbeds | None = None

    def cut(self, kept: slice) -> "Prompt":
        """The prompt's tokens at kept (a slice with its start and stop given), and their vectors."""
        embeds = None if self.embeds is None else self.embeds.cut(kept)
        return self._replace(token_ids=self.token_ids[kept], embeds=embeds)


PromptType = str | list[int] | TextPrompt | TokensPrompt | EmbedsPrompt

# Keys of vLLM's prompt dicts that ask for something nanovllm does not do: refused, not ignored
# (but for a value of None).
UNSUPPORTED_KEYS = {"multi_modal_data": "multimodal inputs (nanovllm runs text-only models)",
                    "mm_processor_kwargs": "multimodal inputs (nanovllm runs text-only models)",
                    "multi_modal_uuids": "multimodal inputs (nanovllm runs text-only models)",
                    "token_type_ids": "token_type_ids (pooling models)",
                    "encoder_prompt": "encoder-decoder prompts (nanovllm runs decoder-only models)",
                    "decoder_prompt": "encoder-decoder prompts (nanovllm runs decoder-only models)"}
KEYS = ("prompt", "prompt_token_ids", "cache_salt", "prompt_embeds", "prompt_is_token_ids")


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
            for key, value in p.items():
                if key in UNSUPPORTED_KEYS:
                    if value is not None:   # (None: vLLM's "none given")
                        raise ValueError(f"prompt {i}: {key!r} is not supported: {UNSUPPORTED_KEYS[key]}.")
                elif key not in KEYS:
                    raise ValueError(f"prompt {i}: unknown key {key!r}; a prompt dict has 'prompt', "
                                     f"'prompt_token_ids' or 'prompt_embeds', and may have 'cache_salt'.")
            salt = p.get("cache_salt")
            if salt is not None and not (isinstance(salt, str) and salt):
                raise ValueError(f"prompt {i}: cache_salt must be a non-empty string, got {salt!r:.80}.")
        if isinstance(p, dict) and p.get("prompt_embeds") is not None:
            parsed.append(_embeds_prompt(i, p))
        elif isinstance(p, dict) and "prompt_token_ids" in p:
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


def _embeds_prompt(index: int, p: dict) -> Prompt:
    """An EmbedsPrompt as a Prompt: its vectors on the CPU, [length, hidden size] (vLLM's squeeze of a
    batch of one), with placeholder ids (zeros, or the mixed form's ids)."""
    values = p["prompt_embeds"]
    if not (_is_array(values) and hasattr(values, "is_floating_point")):
        raise ValueError(f"prompt {index}: prompt_embeds must be a torch.Tensor, got {type(values).__name__}.")
    if values.ndim == 3 and values.shape[0] == 1:
        values = values[0]
    if values.ndim != 2:
        raise ValueError(f"prompt {index}: prompt_embeds must be of shape (seq_len, hidden_size), got "
                         f"{tuple(values.shape)}.")
    if not values.is_floating_point():
        raise ValueError(f"prompt {index}: prompt_embeds must be floating point, got {values.dtype}.")
    values = values.detach().cpu().contiguous()
    ids, mask = p.get("prompt_token_ids"), p.get("prompt_is_token_ids")
    if (ids is None) != (mask is None):
        raise ValueError(f"prompt {index}: prompt_token_ids and prompt_is_token_ids go together with prompt_embeds "
                         f"(vLLM's mixed form); give both or neither.")
    if ids is None:
        return Prompt(p.get("prompt"), [0] * len(values), p.get("cache_salt"), PromptEmbeds(values))
    ids = _token_ids(index, ids)
    if not isinstance(mask, (list, tuple)) or not all(isinstance(flag, bool) for flag in mask):
        raise ValueError(f"prompt {index}: prompt_is_token_ids must be a list of bools, got {mask!r:.80}.")
    if not len(ids) == len(mask) == len(values):
        raise ValueError(f"prompt {index}: prompt_token_ids ({len(ids)}), prompt_is_token_ids ({len(mask)}) and "
                         f"prompt_embeds ({len(values)} rows) must have one entry a position.")
    return Prompt(p.get("prompt"), ids, p.get("cache_salt"), PromptEmbeds(values, list(mask)))


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


class Tokenization(NamedTuple):
    """vLLM's `tokenization_kwargs` of generate() and chat(): whether encoding a text prompt adds
    the tokenizer's special tokens (a BOS, for models that have one), and where a prompt is cut."""
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None   # tokens to keep; None: all
    truncation_side: str | None = None          # "left" keeps the last tokens, "right" the first;
                                                # None: the tokenizer's side ("right" without one)

    @classmethod
    def from_kwargs(cls, kwargs: dict | None, max_model_len: int, add_special_tokens: bool) -> "Tokenization":
        """The keys vLLM takes: truncate_prompt_tokens (-1: max_model_len), truncation_side,
        add_special_tokens, and the HF pair truncation=True / "longest_first" with max_length
        (default max_model_len). Any other key is a ValueError (vLLM logs and ignores them)."""
        kwargs = kwargs or {}
        unknown = sorted(set(kwargs) - {"truncate_prompt_tokens", "truncation_side", "add_special_tokens",
                                        "truncation", "max_length"})
        if unknown:
            raise ValueError(f"tokenization_kwargs: {', '.join(map(repr, unknown))} not supported; nanovllm takes "
                             f"truncate_prompt_tokens, truncation_side, add_special_tokens, truncation, max_length.")
        add_special_tokens = kwargs.get("add_special_tokens", add_special_tokens)
        if not isinstance(add_special_tokens, bool):
            raise ValueError(f"tokenization_kwargs: add_special_tokens must be a bool, got {add_special_tokens!r}.")
        keep = kwargs.get("truncate_prompt_tokens")
        max_length = kwargs.get("max_length", max_model_len)
        truncation = kwargs.get("truncation")
        if truncation in (True, "longest_first"):
            keep = max_length
        elif truncation == "do_not_truncate":
            keep = None
        elif truncation not in (None, False):
            raise ValueError(f"tokenization_kwargs: truncation must be True, False, 'longest_first' or "
                             f"'do_not_truncate', got {truncation!r}.")
        if keep is not None:
            if isinstance(keep, bool) or not isinstance(keep, int) or keep < -1:
                raise ValueError(f"tokenization_kwargs: the tokens to keep (truncate_prompt_tokens or max_length) "
                                 f"must be an int >= 0, or -1 for max_model_len; got {keep!r}.")
            if keep > max_model_len:
                raise ValueError(f"tokenization_kwargs: truncate_prompt_tokens={keep} cannot be greater than "
                                 f"max_model_len={max_model_len}. Please request a smaller truncation size.")
            keep = max_model_len if keep == -1 else keep
        side = kwargs.get("truncation_side")
        if side not in (None, "left", "right"):
            raise ValueError(f"tokenization_kwargs: truncation_side must be 'left' or 'right', got {side!r}.")
        return cls(add_special_tokens, keep, side)

    def truncate(self, token_ids: list[int], tokenizer) -> list[int]:
        """token_ids cut to truncate_prompt_tokens, on truncation_side (or the tokenizer's)."""
        return token_ids[self.kept(len(token_ids), tokenizer)]

    def kept(self, length: int, tokenizer) -> slice:
        """The positions of a prompt of length tokens that truncate_prompt_tokens keeps, on truncation_side (or
        the tokenizer's)."""
        keep = self.truncate_prompt_tokens
        if keep is None or keep >= length:
            return slice(0, length)
        side = self.truncation_side or getattr(tokenizer, "truncation_side", None) or "right"
        return slice(length - keep, length) if side == "left" else slice(0, keep)


def one_per_prompt(params, kind: type, name: str, num_prompts: int):
    """A call's params (SamplingParams or PoolingParams, kind): one for every prompt, or a list of one a
    prompt -> one a prompt. Anything else is a ValueError naming the argument (name)."""
    if isinstance(params, kind):
        return [params] * num_prompts
    if not isinstance(params, (list, tuple)):
        hint = "; beam search is LLM.beam_search" if type(params).__name__ == "BeamSearchParams" else ""
        raise ValueError(f"{name} must be a {kind.__name__} or a list of them, got {type(params).__name__}{hint}.")
    if len(params) != num_prompts:
        raise ValueError(f"{name} has {len(params)} entries but there are {num_prompts} prompts; pass one "
                         f"{kind.__name__} or one per prompt.")
    return params
