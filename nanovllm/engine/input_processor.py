"""InputProcessor: turns what a caller gives (vLLM's prompt forms, SamplingParams) into checked
token-id requests before any of them reaches the scheduler: tokenizing, truncating, and the
checks that make a request that could never run a ValueError (vLLM's InputProcessor)."""
from nanovllm.config import Config
from nanovllm.engine.structured_output import GrammarCompiler
from nanovllm.inputs import Prompt, Tokenization, parse_prompts
from nanovllm.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, config: Config, tokenizer, kv_capacity: int):
        """kv_capacity: the tokens the whole KV cache holds."""
        self.config = config
        self.kv_capacity = kv_capacity
        self.set_tokenizer(tokenizer)

    def set_tokenizer(self, tokenizer):
        self.tokenizer = tokenizer
        # structured outputs' grammars are compiled against the tokenizer's vocabulary
        self.grammars = GrammarCompiler(tokenizer, self.config.hf_config.vocab_size,
                                        self.config.structured_outputs_config)

    def encode(self, index: int, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompt {index} is a string, but the engine has no tokenizer "
                             f"(skip_tokenizer_init=True); pass {{'prompt_token_ids': [...]}} instead.")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def parse_prompts(self, prompts, tokenization_kwargs: dict | None = None) -> list[Prompt]:
        """Any of vLLM's prompt forms (inputs.py) -> Prompts, tokenized and truncated as
        tokenization_kwargs say (inputs.Tokenization)."""
        tokenization = Tokenization.from_kwargs(tokenization_kwargs, self.config.max_model_len,
                                                add_special_tokens=True)
        parsed = parse_prompts(prompts, lambda i, text: self.encode(i, text, tokenization.add_special_tokens))
        return [p.cut(tokenization.kept(len(p.token_ids), self.tokenizer)) for p in parsed]

    def check_request(self, index: int, prompt: Prompt, params: SamplingParams) -> Prompt:
        """The prompt as it will run (truncated to params.truncate_prompt_tokens); ValueError if
        the request could never run. Changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params[{index}] must be a SamplingParams, got {type(params).__name__}.")
        keep = params.truncate_prompt_tokens
        if keep is not None:   # the prompt's last tokens, as vLLM truncated by this field
            max_model_len = self.config.max_model_len
            if keep > max_model_len:
                raise ValueError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                                 f"({max_model_len}). Please, select a smaller truncation size.")
            keep = max_model_len if keep == -1 else keep
            prompt = prompt.cut(slice(max(len(prompt.token_ids) - keep, 0), len(prompt.token_ids)))
        self.validate_request(index, prompt.token_ids, params)
        self._check_embeds(index, prompt)
        if prompt.embeds is not None and params.prompt_logprobs is not None:
            raise ValueError(f"prompt {index}: prompt_logprobs needs the prompt's token ids, which a prompt given as "
                             f"prompt_embeds does not have.")
        return prompt

    def _check_embeds(self, index: int, prompt: Prompt):
        """ValueError for an EmbedsPrompt the engine cannot take (inputs.py)."""
        if prompt.embeds is None:
            return
        if not self.config.enable_prompt_embeds:   # (vLLM's words, its flag by our name)
            raise ValueError("You must set `enable_prompt_embeds=True` to input `prompt_embeds`.")
        hidden_size = self.config.hf_config.hidden_size
        if prompt.embeds.values.shape[1] != hidden_size:
            raise ValueError(f"prompt {index}: prompt_embeds has {prompt.embeds.values.shape[1]} features a row, "
                             f"the model's hidden_size is {hidden_size}.")

    def validate_pooling_request(self, index: int, prompt: Prompt):
        """A pooling engine's request (no output tokens): ValueError if it could never run."""
        prompt_token_ids = prompt.token_ids
        self._check_prompt(index, prompt_token_ids)
        self._check_embeds(index, prompt)
        if len(prompt_token_ids) > self.kv_capacity:
            raise ValueError(f"prompt {index} (length {len(prompt_token_ids)}) needs more KV cache than the whole "
                             f"cache holds ({self.kv_capacity} tokens).")

    def _check_prompt(self, index: int, prompt_token_ids: list[int]):
        """ValueError for an empty prompt, an unknown token id, or more tokens than max_model_len."""
        cfg = self.config
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError(f"prompt {index} is empty.")
        vocab_size = cfg.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index}: token id {bad[0]!r} is out of vocabulary "
                             f"(vocab_size={vocab_size}).")
        if n > cfg.max_model_len:
            raise ValueError(f"prompt {index} (length {n}) is longer than the maximum model "
                             f"length of {cfg.max_model_len}.")

    def validate_request(self, index: int, prompt_token_ids: list[int], params: SamplingParams):
        """Raise ValueError if this request could never run. Changes nothing."""
        cfg = self.config
        self._check_prompt(index, prompt_token_ids)
        n = len(prompt_token_ids)
        vocab_size = cfg.hf_config.vocab_size
        if n == cfg.max_model_len:   # (vLLM's check: no room left for an output token)
            raise ValueError(f"prompt {index} (length {n}) plus the number of requested output tokens "
                             f"(at least 1) is longer than the maximum model length of {cfg.max_model_len}.")
        max_len = min(n + (params.max_tokens or cfg.max_model_len), cfg.max_model_len)
        if max_len > self.kv_capacity:
            raise ValueError(f"prompt {index} (length {n}) with max_tokens={params.max_tokens} needs "
                             f"up to {max_len} tokens of KV cache, more than the whole cache holds "
                             f"({self.kv_capacity} tokens); lower max_tokens or max_model_len.")
        params = params.with_vocab_size(vocab_size)
        if params.logprobs is not None and params.logprobs > cfg.logprobs_cap:
            raise ValueError(f"Requested sample logprobs of {params.logprobs}, which is greater "
                             f"than max allowed: {cfg.logprobs_cap}.")
        if params.thinking_token_budget is not None and cfg.reasoning_markers is None:
            raise ValueError("thinking_token_budget is set but reasoning_config is not configured. Please set "
                             "reasoning_parser and/or reasoning_config to use thinking_token_budget.")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)   # a ValueError if it does not (cached if it does)
        for processor in cfg.logits_processors or ():   # (a ValueError for options it refuses)
            getattr(processor, "validate_params", lambda params: None)(params)
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer, but the engine has none (skip_tokenizer_init=True).")
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids),
                          ("logprob_token_ids", params.logprob_token_ids)):
            bad = [t for t in ids or () if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} has out-of-vocabulary token id {bad[0]} (vocab_size={vocab_size}).")
        if params.prompt_logprobs is not None and params.prompt_logprobs > cfg.logprobs_cap:
            raise ValueError(f"Requested prompt logprobs of {params.prompt_logprobs}, which is greater "
                             f"than max allowed: {cfg.logprobs_cap}.")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids as text starts with it, and (as vLLM does) as a later word after a
        space, when that spelling is as many tokens but starts with another one."""
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)
        sequences = []
        for word in words:
            alone, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
            sequences.append(alone)
            if len(spaced) == len(alone) and spaced[0] != alone[0]:
                sequences.append(spaced)
        return sequences
