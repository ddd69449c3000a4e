"""Kept for existing imports: checkpoint reading, name conversion and ``ppma-convert`` live in
:mod:`ppma.checkpoint`."""

from ppma.checkpoint import (  # noqa: F401
    DOWNSTREAM_KEYS,
    EVAL_KEYS,
    allow_checkpoint_globals,
    checkpoint_safe_globals,
    convert_mm_checkpoint,
    convert_official_state_dict,
    convert_to_official_state_dict,
    load_checkpoint,
    read_checkpoint,
    select_state_dict,
)
from ppma.checkpoint.command import main  # noqa: F401

__all__ = [
    "convert_official_state_dict",
    "convert_to_official_state_dict",
    "select_state_dict",
    "convert_mm_checkpoint",
    "read_checkpoint",
    "checkpoint_safe_globals",
    "allow_checkpoint_globals",
    "load_checkpoint",
    "EVAL_KEYS",
    "DOWNSTREAM_KEYS",
    "main",
]

if __name__ == "__main__":
    raise SystemExit(main())
