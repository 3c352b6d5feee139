"""How much precision bf16 gradient accumulation costs, against the error bf16 arithmetic already makes.

A GPU recipe run on fewer GPUs than it is written for accumulates micro-batches (``train.global_batch_size``:
GPT-2 small on one GPU sums 32). DeepSpeed's ZeRO-1/2 keep bf16 weights' gradients in bf16 while they
accumulate (its default ``data_types.grad_accum_dtype``), as its bf16 reduce-scatter over the 32 GPUs the
recipe is written for sums the same 32 contributions in bf16. This measures, on one realistic model and
batch, the relative error (L2 norm of the difference over the reference's) of

- one micro-batch's gradient computed in bf16 (weights and activations, as DeepSpeed's bf16 runs them),
- the sum of ``--micro`` such gradients accumulated in bf16, and accumulated in fp32,

each against the fp32 model's gradients summed in fp32, and for scale how much two consecutive micro-batches'
fp32 gradients differ (the noise that training averages out). CPU; seconds.

    python benchmarks/grad_accum_precision.py [--model gpt-tiny] [--micro 32] [--batch 4] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference).norm() / reference.norm()).item()


def main() -> int:
    import models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro", type=int, default=32, help="micro-batches accumulated")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    torch.manual_seed(0)
    fp32 = models.create(args.model, vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    data = torch.Generator().manual_seed(1)
    in_bf16 = in_fp32 = reference = previous = None
    single, between = [], []
    for _ in range(args.micro):
        ids = torch.randint(5, args.vocab, (args.batch, args.seq_len), generator=data)
        for model in (bf16, fp32):  # the loss scaled by 1/micro, as DeepSpeed scales it
            model.zero_grad(set_to_none=True)
            (model(input_ids=ids, labels=ids)["loss"] / args.micro).backward()
        low, high = flat_grads(bf16), flat_grads(fp32)
        single.append(relative_error(low, high))
        if previous is not None:  # how much two micro-batches' gradients differ: the noise training averages out
            between.append(relative_error(high, previous))
        previous = high
        in_bf16 = low.clone() if in_bf16 is None else in_bf16 + low
        in_fp32 = low.float() if in_fp32 is None else in_fp32 + low.float()
        reference = high.clone() if reference is None else reference + high
    print(f"{args.model}, {args.micro} micro-batches of {args.batch} x {args.seq_len}; relative error against the fp32 "
          f"model's gradients summed in fp32:")
    print(f"  one micro-batch computed in bf16 (mean): {sum(single) / len(single):.4f}")
    print(f"  {args.micro} bf16 micro-batches accumulated in bf16: {relative_error(in_bf16, reference):.4f}")
    print(f"  {args.micro} bf16 micro-batches accumulated in fp32: {relative_error(in_fp32, reference):.4f}")
    print(f"  bf16 accumulation against fp32 accumulation of the same gradients: {relative_error(in_bf16, in_fp32):.4f}")
    print(f"  for scale, one fp32 micro-batch's gradient against the previous one's (mean): {sum(between) / len(between):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
