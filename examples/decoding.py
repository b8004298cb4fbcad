"""Beam search, best_of, and speculative decoding on one engine each.

Run:  python examples/decoding.py [--model PATH]

Three scenes. Beam search: ``LLM.beam_search`` keeps three beams and returns its hypotheses best
first, with their scores. best_of: six samples are drawn and the two with the highest cumulative
log-probability come back. Speculative decoding: an ``AsyncLLM`` with prompt lookup
(``speculative_config={"method": "ngram", ...}``) streams an answer that repeats its prompt; the
stream receives several tokens at once whenever drafts are accepted, and the text is the one plain
decoding gives. See docs/decoding.md.
"""

from __future__ import annotations

import asyncio

from asyncllm import LLM, AsyncLLM, BeamSearchParams, SamplingParams
from asyncllm.toy import example_parser, parse_example_args

TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def beams_and_best_of(model: str) -> dict:
    llm = LLM(model)
    (beams,) = llm.beam_search(["Once upon a time"], BeamSearchParams(beam_width=3, max_tokens=16))
    for rank, hypothesis in enumerate(beams.sequences):
        print(f"beam {rank}: {hypothesis.cum_logprob:8.3f}  {hypothesis.text!r}")
    (best,) = llm.generate(["Once upon a time"], SamplingParams(n=2, best_of=6, temperature=0.9, seed=0,
                                                                max_tokens=16))
    for choice in best.outputs:
        print(f"best_of {choice.index}: {choice.cumulative_logprob:8.3f}  {choice.text!r}")
    return {"beams": beams.sequences, "best_of": best.outputs}


async def speculative_stream(model: str) -> dict:
    prompt = [{"role": "user", "content": f"Repeat exactly: {TEXT}"}]
    plain = LLM(model).generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0].outputs[0].text
    async with AsyncLLM(model, speculative_config=NGRAM) as llm:
        pieces = []
        async for delta in llm.stream_outputs(prompt, temperature=0, max_tokens=48):
            pieces.append((len(delta.outputs[0].token_ids), delta.outputs[0].text))
        stats = llm.stats()
    text = "".join(piece for _, piece in pieces)
    print(f"speculative stream: {len(pieces)} deltas for {sum(n for n, _ in pieces)} tokens; "
          f"{stats['spec_accepted_tokens']} of {stats['spec_draft_tokens']} draft tokens accepted; "
          f"same text as plain decoding: {text == plain}")
    return {"pieces": pieces, "text": text, "plain": plain, "stats": stats}


def main() -> None:
    args = parse_example_args(example_parser(__doc__))
    beams_and_best_of(args.model)
    asyncio.run(speculative_stream(args.model))


if __name__ == "__main__":
    main()
