"""generate, chat and stream with a real model: python example.py [path or hub id]"""
import sys

from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import RequestOutputKind


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B"
    llm = LLM(model, max_model_len=4096)
    params = SamplingParams(temperature=0.6, max_tokens=256)

    outputs = llm.generate(["Introduce yourself in one sentence.", "List all prime numbers below 30."], params)
    for out in outputs:
        print(f"\nPrompt: {out.prompt!r}\nCompletion: {out.outputs[0].text!r}")

    conversation = [{"role": "user", "content": "What is paged attention, in two sentences?"}]
    reply = llm.chat(conversation, params, chat_template_kwargs={"enable_thinking": False})[0]
    print(f"\nChat reply: {reply.outputs[0].text!r}")

    # Streaming, as with vLLM's LLMEngine: each step() returns the text that is new since the last.
    engine = llm.llm_engine
    engine.add_request("story", "Once upon a time,", SamplingParams(temperature=0.6, max_tokens=64,
                                                                    output_kind=RequestOutputKind.DELTA))
    print("\nStreamed: Once upon a time,", end="")
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.outputs[0].text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
