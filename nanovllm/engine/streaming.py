"""What vLLM's LLMEngine.step() returns: after each step, a RequestOutput for every request that
has new output, as its SamplingParams.output_kind asks.

- CUMULATIVE (the default): the completion so far.
- DELTA: only what is new since the request's previous output.
- FINAL_ONLY: one output, when the request finishes (what LLM.generate returns).

As in vLLM, a request with n > 1 completions streams each completion as its own RequestOutput
(outputs=[that completion]), and only the request's last such output says finished=True;
FINAL_ONLY gives all n together. While a completion may still end in a stop string that is not
to be included, its last len(longest stop string) - 1 characters are held back, so that a
streamed text never shows what the stop string later cuts.
"""
from dataclasses import replace

from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind


class OutputStreamer:
    def __init__(self):
        self.sent: dict[int, tuple[int, int]] = {}   # seq_id -> (output tokens, characters) sent so far

    def outputs(self, live, finished_requests, finished_outputs: list[RequestOutput],
                make_output) -> list[RequestOutput]:
        """live: the unfinished requests; finished_requests: those the step finished, whose
        final outputs are finished_outputs (in the same order); make_output(request, seqs) -> the
        RequestOutput of request's seqs so far (LLMEngine's)."""
        result = []
        for request in live:
            if request.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
                result += self._stream(request, make_output)
        for request, final in zip(finished_requests, finished_outputs):
            if request.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                result.append(final)
            else:
                result += self._stream(request, make_output)
            for seq in request.seqs:
                self.sent.pop(seq.seq_id, None)
        return result

    def forget(self, live):
        """Drop what was sent for sequences of requests no longer in live (aborted ones)."""
        if not self.sent:
            return
        alive = {seq.seq_id for request in live for seq in request.seqs}
        for seq_id in set(self.sent) - alive:
            del self.sent[seq_id]

    def _stream(self, request, make_output) -> list[RequestOutput]:
        delta = request.sampling_params.output_kind == RequestOutputKind.DELTA
        result = []
        for seq in request.seqs:
            num_tokens = seq.num_resolved_tokens - seq.num_prompt_tokens
            sent_tokens, sent_chars = self.sent.get(seq.seq_id, (0, 0))
            if num_tokens == sent_tokens:
                continue
            output = make_output(request, [seq])
            completion = output.outputs[0]
            visible = len(completion.text) - (0 if seq.is_finished else _held_back(seq.sampling_params))
            visible = max(visible, sent_chars)
            first = delta and seq.seq_id not in self.sent
            start_tokens, start_chars = (sent_tokens, sent_chars) if delta else (0, 0)
            completion = replace(
                completion, text=completion.text[start_chars:visible], token_ids=completion.token_ids[start_tokens:],
                logprobs=None if completion.logprobs is None else completion.logprobs[start_tokens:num_tokens])
            result.append(replace(output, outputs=[completion],
                                  prompt_logprobs=output.prompt_logprobs if not delta or first else None))
            self.sent[seq.seq_id] = (num_tokens, visible)
        # as vLLM's parent request: of completions ending together, only the last out reports the request finished
        result[:-1] = [replace(output, finished=False) for output in result[:-1]]
        return result


def _held_back(params) -> int:
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(stop) for stop in params.stop) - 1
