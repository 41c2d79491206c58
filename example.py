"""generate, chat and stream with a real model: python example.py [path or hub id]
An embedding model (e.g. Qwen/Qwen3-Embedding-0.6B, a sentence-transformers model) embeds and scores instead;
a classifier (a *ForSequenceClassification checkpoint, e.g. a reranker converted to one) ranks documents; a
reward model (e.g. Qwen/Qwen2.5-Math-PRM-7B) scores the steps of a solution."""
import sys

from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import RequestOutputKind


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B"
    llm = LLM(model, max_model_len=4096)
    if llm.llm_engine.get_supported_tasks() == ("token_classify",):
        return reward(llm)
    if llm.model_config.convert_type == "classify":
        return rerank(llm)
    if llm.model_config.runner_type == "pooling":
        return embed(llm)
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


def embed(llm):
    """An embedding model: one vector a text, and how alike a query is to each document."""
    documents = ["Paged attention keeps the KV cache in fixed-size blocks.", "Bananas are rich in potassium."]
    for out in llm.embed(documents):
        print(f"{len(out.outputs.embedding)} floats, first {out.outputs.embedding[:3]}")
    for document, out in zip(documents, llm.score("How does vLLM store keys and values?", documents)):
        print(f"score {out.outputs.score:.3f}: {document!r}")


def rerank(llm):
    """A classifier: with one label (a cross-encoder or reranker), how well each document answers a query;
    with several, each text's label probabilities."""
    query = "How does vLLM store keys and values?"
    documents = ["Paged attention keeps the KV cache in fixed-size blocks.", "Bananas are rich in potassium."]
    if llm.model_config.hf_config.num_labels == 1:
        for document, out in zip(documents, llm.score(query, documents)):
            print(f"score {out.outputs.score:.3f}: {document!r}")
    else:
        for document, out in zip(documents, llm.classify(documents)):
            print(f"probabilities {[round(p, 3) for p in out.outputs.probs]}: {document!r}")


def reward(llm):
    """A reward model: a process reward model's probability that each step of a solution is right (it reads the
    step tag that ends each step, "<extra_0>" for Qwen2.5-Math-PRM), an outcome reward model's score of the whole."""
    question = "A farm's ducks lay 16 eggs a day. It sells all but 3 at $2 each. How much does it make a day?"
    steps = ["16 - 3 = 13 eggs are sold.", "13 * 2 = 26.", "It makes $26 a day."]
    by_steps = llm.llm_engine.config.pooler_config.tok_pooling_type == "STEP"
    tag = llm.get_tokenizer().decode([llm.llm_engine.config.pooler_config.step_tag_id]) if by_steps else ""
    conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": tag.join(steps) + tag}]
    text = llm.get_tokenizer().apply_chat_template(conversation, tokenize=False)
    [out] = llm.encode(text, pooling_task="token_classify")
    if by_steps:
        print(f"P(step is right): {[round(p[1].item(), 3) for p in out.outputs.data]}")
    else:
        print(f"reward: {out.outputs.data[-1].item():.3f}")


if __name__ == "__main__":
    main()
