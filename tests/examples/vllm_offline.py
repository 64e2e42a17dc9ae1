"""vLLM's offline-inference example (its documented API: ``TextPrompt`` / ``TokensPrompt`` dicts,
``max_tokens``, a ``stop`` list, ``tensor_parallel_size``, ``get_tokenizer``, ``Logprob`` objects)
with one change: the import line. ``python vllm_offline.py MODEL TP OUT`` (or under torchrun)
writes what the script saw to OUT (rank 0's) as JSON."""

import json
import os
import sys

from reshard import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams

model, tp, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(model=model, tensor_parallel_size=tp, max_model_len=128, seed=0)
tokenizer = llm.get_tokenizer()
prompts = [
    {"prompt": "Hello, my name is"},
    {"prompt": "The capital of France is"},
    {"prompt_token_ids": tokenizer("The future of AI is")["input_ids"]},
    "w5 w9 w11",
]
params = SamplingParams(temperature=0.0, max_tokens=12, stop=["ound", "shout"], logprobs=2)
outputs = llm.generate(prompts, params)
seen = []
for output in outputs:
    sample = output.outputs[0]
    first = sample.logprobs[0][sample.token_ids[0]]
    seen.append(
        {
            "request_id": output.request_id,
            "finished": output.finished,
            "prompt": output.prompt,
            "prompt_token_ids": output.prompt_token_ids,
            "text": sample.text,
            "token_ids": list(sample.token_ids),
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
            "cumulative_logprob": sample.cumulative_logprob,
            "first_logprob": [first.logprob, first.rank, first.decoded_token],
        }
    )
llm.close()
if os.environ.get("RANK", "0") == "0":  # (under torchrun: rank 0 writes; every rank got every output)
    with open(out, "w") as f:
        json.dump(seen, f)
