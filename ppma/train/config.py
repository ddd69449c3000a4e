"""Training configuration: a typed schema, YAML files and command-line overrides.

The schema is :class:`TrainConfig`, one dataclass per section (``model``, ``data``, ``aug``, ``optim``,
``sched``, ``ema``, ``train``); its defaults reproduce the official ImageNet-1K recipe (docs/model.md §6.1). A config is
built by :func:`load_config` in layers: the defaults, then a YAML file (``configs/classification/*.yaml``, any
subset of the sections), then ``--set section.key=value`` assignments (YAML values), then the dedicated
command-line flags. OmegaConf structured configs do the merging and the type checks; every layer is strict:
an unknown key raises ``KeyError`` naming it and the allowed keys, a value of the wrong type raises
``TypeError`` naming the key and the expected type. ``model.overrides`` is the one free-form mapping (any
keyword of the model factory).

The result is a plain dataclass tree (``cfg.optim.lr``) that holds plain Python values, so that it is cheap to
read in the training loop and serialises with ``cfg.to_dict()`` into checkpoints (``weights_only``-loadable).
"""

import dataclasses
import difflib
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

import yaml

__all__ = [
    "TrainConfig",
    "ModelConfig",
    "DataConfig",
    "AugConfig",
    "OptimConfig",
    "SchedConfig",
    "EmaConfig",
    "RunConfig",
    "load_config",
    "parse_assignment",
]


@dataclass
class ModelConfig:
    name: str = "ppma_tiny"
    # None: ppma.create_model. "package.module:callable": any factory with create_model's signature
    # (name, pretrained=False, num_classes=..., drop_path_rate=..., checkpoint_path=..., **overrides).
    factory: Optional[str] = None
    # None: the variant's own rate (0.1 / 0.15 / 0.4 for T / S / B, docs/model.md §4.1).
    drop_path_rate: Optional[float] = None
    # Any keyword of ppma.create_model: embed_dims, depths, num_heads, mlp_ratios, mixer (docs/ops.md, "Glossary"),
    # layerscale, mask, layer_init_values, in_chans (fused or reference ops: the --impl flag). Free-form
    # (checked by the factory). `--set model.overrides={...}` replaces the whole mapping,
    # `--set model.overrides.KEY=VALUE` one entry.
    overrides: Dict[str, Any] = field(default_factory=dict)
    checkpoint_path: Optional[str] = None  # initial weights (e.g. converted official ones)


@dataclass
class DataConfig:
    # "imagefolder" (path/train, path/val), "digits" (scikit-learn's bundled 8x8 digits), or
    # "synthetic" (random tensors, for tests and smoke runs).
    dataset: str = "imagefolder"
    path: Optional[str] = None
    num_classes: int = 1000
    img_size: int = 224
    in_chans: int = 3
    batch_size: int = 128  # per process
    eval_batch_size: int = 64  # per process
    num_workers: int = 8
    pin_memory: bool = True
    crop_pct: float = 0.875  # eval: Resize(224 / 0.875 = 256) + CenterCrop(224)
    interpolation: str = "bicubic"
    mean: List[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: List[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    repeated_aug: int = 3  # timm RepeatAugSampler repeats (1 = off)
    repeated_aug_round: int = 256  # epoch length rounded down to a multiple of this (official)
    # digits only
    digits_test_size: float = 0.2
    digits_split_seed: int = 0
    # synthetic only
    synthetic_train_size: int = 64
    synthetic_val_size: int = 32


@dataclass
class AugConfig:
    # ImageFolder training pipeline (timm create_transform, docs/model.md §6.1)
    scale: List[float] = field(default_factory=lambda: [0.08, 1.0])
    hflip: float = 0.5
    color_jitter: float = 0.4
    auto_augment: Optional[str] = "rand-m9-mstd0.5-inc1"
    re_prob: float = 0.25
    re_mode: str = "pixel"
    re_count: int = 1
    # Mixup / CutMix (timm Mixup) and label smoothing
    mixup: float = 0.8
    cutmix: float = 1.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = "batch"
    smoothing: float = 0.1
    # Batched random affine for small tensor datasets (digits): degrees, translate (fraction of the image),
    # scale range, shear degrees; applied on the device, per sample. 0 disables.
    affine_degrees: float = 0.0
    affine_translate: float = 0.0
    affine_scale: List[float] = field(default_factory=lambda: [1.0, 1.0])
    affine_shear: float = 0.0


@dataclass
class OptimConfig:
    opt: str = "adamw"
    # lr = base_lr * total_batch / base_batch (linear scaling, docs/model.md §6.1) unless lr is set.
    base_lr: float = 5.0e-4
    base_batch: int = 512
    lr: Optional[float] = None
    weight_decay: float = 0.05  # not on 1-D parameters and biases
    eps: float = 1.0e-8
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    clip_grad: Optional[float] = None
    # Adam / AdamW: torch's fused (single-pass) step where the parameters' device has one (CPU, CUDA); None: fused
    # there, the multi-tensor step elsewhere. The same update up to float rounding; on the CPU it runs about 4x as
    # fast (PPMA-T: 9 against 36 ms a step on 2 cores).
    fused: Optional[bool] = None


@dataclass
class SchedConfig:
    epochs: int = 300
    warmup_epochs: float = 5  # fractional warm-ups are honoured with per_iteration
    warmup_lr: float = 1.0e-6
    min_lr: float = 1.0e-5
    # False: timm CosineLRScheduler stepped once per epoch, at the end of epoch e with t = e (the official
    # DeiT-style loop, docs/model.md §6.1: epochs 0 and 1 both run at warmup_lr).
    # True: stepped every iteration on the fractional epoch (smoother, for short runs).
    per_iteration: bool = False


@dataclass
class EmaConfig:
    enabled: bool = True
    decay: float = 0.99992  # per iteration, 0.99996 ** (1024 / 512)
    warmup: bool = False


@dataclass
class RunConfig:
    output: str = "outputs/run"
    resume: Optional[str] = None  # checkpoint path, or "auto": <output>/checkpoint.pth when it exists
    seed: int = 0
    device: str = "auto"  # auto: cuda if available, else cpu
    # CPU threads for torch (None: torch's default, one per core). On a shared CPU, 1 thread avoids the
    # OpenMP oversubscription that can slow small models down by 10x.
    num_threads: Optional[int] = None
    amp: str = "auto"  # auto (fp16 on cuda, off on cpu) | fp16 | bf16 | none
    sync_bn: bool = True  # only with several CUDA processes
    deterministic: bool = False
    channels_last: bool = False
    eval_every: int = 1
    save_every: int = 1
    progress: bool = True
    max_steps_per_epoch: Optional[int] = None  # cut epochs short (smoke tests)
    stop_after_epoch: Optional[int] = None  # end the run after this epoch (the schedule still spans sched.epochs)
    # The bar of a run that must reach an accuracy (the demos: README "Training"): when the schedule's last
    # epoch ends with a test acc1 (%) below it, train() raises AccuracyBelowBar and the CLI exits non-zero.
    min_test_acc1: Optional[float] = None
    # torch.compile the model: on the CPU ppma's recipe (ppma.compile.compile_model, docs/compile.md), elsewhere
    # plain torch.compile
    compile: bool = False


@dataclass
class TrainConfig:
    """A whole run: the sections of a YAML config file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    aug: AugConfig = field(default_factory=AugConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    train: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        """Plain nested dict (lists, numbers, strings, None): for YAML dumps and checkpoints."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "a dict") -> "TrainConfig":
        """The defaults updated by ``data`` (e.g. a checkpoint's ``config``), with the same checks as a file."""
        return _build([(data, source, True)])


_SECTIONS = {f.name: typing.get_type_hints(TrainConfig)[f.name] for f in dataclasses.fields(TrainConfig)}

# ----------------------------------------------------------------------------------------------- loading


def parse_assignment(item: str, flag: str = "--set") -> tuple[str, Any]:
    """``"a.b=VALUE"`` -> ``("a.b", value)``, the value parsed as YAML (``3``, ``1e-3``, ``[1, 2]``, ``null``)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{flag} expects KEY=VALUE (e.g. section.key=value), got {item!r}")
    return key.strip(), yaml.safe_load(raw)


def load_config(
    path: Optional[str] = None,
    assignments: Iterable[str] = (),
    values: Optional[Mapping[str, Any]] = None,
) -> TrainConfig:
    """The defaults, then the YAML file at ``path`` (if any), then ``section.key=value`` strings
    (``assignments``, as given to ``--set``), then ``values`` (``{"section.key": value}``, the dedicated
    command-line flags). Raises ``KeyError`` for unknown keys and ``TypeError`` for values of the wrong type,
    naming the key and its source."""
    layers = []
    if path:
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        layers.append((loaded, path, True))
    for item in assignments:
        key, value = parse_assignment(item)
        layers.append((_nested(key, value), f"--set {item}", key.count(".") < 2))
    for key, value in (values or {}).items():
        layers.append((_nested(key, value), f"{key}={value!r}", key.count(".") < 2))
    return _build(layers)


def _nested(dotted: str, value: Any) -> dict:
    """``"a.b.c", v`` -> ``{"a": {"b": {"c": v}}}``."""
    out = value
    for key in reversed(dotted.split(".")):
        out = {key: out}
    return out


def _build(layers: list[tuple[Any, str, bool]]) -> TrainConfig:
    """Merge ``(update, source, whole)`` layers onto the defaults. ``whole``: the layer gives
    ``model.overrides`` as one value (a file, ``--set model.overrides={...}``), which then replaces the
    free-form mapping instead of merging into it (a merge would keep keys the layer meant to drop); a dotted
    key inside it (``--set model.overrides.depths=...``) changes one entry."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, ValidationError

    cfg = OmegaConf.structured(TrainConfig)
    for update, source, whole in layers:
        update = _sections(update, source)
        if whole and isinstance(update.get("model", {}).get("overrides"), Mapping):
            cfg.model.overrides = {}
        try:
            cfg = OmegaConf.merge(cfg, update)
        except ConfigKeyError as exc:
            raise _unknown_key(exc.full_key, source) from None
        except ValidationError as exc:
            raise _wrong_type(exc, update, source) from None
    return OmegaConf.to_object(cfg)


def _sections(update: Any, source: str) -> dict:
    """Check the top level of a layer (a mapping of known sections, each a mapping) and drop empty sections
    (``train:`` with every key commented out); OmegaConf's merge checks the keys inside the sections."""
    if not isinstance(update, Mapping):
        raise TypeError(f"config {source}: expected a mapping of sections, got {update!r} ({type(update).__name__})")
    for name, value in update.items():
        if name not in _SECTIONS:
            raise _unknown_key(str(name), source)
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(f"config section {name!r} ({source}) must be a mapping of keys, "
                            f"got {value!r} ({type(value).__name__})")
    return {name: value for name, value in update.items() if value is not None}


def _unknown_key(full_key: str, source: str) -> KeyError:
    section, _, key = full_key.partition(".")
    if not key:
        where, allowed = "sections", list(_SECTIONS)
    else:
        where, allowed = f"keys of section {section!r}", [f.name for f in dataclasses.fields(_SECTIONS[section])]
        key = key.split(".")[0]
    guess = difflib.get_close_matches(key or section, allowed, n=1)
    hint = f"; did you mean {guess[0]!r}?" if guess else ""
    return KeyError(f"unknown config key {full_key!r} ({source}){hint} Allowed {where}: " + ", ".join(allowed))


def _wrong_type(exc: Exception, update: Mapping, source: str) -> TypeError:
    full_key = exc.full_key
    try:
        section, _, key = re.sub(r"\[\d+\]$", "", full_key).partition(".")  # "optim.betas[1]": the list is typed
        expected = _type_name(typing.get_type_hints(_SECTIONS[section])[key.split(".")[0]])
        value: Any = update
        for part in filter(None, re.split(r"\.|\[(\d+)\]", full_key)):
            value = value[int(part)] if isinstance(value, list) else value[part]
    except (KeyError, IndexError, TypeError):  # not a typed entry of the update: OmegaConf's own words
        return TypeError(f"config {source}: " + str(exc).splitlines()[0])
    return TypeError(f"config key {full_key!r} ({source}) must be {expected}, got {value!r} ({type(value).__name__})")


def _type_name(tp) -> str:
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[T]
        return f"{_type_name(next(a for a in args if a is not type(None)))} or null"
    if origin is list:
        return f"a list of {_type_name(args[0])}"
    if origin is dict:
        return "a mapping"
    return tp.__name__
