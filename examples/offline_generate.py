"""Offline batch generation with the synchronous ``LLM`` front.

Run:  python examples/offline_generate.py [--model PATH]
"""

from __future__ import annotations


from asyncllm import LLM, SamplingParams
from asyncllm.toy import example_parser, parse_example_args


def run(model: str) -> list:
    llm = LLM(model)
    prompts = ["The quick brown fox", "Once upon a time", [1, 2, 3, 4]]  # text or token ids
    params = [SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=16, n=2),
              SamplingParams(temperature=0, max_tokens=8, logprobs=2)]
    outputs = llm.generate(prompts, params)
    for out in outputs:
        for completion in out.outputs:
            print(f"{out.prompt!r:28} [{completion.index}] {completion.text!r} ({completion.finish_reason})")
    return outputs


def main() -> None:
    args = parse_example_args(example_parser(__doc__))
    run(args.model)


if __name__ == "__main__":
    main()
