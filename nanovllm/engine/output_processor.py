"""OutputProcessor: appends sampled tokens to sequences, detokenizes incrementally and decides
when each sequence stops (EOS, stop token, stop string, max_tokens, max_model_len, a repetition)."""
from itertools import count, repeat

from nanovllm.engine.sequence import Sequence
from nanovllm.logprobs import FlatLogprobs, Logprob

# Prompt tokens kept as left context when detokenizing the first output tokens.
DETOKENIZE_CONTEXT = 5


class TokenTexts(dict):
    """token id -> its text alone (a logprob entry's decoded_token), decoded on first use: a step with
    logprobs=20 has thousands of entries, and a hit is one dict lookup instead of a tokenizer call
    (docs/perf_notes.md row 98). At most one short string per vocabulary id."""

    def __init__(self, decode):
        super().__init__()
        self.decode = decode

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.decode([token_id])
        return text


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    @property
    def tokenizer(self):
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer):
        """Also forgets the texts the previous tokenizer gave."""
        self._tokenizer = tokenizer
        self.token_texts = TokenTexts(self._decode)
        # A fast tokenizer that cleans up no spaces gets the same text from its Rust tokenizer directly,
        # without transformers' per-call work around it (most of the ~8 us a call costs)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._rust_decode = (backend.decode if backend is not None
                             and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False else None)

    def append(self, seq: Sequence, token_id: int, logprob=None, rank=None, top=None):
        """Append one sampled token; sets seq.finish_reason when seq is done.

        logprob, rank: of the sampled token; top: (token ids, logprobs) best first, or (token ids,
        logprobs, ranks) (the request's logprob_token_ids), lists, or None."""
        seq.append_token(token_id)
        sp = seq.sampling_params
        if seq.logprobs is not None:
            self._record(seq.logprobs, token_id, logprob, rank, top, sp.num_logprobs, sp.detokenize)
            seq.cumulative_logprob += logprob

        may_stop = seq.num_output_tokens >= sp.min_tokens
        if may_stop and not sp.ignore_eos and token_id in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif may_stop and token_id in sp.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token_id
        has_text = self._tokenizer is not None and sp.detokenize
        text_of_token = seq.finish_reason is None or sp.include_stop_str_in_output   # a stop token's is left out
        # Detokenized each step only where the text is read before the end; else once, at the end
        each_step = has_text and (seq.streamed or bool(sp.stop_strings))
        if each_step and text_of_token:
            delta = self._detokenize(seq)
            if may_stop and seq.finish_reason is None and delta:
                self._check_stop_strings(seq, len(delta))
        if seq.finish_reason is None and seq.reached_length_limit(self.max_model_len):
            seq.finish_reason = "length"
        if (seq.finish_reason is None and may_stop and sp.repetition_detection is not None
                and sp.repetition_detection.repeats(seq.output_token_ids)):
            seq.finish_reason, seq.stop_reason = "repetition", "repetition_detected"
        if has_text and not each_step and seq.finish_reason is not None:
            self._detokenize_at_end(seq, len(seq.token_ids) - (not text_of_token))

    def append_prompt_logprobs(self, chunk):
        """chunk: a PromptLogprobsChunk; its tokens follow the ones already scored. A loglikelihood
        run's step scores ~16k prompt tokens, so the dicts' loop is written out here rather than
        one _record call a position (docs/perf_notes.md row 104)."""
        seq, sp = chunk.seq, chunk.seq.sampling_params
        assert chunk.first == len(seq.prompt_logprobs)
        tokens = seq.token_ids[chunk.first:chunk.first + len(chunk.logprobs)]
        no_top = repeat(())
        top_ids, top_logprobs = chunk.top_ids or no_top, chunk.top_logprobs or no_top
        if type(seq.prompt_logprobs) is FlatLogprobs:
            for token_id, logprob, rank, ids, values in zip(tokens, chunk.logprobs, chunk.ranks, top_ids, top_logprobs):
                self._record(seq.prompt_logprobs, token_id, logprob, rank, (ids, values), sp.prompt_logprobs,
                             sp.detokenize)
            return
        texts = self.token_texts if sp.detokenize and self._tokenizer is not None else None
        ranked = range(1, sp.prompt_logprobs + 1)
        entries = seq.prompt_logprobs
        for token_id, logprob, rank, ids, values in zip(tokens, chunk.logprobs, chunk.ranks, top_ids, top_logprobs):
            entry = {token_id: Logprob(logprob, rank, None if texts is None else texts[token_id])}
            for r, tid, value in zip(ranked, ids, values):
                if tid not in entry:
                    entry[tid] = Logprob(value, r, None if texts is None else texts[tid])
            entries.append(entry)

    def _record(self, logprobs, token_id: int, logprob: float, rank: int, top, num_top: int, detokenize: bool):
        """Append to logprobs (a list of dicts or FlatLogprobs) one position: the token itself and
        the first num_top of top ((ids, logprobs), ranked by position, or (ids, logprobs, ranks)).
        A step's positions are thousands of entries (256 rows x 21 with logprobs=20), so the
        loops are kept plain."""
        decode, texts = detokenize and self._tokenizer is not None, self.token_texts
        if type(logprobs) is FlatLogprobs:
            ids, values, ranks = [token_id], [logprob], [rank]
            if top:
                top_ids, top_values, *ranked = top
                for tid, lp, r in zip(top_ids[:num_top], top_values[:num_top], ranked[0] if ranked else count(1)):
                    if tid != token_id:
                        ids.append(tid)
                        values.append(lp)
                        ranks.append(r)
            logprobs.append_position(ids, values, ranks, [texts[t] for t in ids] if decode else [None] * len(ids))
            return
        entry = {token_id: Logprob(logprob, rank, texts[token_id] if decode else None)}
        if top:
            top_ids, top_values, *ranked = top
            for tid, lp, r in zip(top_ids[:num_top], top_values[:num_top], ranked[0] if ranked else count(1)):
                if tid not in entry:
                    entry[tid] = Logprob(lp, r, texts[tid] if decode else None)
        logprobs.append(entry)

    def _detokenize(self, seq: Sequence, end: int | None = None) -> str:
        """Add the text of the newest token(s), up to token_ids[end] (None: all), to seq.output_text and
        return it.

        Decodes only a short window: token_ids[prefix_offset:read_offset] was decoded before;
        the new text is what decoding token_ids[prefix_offset:end] adds to it. Held back while it
        ends in an incomplete UTF-8 character."""
        if seq.read_offset == 0:
            seq.prefix_offset = max(seq.num_prompt_tokens - DETOKENIZE_CONTEXT, 0)
            seq.read_offset = seq.num_prompt_tokens
        params = seq.sampling_params
        skip, spaces = params.skip_special_tokens, params.spaces_between_special_tokens
        ids = seq.token_ids
        end = len(ids) if end is None else end
        prefix_text = self._decode(ids[seq.prefix_offset:seq.read_offset], skip, spaces)
        new_text = self._decode(ids[seq.prefix_offset:end], skip, spaces)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        seq.output_text += delta
        seq.prefix_offset, seq.read_offset = seq.read_offset, end
        return delta

    def _detokenize_at_end(self, seq: Sequence, end: int):
        """A finished sequence's text, up to token_ids[end], as _detokenize after each token would have
        made it: the whole window in one go gives that text (docs/perf_notes.md row 101) wherever decoding
        more tokens only adds text after the old (byte-level BPE, SentencePiece; a tokenizer that cleans up
        spaces before punctuation may differ), unless the window ends in an incomplete character, which the
        steps would have held back from where it began."""
        if not self._detokenize(seq, end):
            for upto in range(seq.read_offset + 1, end + 1):
                self._detokenize(seq, upto)

    def _decode(self, ids: list[int], skip_special_tokens: bool = False,
                spaces_between_special_tokens: bool = True) -> str:
        """tokenizer.decode(ids, ...), two calls per output token."""
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                      spaces_between_special_tokens=spaces_between_special_tokens)

    @staticmethod
    def _check_stop_strings(seq: Sequence, num_new_chars: int):
        """Find a stop string that ends in the newest text (it may start in earlier text)."""
        text = seq.output_text
        for stop in seq.sampling_params.stop_strings:
            index = text.find(stop, max(len(text) - num_new_chars - len(stop) + 1, 0))
            if index != -1:
                keep = len(stop) if seq.sampling_params.include_stop_str_in_output else 0
                seq.output_text = text[:index + keep]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
