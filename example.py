"""generate and chat with a real model: python example.py [path or hub id]"""
import sys

from nanovllm import LLM, SamplingParams


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


if __name__ == "__main__":
    main()
