"""`specray generate` / `python -m jobs.generate`: one generation with any method.

    python -m jobs.generate --method ngram --prompt "Summarize: ..." --chat --json

Bad input prints one line naming the problem and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from jobs.common import Parser, add_config_args, check_text, command, config_from_args, fail, input_file


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="specray generate", description="Generate text with a speculative method.")
    add_config_args(p, method=True)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose whole content is the prompt")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--address",
        help="Ray cluster to join for --method pearl / --set placement=actors (default: RAY_ADDRESS, else an embedded local Ray)",
    )
    return p


def read_prompt(args) -> str:
    if args.prompt_file:
        path = input_file(args.prompt_file, "prompt file")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read prompt file {path}: {e}")
    else:
        text = args.prompt if args.prompt is None else check_text(args.prompt, "--prompt")
    if text is None:
        fail("no prompt: pass --prompt TEXT or --prompt-file F")
    if not text.strip():
        fail("the prompt is empty")
    return text


def main_with_args(args) -> int:
    cfg = config_from_args(args)
    prompt = read_prompt(args)
    from cluster.decoders import open_decoder  # heavy imports after the cheap checks
    from cluster.runtime import shutdown_if_started_here
    from decoding.decoder import GenerationLost

    try:
        with open_decoder(cfg, address=args.address) as decoder:
            out = decoder.generate_text(prompt, chat=args.chat)
    except GenerationLost as e:  # a model worker died or stopped answering
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        shutdown_if_started_here()
    if args.json:
        print(json.dumps(out))
    else:
        s = out["stats"]
        print(out["text"])
        label = f"{cfg.method}, LOSSY: not verified against the target" if out["lossy"] else cfg.method
        print(
            f"\n[{label}] {s['new_tokens']} tokens in {s['wall_s']:.2f}s = {s['tokens_per_s']:.1f} tok/s, "
            f"{s['target_forwards']} target forwards, {s['mean_accepted_tokens']:.2f} tokens/forward",
            file=sys.stderr,
        )
    return 0


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
