"""OutputProcessor: appends sampled tokens to sequences, detokenizes incrementally and decides
when each sequence stops (EOS, stop token, stop string, max_tokens, max_model_len, a repetition, a
token its grammar refuses)."""
from itertools import repeat

import numpy as np

from nanovllm.engine.sequence import Sequence
from nanovllm.logger import init_logger
from nanovllm.logprobs import FlatLogprobs, Logprob

logger = init_logger(__name__)

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
            self._record(seq.logprobs, (token_id,), (logprob,), (rank,), (top,), sp.num_logprobs, self._texts(sp))
            seq.cumulative_logprob += logprob

        may_stop = seq.num_output_tokens >= sp.min_tokens
        if may_stop and not sp.ignore_eos and token_id in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif may_stop and token_id in sp.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token_id
        has_text = self._tokenizer is not None and sp.detokenize
        text_of_token = seq.finish_reason is None or sp.include_stop_str_in_output   # a stop token's is left out
        # Detokenized each step only where the text is read before the end; else once, at the end
        each_step = has_text and (seq.streamed or bool(sp.stop))
        if each_step and text_of_token:
            delta = self._detokenize(seq)
            if may_stop and seq.finish_reason is None and delta:
                self._check_stop_strings(seq, len(delta))
        if seq.finish_reason is None and seq.reached_length_limit(self.max_model_len):
            seq.finish_reason = "length"
        if (seq.finish_reason is None and may_stop and sp.repetition_detection is not None
                and sp.repetition_detection.repeats(seq.output_token_ids)):
            seq.finish_reason, seq.stop_reason = "repetition", "repetition_detected"
        if seq.finish_reason is None and seq.grammar is not None:
            seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens)
            if seq.grammar.broken:   # (vLLM's: the completion ends, with the refused token)
                logger.warning(f"grammar rejected token {token_id} for request {seq.request_id}; terminating "
                               f"the completion (finish_reason 'error').")
                seq.finish_reason = "error"
        if has_text and not each_step and seq.finish_reason is not None:
            self._detokenize_at_end(seq, len(seq.token_ids) - (not text_of_token))

    def append_prompt_logprobs(self, chunk):
        """chunk: a PromptLogprobsChunk; its tokens follow the ones already scored (a loglikelihood run's
        step scores ~16k prompt tokens: one _record call a chunk for dicts, whole columns for FlatLogprobs)."""
        seq, sp = chunk.seq, chunk.seq.sampling_params
        assert chunk.first == len(seq.prompt_logprobs)
        top = chunk.top_ids is not None and sp.prompt_logprobs > 0
        if type(seq.prompt_logprobs) is FlatLogprobs:
            self._record_columns(seq.prompt_logprobs, chunk, sp.prompt_logprobs if top else 0, self._texts(sp))
            return
        tops = zip(chunk.top_ids.tolist(), chunk.top_logprobs.tolist()) if top else repeat(())
        self._record(seq.prompt_logprobs, chunk.token_ids.tolist(), chunk.logprobs.tolist(), chunk.ranks.tolist(),
                     tops, sp.prompt_logprobs, self._texts(sp))

    @staticmethod
    def _record_columns(flat: FlatLogprobs, chunk, num_top: int, texts: TokenTexts | None):
        """As _record, for a chunk's prompt tokens into FlatLogprobs: whole columns at once (a position's
        entries are its token, then the first num_top of its top that are not that token)."""
        ids, values, ranks = chunk.token_ids[:, None], chunk.logprobs[:, None], chunk.ranks[:, None]
        counts = np.ones(len(ids), np.int64)
        if num_top:
            top_ids = chunk.top_ids[:, :num_top]
            keep = np.concatenate([np.ones_like(ids, bool), top_ids != ids], 1)
            ids = np.concatenate([ids, top_ids], 1)[keep]
            values = np.concatenate([values, chunk.top_logprobs[:, :num_top]], 1)[keep]
            ranks = np.concatenate([ranks, np.broadcast_to(np.arange(1, num_top + 1), top_ids.shape)], 1)[keep]
            counts = keep.sum(1)
        ends = np.cumsum(counts) + len(flat.token_ids)
        new_ids = ids.ravel().tolist()
        flat.start_indices += (ends - counts).tolist()
        flat.end_indices += ends.tolist()
        flat.token_ids += new_ids
        flat.logprobs += values.ravel().tolist()
        flat.ranks += ranks.ravel().tolist()
        flat.decoded_tokens += [None] * len(new_ids) if texts is None else map(texts.__getitem__, new_ids)

    def _texts(self, sp) -> TokenTexts | None:
        """The table of single-token texts, or None where the request's entries carry no text."""
        return self.token_texts if sp.detokenize and self._tokenizer is not None else None

    @staticmethod
    def _record(logprobs, token_ids, values, ranks, tops, num_top: int, texts: TokenTexts | None):
        """Append to logprobs (a list of dicts or FlatLogprobs) one position a token: token_ids[i] with
        values[i] and ranks[i], then the first num_top of tops[i] ((ids, logprobs), ranked by position,
        or (ids, logprobs, ranks)) that are not that token; texts: their decoded_token, or None.
        A step's positions are thousands of entries (256 rows x 21 with logprobs=20; a scoring step's
        16k prompt tokens), so the loops are kept plain."""
        positions = range(1, num_top + 1)      # the ranks of a top ranked by position
        if type(logprobs) is FlatLogprobs:     # straight into its columns: no lists a position
            starts, ends, ids, lps, rks = (logprobs.start_indices, logprobs.end_indices, logprobs.token_ids,
                                           logprobs.logprobs, logprobs.ranks)
            first = len(ids)
            for token_id, logprob, rank, top in zip(token_ids, values, ranks, tops):
                starts.append(len(ids))
                ids.append(token_id)
                lps.append(logprob)
                rks.append(rank)
                if top:
                    for r, tid, lp in zip(top[2][:num_top] if len(top) == 3 else positions, top[0], top[1]):
                        if tid != token_id:
                            ids.append(tid)
                            lps.append(lp)
                            rks.append(r)
                ends.append(len(ids))
            new_ids = ids[first:]
            logprobs.decoded_tokens += [None] * len(new_ids) if texts is None else map(texts.__getitem__, new_ids)
            return
        for token_id, logprob, rank, top in zip(token_ids, values, ranks, tops):
            entry = {token_id: Logprob(logprob, rank, None if texts is None else texts[token_id])}
            if top:
                for r, tid, lp in zip(top[2][:num_top] if len(top) == 3 else positions, top[0], top[1]):
                    if tid not in entry:
                        entry[tid] = Logprob(lp, r, None if texts is None else texts[tid])
            logprobs.append(entry)

    def _detokenize(self, seq: Sequence, end: int | None = None) -> str:
        """Add the text of the newest token(s), up to token_ids[end] (None: all), to seq.output_text and
        return it.

        Decodes only a short window: token_ids[prefix_offset:read_offset] was decoded before;
        the new text is what decoding token_ids[prefix_offset:end] adds to it. Held back while it
        ends in an incomplete UTF-8 character."""
        if seq.read_offset == 0:   # (no context from a prompt given as vectors: its ids are placeholders)
            context = DETOKENIZE_CONTEXT if seq.prompt_embeds is None else 0
            seq.prefix_offset = max(seq.num_prompt_tokens - context, 0)
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
        for stop in seq.sampling_params.stop:
            index = text.find(stop, max(len(text) - num_new_chars - len(stop) + 1, 0))
            if index != -1:
                keep = len(stop) if seq.sampling_params.include_stop_str_in_output else 0
                seq.output_text = text[:index + keep]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
