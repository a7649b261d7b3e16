"""Yours to run: generate text with a trained model, one process, CPU or GPU.

    python sample.py --checkpoint runs/default/checkpoints/last.pt --prompt "def main(" --max_new_tokens 300

The prompt is encoded, and the result decoded, with the tokenizer the model was trained with,
which the checkpoint holds (dataset.TokenWindows.data_state; bytes for a checkpoint without
one); bytes that do not form valid UTF-8 are printed as the replacement character.
"""

import argparse

import torch

from ddp_utils.errors import InputError
from ddp_utils.inference import load_trained, pick_device
from ddp_utils.knobs import OneLineParser, exit_with_error
from language.tokenizer import describe, from_text
from model import build_model, generate


def parse_args():
    parser = OneLineParser(
        description="Continue a prompt with a trained checkpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--checkpoint", required=True, help="a checkpoint train.py wrote, e.g. .../last.pt")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=500, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="below 1 is safer, above 1 wilder; 0 = greedy")
    parser.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens only, 0 = all")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda if available")
    args = parser.parse_args()
    if not args.prompt:
        exit_with_error("--prompt must not be empty")
    if args.max_new_tokens < 0 or args.top_k < 0 or args.temperature < 0:
        exit_with_error("--max_new_tokens, --top_k and --temperature must not be negative")
    return args


def main():
    args = parse_args()
    device = pick_device(args.device)
    model, cfg, state = load_trained(args.checkpoint, build_model, device)
    saved = (state.get("data") or {}).get("tokenizer")
    try:
        tokenizer = from_text(saved)
    except InputError as error:
        exit_with_error(f"--checkpoint {args.checkpoint}: its tokenizer: {error}")
    if tokenizer.vocab_size > cfg.vocab_size:
        exit_with_error(
            f"--checkpoint {args.checkpoint} has vocab_size {cfg.vocab_size}, but its tokenizer, {describe(saved)}, "
            f"makes ids up to {tokenizer.vocab_size - 1}: it was trained on other token files"
        )
    torch.manual_seed(args.seed)
    prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long, device=device)
    tokens = generate(model, prompt, args.max_new_tokens, cfg.block_size, args.temperature, args.top_k,
                      tokenizer.vocab_size)  # fmt: skip
    print(tokenizer.decode(tokens[0].tolist()))


if __name__ == "__main__":
    main()
