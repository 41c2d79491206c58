"""bench.py with the garbage collector's time and collections by generation, and the tracked objects
left, reported after every generate (bench's warm-ups and each timed run): whether a run's host time
goes to the collector (a developer tool, not a test; docs/perf_notes.md rows 94-95 and Next 13).

    PYTHONPATH=. python3 tests/gc_probe.py --logprobs 20 --repeat 3 2>&1 | grep -E "^generate|^Total:"
"""
import gc
import runpy
import sys
import time

from nanovllm.llm import LLM

seconds, collections, started = [0.0] * 3, [0] * 3, [0.0]


def on_collection(phase: str, info: dict):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        seconds[info["generation"]] += time.perf_counter() - started[0]
        collections[info["generation"]] += 1


def reported(generate):
    def wrapper(self, *args, **kwargs):
        seconds[:], collections[:] = [0.0] * 3, [0] * 3
        start = time.perf_counter()
        outputs = generate(self, *args, **kwargs)
        print(f"generate {time.perf_counter() - start:.2f} s; collector s by generation "
              f"{[round(s, 3) for s in seconds]}, collections {collections}; tracked objects {len(gc.get_objects())}",
              flush=True)
        return outputs
    return wrapper


if __name__ == "__main__":
    gc.callbacks.append(on_collection)
    LLM.generate = reported(LLM.generate)
    sys.argv = ["bench.py"] + sys.argv[1:]
    runpy.run_path("bench.py", run_name="__main__")
