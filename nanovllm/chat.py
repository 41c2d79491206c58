"""LLM.chat's rendering: conversations through a chat template into token-id prompts, with
vLLM's options (its own template, OpenAI-style content parts, tools, continuing a message)."""


def render_chat(tokenizer, messages, chat_template: str | None, content_format: str, add_generation_prompt: bool,
                continue_final_message: bool, tools: list[dict] | None, chat_template_kwargs: dict | None,
                add_special_tokens: bool) -> list[dict]:
    """One conversation ([{"role": ..., "content": ...}, ...]) or a list of them -> one prompt dict
    each, {"prompt": the rendered text, "prompt_token_ids": its tokens}. chat_template: None for
    the tokenizer's. A content given as OpenAI-style parts ([{"type": "text", "text": ...}, ...])
    reaches the template as one string, the texts joined by newlines (content_format "auto" or
    "string"), or as the list itself ("openai")."""
    if tokenizer is None:
        raise ValueError("chat() needs a tokenizer, but the engine has none (skip_tokenizer_init=True).")
    if add_generation_prompt and continue_final_message:
        raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if content_format not in ("auto", "string", "openai"):
        raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', "
                         f"got {content_format!r}.")
    one = isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)
    conversations = [messages] if one else messages
    _check_conversations(conversations)
    if content_format != "openai":
        conversations = [[_with_string_content(m) for m in conversation] for conversation in conversations]
    prompts = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tools=tools,
                                             **(chat_template_kwargs or {}))
        token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        prompts.append({"prompt": text, "prompt_token_ids": token_ids})
    return prompts


def _check_conversations(conversations):
    """Each conversation a list of messages, each a dict with a string "role"."""
    if not isinstance(conversations, list) or not all(isinstance(c, list) for c in conversations):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, or a list of such "
                         f"lists; got {conversations!r:.80}.")
    for conversation in conversations:
        for message in conversation:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"each message must be a dict with a 'role' string, got {message!r:.80}.")


def _with_string_content(message: dict) -> dict:
    """message with its content parts (OpenAI style) joined into one string; text parts only."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ValueError(f"message content part of type {kind!r} is not supported: nanovllm runs "
                             f"text-only models (parts of type 'text' only).")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}
