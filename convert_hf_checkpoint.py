"""Convert a checkpoint to magicdec's model.pth: an HF checkpoint dir, or a GGUF file.

  python convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf
  python convert_hf_checkpoint.py --gguf model.Q4_1.gguf --checkpoint_dir checkpoints/model
"""
import argparse
from pathlib import Path

import torch

from magicdec.checkpoint import convert_gguf, convert_hf_checkpoint
from magicdec.errors import MagicDecError, one_line_errors

DTYPES = {"keep": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_dir", type=Path, required=True,
                   help="HF checkpoint dir to convert in place (or holding one .gguf); with --gguf, the output dir")
    p.add_argument("--gguf", type=Path, help="GGUF file to convert into --checkpoint_dir")
    p.add_argument("--dtype", choices=DTYPES, default="keep",
                   help="dtype of model.pth (keep: the source's; GGUF is dequantized to float32)")
    args = p.parse_args(argv)
    d, dtype = args.checkpoint_dir, DTYPES[args.dtype]
    gguf = args.gguf
    if gguf is None and d.is_dir() and not any((d / f).is_file() for f in HF_WEIGHTS):
        found = sorted(d.glob("*.gguf"))
        if len(found) > 1:
            raise MagicDecError(f"{d} holds {len(found)} .gguf files and no HF weights: pick one with --gguf FILE")
        gguf = found[0] if found else None
    if gguf is not None:
        out = convert_gguf(gguf, d, dtype=dtype or torch.float32)
    else:
        out = convert_hf_checkpoint(d, dtype=dtype)
    print(f"wrote {out}")


if __name__ == "__main__":
    with one_line_errors():
        main()
