"""Resolve `LLM(model=...)`: a local directory, or a Hugging Face hub id fetched into the local cache."""
import os

WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
CONFIG_PATTERNS = ["*.json", "*.txt", "*.model", "*.jinja"]


def check_directory_or_hub_id(name: str, field: str):
    """Raise ValueError unless name is a local directory or has the form of a hub id ('org/name')."""
    if not os.path.isdir(name) and (os.path.exists(name) or name.startswith((".", "/")) or name.count("/") != 1):
        raise ValueError(f"{field} must be a local directory or a Hugging Face hub id "
                         f"such as 'Qwen/Qwen3-0.6B', got {name!r}: no such directory.")


def resolve_model_path(model: str, need_weights: bool = True, revision: str | None = None,
                       cache_dir: str | None = None, token: str | bool | None = None) -> str:
    """Return a local directory holding `model`'s files; a hub id is downloaded (or read from cache)."""
    if os.path.isdir(model):
        return model
    check_directory_or_hub_id(model, "model")
    from huggingface_hub import snapshot_download
    patterns = WEIGHT_PATTERNS if need_weights else CONFIG_PATTERNS
    try:
        return snapshot_download(model, allow_patterns=patterns, revision=revision, cache_dir=cache_dir,
                                 token=token)
    except Exception as e:  # offline, unknown repo, gated model, ...
        raise ValueError(
            f"could not fetch model {model!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            f"Download it on a machine with network access with "
            f"`huggingface-cli download {model} --local-dir <dir>` and pass that directory."
        ) from None
