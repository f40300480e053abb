"""The ceiling of speculation over a file in batches: plain decoding, prompt lookup and a perfect proposer.

Every request of the file is decoded in batches of ``--batch-size`` (continuous batching, ``specula.Decoder``) by
plain decoding, by PromptLookup with the cost model, and by a perfect proposer: ``Replay`` of the output the file's
own requests decode to, ``--num-draft`` tokens a pass, sent whole. In bf16 a pass over another number of tokens can
round a near-tie otherwise, so the replayed output is first replaced by what a replay decodes until a replay
reproduces it (untimed). The perfect proposer's speedup over plain decoding bounds what any proposer can gain on the
file here; prefills, which drafts cannot shorten, are printed apart.

Usage: python examples/batch_ceiling.py FILE [--batch-size 8] [--rounds 2] [--max-new-tokens 128] [--num-draft 10]
"""

from __future__ import annotations

import argparse
import time

import specula
from specula.hf.loading import load_model
from specula.jobs.requests import Request, encode, read_requests
from specula.tools.replay import Replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft", type=int, default=10)
    args = parser.parse_args()
    model, tokenizer = load_model()
    jobs = [
        job
        for _, request in read_requests(args.file)
        if isinstance(request, Request)
        for job in specula.prepare_jobs(
            model, encode(tokenizer, request), max_new_tokens=args.max_new_tokens, do_sample=False
        )
    ]

    def run(proposer, adaptive: bool = True) -> tuple[list[list[int]], float, float, int]:
        """Each request's prompt + output, tokens per second, prefill seconds, passes."""
        decoder = specula.Decoder(model, proposer, args.batch_size, adaptive_draft=adaptive)
        started, outputs = time.perf_counter(), {}
        for row, _ in decoder.run(list(jobs)):
            if row.finished:
                outputs[id(row.job)] = row.job.prompt.tolist() + list(row.output)
        seconds = time.perf_counter() - started
        made = sum(len(sequence) - len(job.prompt) for sequence, job in zip(outputs.values(), jobs))
        return list(outputs.values()), made / seconds, decoder.prefill_seconds, decoder.passes

    references = run(specula.PromptLookup())[0]
    for _ in range(4):
        replayed = run(Replay(references, args.num_draft), adaptive=False)[0]
        if replayed == references:
            break
        references = replayed
    methods = {
        "plain": (None, True),
        "prompt-lookup": (specula.PromptLookup(), True),
        f"perfect, {args.num_draft} a pass": (Replay(references, args.num_draft), False),
    }
    for round_ in range(args.rounds):
        for name, (proposer, adaptive) in methods.items():
            _, rate, prefill, passes = run(proposer, adaptive)
            print(
                f"round {round_ + 1}  {name:20s} {rate:6.1f} tok/s  prefill {prefill:4.1f} s  {passes} passes",
                flush=True,
            )


if __name__ == "__main__":
    main()
