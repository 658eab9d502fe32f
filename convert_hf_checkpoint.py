"""Convert a checkpoint to magicdec's model.pth: an HF checkpoint dir, a GGUF file, or a llama2.c (v0) file.

  python convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf
  python convert_hf_checkpoint.py --gguf model.Q4_1.gguf --checkpoint_dir checkpoints/model
  python convert_hf_checkpoint.py --llama2c stories260K.bin --llama2c_tokenizer tok512.bin --checkpoint_dir checkpoints/stories260K
"""
import argparse
from pathlib import Path

import torch

from magicdec.model.checkpoint import convert_gguf, convert_hf_checkpoint, convert_llama2c
from magicdec.errors import MagicDecError, one_line_errors

DTYPES = {"keep": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_dir", type=Path, required=True,
                   help="HF checkpoint dir to convert in place (or holding one .gguf); with --gguf, the output dir")
    p.add_argument("--gguf", type=Path, help="GGUF file to convert into --checkpoint_dir")
    p.add_argument("--llama2c", type=Path, help="llama2.c checkpoint (legacy v0 .bin) to convert into --checkpoint_dir")
    p.add_argument("--llama2c_tokenizer", type=Path,
                   help="with --llama2c: its llama2.c tokenizer .bin, copied into --checkpoint_dir as tokenizer.bin")
    p.add_argument("--dtype", choices=DTYPES, default="keep",
                   help="dtype of model.pth (keep: the source's; GGUF and llama2.c give float32)")
    args = p.parse_args(argv)
    d, dtype = args.checkpoint_dir, DTYPES[args.dtype]
    if args.llama2c_tokenizer is not None and args.llama2c is None:
        raise MagicDecError("--llama2c_tokenizer goes with --llama2c FILE: pass the llama2.c checkpoint too")
    if args.llama2c is not None:
        if args.gguf is not None:
            raise MagicDecError("--llama2c and --gguf both given: convert one file at a time")
        out = convert_llama2c(args.llama2c, d, args.llama2c_tokenizer, dtype=dtype or torch.float32)
        print(f"wrote {out}")
        return
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
    with one_line_errors("interrupted: nothing was converted (no partial model.pth is left); run the same command "
                         "again"):
        main()
