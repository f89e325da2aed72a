"""Save a target's untrained N-layer truncation (evenly spaced layers, first and last kept) as an HF folder, the
draft `specdistill bench --draft` and the other benchmarks load like any other.

    python benchmarks/truncated_draft.py --out runs/bench/trunc4                     # SmolLM2-135M, 4 of 30 layers
    python benchmarks/truncated_draft.py --target random:tiny-llama --layers 2 --out /tmp/trunc2   # smoke
"""

from __future__ import annotations

import argparse

from distill.students import evenly_spaced_layers, truncate_student
from specdec_runtime.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--layers", type=int, default=4, help="target layers kept")
    parser.add_argument("--out", required=True, help="output folder (config, safetensors, tokenizer)")
    args = parser.parse_args()
    target, tokenizer = load_model(args.target, device="cpu")
    layers = evenly_spaced_layers(target.config.num_hidden_layers, args.layers)
    draft = truncate_student(target, layers)
    draft.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"{args.out}: layers {layers} of {args.target} ({target.config.num_hidden_layers}), untrained")


if __name__ == "__main__":
    main()
