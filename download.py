"""Download an HF checkpoint (weights, config, tokenizer) for convert_hf_checkpoint.py.

  python download.py --repo_id meta-llama/Llama-2-7b-hf --hf_token $HF_TOKEN
"""
import argparse
import os
from pathlib import Path

# fail fast when offline rather than waiting out the hub's default timeouts
os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "30")

from magicdec.errors import MagicDecError, one_line_errors  # noqa: E402

TIMEOUT_S = 10
# HF-format weights, configs and tokenizers; not e.g. Mistral's consolidated.safetensors (the same weights again)
WANTED = ["model*.safetensors", "pytorch_model*.bin", "*.json", "tokenizer.model", "*.tiktoken"]


def _hub_error(e: Exception, repo_id: str, out_dir: Path) -> MagicDecError:
    """The one-line error, naming the fix, for a failed hub call."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError)
    if isinstance(e, GatedRepoError):
        return MagicDecError(f"{repo_id} is gated: accept its licence on its hub page, then pass --hf_token TOKEN")
    if isinstance(e, RepositoryNotFoundError):
        return MagicDecError(f"no repo {repo_id} on the hub, or it is private: check --repo_id, or pass --hf_token TOKEN")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return MagicDecError(f"the hub refused access to {repo_id} (HTTP {status}): pass a valid --hf_token TOKEN")
    if isinstance(e, (OfflineModeIsEnabled, LocalEntryNotFoundError)) or not isinstance(e, HfHubHTTPError):
        return MagicDecError(f"cannot reach the hub for {repo_id} ({type(e).__name__}): check the network (HF_HUB_OFFLINE, "
                             f"proxy), or download it elsewhere and copy it into {out_dir}")
    return MagicDecError(f"hub error for {repo_id} ({type(e).__name__}: {str(e).splitlines()[0]}): retry later")


def download(repo_id: str, out_dir: Path, token: str | None = None) -> Path:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:  # before the network: the hub answers a malformed id as if the repo were missing or the network down
        validate_repo_id(repo_id)
    except HFValidationError:
        raise MagicDecError(f"--repo_id {repo_id!r} is not a hub repo id: give OWNER/NAME as on the model's hub page "
                            "(letters, digits, '-', '_' and '.'; e.g. meta-llama/Llama-2-7b-hf)") from None
    try:
        files = [s.rfilename for s in HfApi().model_info(repo_id, token=token, timeout=TIMEOUT_S).siblings or []]
        ignore = ["original/*"]  # Meta's consolidated copy of the same weights
        if any(f.startswith("model") and f.endswith(".safetensors") for f in files):
            ignore.append("*.bin")  # same weights twice: take safetensors only
        path = snapshot_download(repo_id, local_dir=out_dir, token=token, allow_patterns=WANTED,
                                 ignore_patterns=ignore, etag_timeout=TIMEOUT_S)
    except Exception as e:  # the hub client raises its own and its HTTP library's types
        raise _hub_error(e, repo_id, out_dir) from None
    return Path(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo_id", required=True, help="e.g. meta-llama/Llama-2-7b-hf")
    p.add_argument("--hf_token", default=os.environ.get("HF_TOKEN"), help="for gated or private repos (default $HF_TOKEN)")
    p.add_argument("--out_dir", type=Path, help="default checkpoints/REPO_ID")
    args = p.parse_args(argv)
    out = download(args.repo_id, args.out_dir or Path("checkpoints") / args.repo_id, args.hf_token)
    print(f"downloaded {args.repo_id} to {out}; next: python convert_hf_checkpoint.py --checkpoint_dir {out}")


if __name__ == "__main__":
    with one_line_errors():
        main()
