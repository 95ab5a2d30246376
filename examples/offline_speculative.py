# examples/offline_speculative.py — n-gram speculation (prompt lookup): the same greedy text, fewer steps on copy work
from pagedllm import LLM, SamplingParams

llm = LLM("SmolLM2-135M-Instruct",
          speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
text = "The quick brown fox jumps over the lazy dog. " * 3
outs = llm.chat([{"role": "user", "content": "Repeat exactly: " + text}],
                SamplingParams(temperature=0, max_tokens=40))
print(outs[0].outputs[0].text)
