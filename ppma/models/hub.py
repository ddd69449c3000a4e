"""Kept for existing imports: the official checkpoints on the Hugging Face hub live in :mod:`ppma.checkpoint.hub`."""

from ppma.checkpoint.hub import (  # noqa: F401
    CLASSIFICATION_FILES,
    DOWNSTREAM_FILES,
    HF_REPO_ID,
    download_hf,
    download_official,
    official_files,
)

__all__ = ["HF_REPO_ID", "CLASSIFICATION_FILES", "DOWNSTREAM_FILES", "official_files", "download_official",
           "download_hf"]
