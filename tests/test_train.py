"""Training machinery: configs, a few steps reduce the loss, exact resume, metrics.jsonl, DDP on 2 CPU processes."""

import contextlib
import dataclasses
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from ppma._compat import ensure_torchvision  # noqa: E402

ensure_torchvision()  # timm imports torchvision (see ppma._compat)
pytest.importorskip("timm")
yaml = pytest.importorskip("yaml")

from ppma.train.checkpoint import load_checkpoint  # noqa: E402
from ppma.train.cli.train import config_from_args, parse_args  # noqa: E402
from ppma.train.config import TrainConfig, load_config  # noqa: E402
from ppma.train.trainer import train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "classification", "*.yaml")))


def model_args() -> list[str]:
    """A tiny PPMA: criss-cross attention in stages 1-2, full attention in stages 3-4."""
    return [
        "--set", "model.overrides={embed_dims: [8, 16, 16, 16], depths: [1, 1, 1, 1], num_heads: [1, 2, 2, 2],"
        " mlp_ratios: [2, 2, 2, 2], mixer: [criss_cross, criss_cross, full, full]}",
    ]


def tiny_args(out, epochs=2, extra=()) -> list[str]:
    return [
        "--data", "synthetic", "--epochs", str(epochs), "--batch-size", "8", "--output", str(out),
        "--num-workers", "0", "--no-progress", "--lr", "3e-3",
        "--set", "data.img_size=16", "--set", "data.num_classes=4", "--set", "data.repeated_aug=1",
        "--set", "data.synthetic_train_size=32", "--set", "data.synthetic_val_size=16",
        "--set", "aug.mixup=0", "--set", "aug.cutmix=0", "--set", "ema.decay=0.9",
        "--set", "sched.warmup_epochs=0", "--set", "sched.min_lr=1e-4",
        *model_args(), *extra,
    ]



@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads, and on a shared CPU OpenMP oversubscription slows them a lot."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_configs_load(path):
    cfg = load_config(path)
    assert set(cfg.to_dict()) == set(TrainConfig().to_dict())
    assert cfg.sched.epochs > 0 and cfg.data.batch_size > 0
    # every entry of the file arrives unchanged
    with open(path) as f:
        raw = yaml.safe_load(f)
    for section, entries in raw.items():
        for key, value in entries.items():
            assert cfg.to_dict()[section][key] == value, f"{section}.{key}"
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # the checkpoint round trip


def test_imagenet_configs_follow_the_recipe():
    for variant, dpr in (("tiny", 0.1), ("small", 0.15), ("base", 0.4)):
        cfg = load_config(os.path.join(ROOT, "configs", "classification", f"ppma_{variant}_imagenet.yaml"))
        assert cfg.model.name == f"ppma_{variant}" and cfg.model.drop_path_rate == dpr
        assert cfg.optim.base_lr * 1024 / cfg.optim.base_batch == pytest.approx(1e-3)
        assert (cfg.sched.epochs, cfg.sched.warmup_epochs, cfg.sched.warmup_lr, cfg.sched.min_lr) == (300, 5, 1e-6, 1e-5)
        assert cfg.aug.auto_augment == "rand-m9-mstd0.5-inc1" and cfg.aug.re_prob == 0.25
        assert (cfg.aug.mixup, cfg.aug.cutmix, cfg.aug.smoothing) == (0.8, 1.0, 0.1)
        assert cfg.data.repeated_aug == 3 and cfg.ema.decay == 0.99992 and cfg.optim.weight_decay == 0.05


def test_config_overrides_and_errors(tmp_path):
    args = parse_args(["--config", os.path.join(ROOT, "configs", "classification", "demo_digits.yaml"),
                       "--epochs", "3", "--batch-size", "7", "--output", str(tmp_path), "--data", "/some/folder",
                       "--set", "optim.weight_decay=0.01", "--set", "aug.affine_scale=[0.8, 1.2]"])
    cfg = config_from_args(args)
    assert (cfg.sched.epochs, cfg.data.batch_size, cfg.train.output) == (3, 7, str(tmp_path))
    assert (cfg.data.dataset, cfg.data.path) == ("imagefolder", "/some/folder")
    assert cfg.optim.weight_decay == 0.01 and cfg.aug.affine_scale == [0.8, 1.2]
    with pytest.raises(KeyError, match="optim.weigth_decay"):
        load_config(None, ["optim.weigth_decay=0.1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("sched:\n  epoch: 3\n")
    with pytest.raises(KeyError, match="sched.epoch"):
        load_config(str(bad))


def test_config_errors_name_the_key(tmp_path):
    """Unknown keys name the key, a guess and the allowed keys; wrong types name the key and the expected type;
    both name where the value came from (file, --set, flag, checkpoint)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  weigth_decay: 0.1\n")
    with pytest.raises(KeyError, match=r"'optim.weigth_decay' \(.*bad.yaml\); did you mean 'weight_decay'\? "
                                       r"Allowed keys of section 'optim': opt, base_lr, base_batch, lr, weight_decay"):
        load_config(str(bad))
    with pytest.raises(KeyError, match=r"'optimizer'.*Allowed sections: model, data, aug, optim, sched, ema, train"):
        load_config(None, ["optimizer.lr=0.1"])
    # a dotted override of an unknown key, through the command line
    with pytest.raises(KeyError, match=r"unknown config key 'train.epochs' \(--set train.epochs=3\)"):
        config_from_args(parse_args(["--set", "train.epochs=3"]))
    with pytest.raises(KeyError, match="sched.epoch"):  # a checkpoint's config is checked the same way
        TrainConfig.from_dict({"sched": {"epoch": 3}})
    from ppma.train.cli.train import main

    with pytest.raises(SystemExit, match=r"^ppma-train: error: unknown config key 'train.epochs'"):
        main(["--set", "train.epochs=3"])  # the command line prints the message, not a traceback

    bad.write_text("sched:\n  epochs: six\n")
    with pytest.raises(TypeError, match=r"'sched.epochs' \(.*bad.yaml\) must be int, got 'six' \(str\)"):
        load_config(str(bad))
    for assignment, message in [
        ("data.img_size=2.5", r"'data.img_size' \(--set data.img_size=2.5\) must be int, got 2.5 \(float\)"),
        ("data.batch_size=null", r"'data.batch_size' .* must be int, got None"),
        ("optim.betas=[0.9, x]", r"'optim.betas\[1\]' .* must be a list of float, got 'x' \(str\)"),
        ("optim.lr=[1]", r"'optim.lr' .* must be float or null, got \[1\] \(list\)"),
        ("ema.enabled=2.0", r"'ema.enabled' .* must be bool, got 2.0"),
        ("sched.epochs.x=1", r"'sched.epochs' .* must be int, got \{'x': 1\} \(dict\)"),
        ("sched=3", r"section 'sched' \(--set sched=3\) must be a mapping of keys, got 3"),
    ]:
        with pytest.raises(TypeError, match=message):
            load_config(None, [assignment])
    with pytest.raises(TypeError, match=r"'sched.epochs' \(sched.epochs=2.5\) must be int"):
        load_config(None, values={"sched.epochs": 2.5})
    with pytest.raises(ValueError, match="--set expects KEY=VALUE"):
        load_config(None, ["optim.lr"])


def test_config_values_and_free_form_overrides():
    demo = os.path.join(ROOT, "configs", "classification", "demo_digits.yaml")
    cfg = load_config(demo, ["sched.min_lr=1e-4", "train.output=123"])
    assert cfg.sched.min_lr == 1e-4  # YAML 1.1 reads 1e-4 as a string; the float entry converts it
    assert cfg.train.output == "123"
    # model.overrides takes any key: a dotted key changes one entry, a whole mapping replaces the file's
    cfg = load_config(demo, ["model.overrides.drop_rate=0.5"])
    assert cfg.model.overrides["drop_rate"] == 0.5 and cfg.model.overrides["depths"] == [1, 1, 2, 1]
    assert load_config(demo, ["model.overrides={drop_rate: 0.5}"]).model.overrides == {"drop_rate": 0.5}
    # --impl is the process-wide switch of ppma.ops, not a model setting
    overrides = config_from_args(parse_args(["--config", demo, "--impl", "fused"])).model.overrides
    assert overrides["embed_dims"] == [32, 64, 96, 128] and "impl" not in overrides


def test_weight_decay_groups():
    """Weight decay on matrices and conv kernels only, never on 1-D parameters or biases (docs/model.md §6.1)."""
    from ppma.train.build import build_optimizer

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))
    model(torch.randn(1, 3, 5, 5))
    opt = build_optimizer(model, load_config().optim, lr=1e-3)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.ndim > 1 and not name.endswith(".bias")), name



def test_weight_decay_groups_follow_the_official_recipe_on_ppma():
    """dt_bias / A_log / norms / biases undecayed; layer-scale gammas decayed (4-D in the official model)."""
    import ppma
    from ppma.train.build import build_optimizer

    model = ppma.create_model("ppma_tiny", num_classes=3, embed_dims=(16, 16, 16, 16), depths=(1, 1, 1, 1),
                              num_heads=(1, 1, 1, 1), layerscale=(True, True, True, True))
    opt = build_optimizer(model, load_config().optim, lr=1e-3)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = dict(model.named_parameters())
    assert any(n.endswith("ls1.gamma") for n in names)
    for name, p in names.items():
        expect = name.endswith((".ls1.gamma", ".ls2.gamma")) or (p.ndim > 1 and not name.endswith(".bias"))
        assert (id(p) in decayed) == expect, name


def test_adam_takes_the_fused_step_where_the_device_has_one():
    """AdamW runs torch's fused step on CPU parameters by default (``optim.fused`` None), not when ``fused=False``;
    ``fused=True`` with another optimiser is an error; the fused and multi-tensor updates agree up to rounding."""
    from ppma.train.build import build_optimizer

    cfg = load_config().optim
    torch.manual_seed(0)
    models = [torch.nn.Linear(6, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build_optimizer(models[0], cfg, lr=1e-2),
            build_optimizer(models[1], dataclasses.replace(cfg, fused=False), lr=1e-2)]
    assert opts[0].defaults["fused"] is True and not opts[1].defaults.get("fused")
    x = torch.randn(5, 6)
    for _ in range(3):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="optim.fused=True needs"):
        build_optimizer(models[0], dataclasses.replace(cfg, opt="sgd", fused=True), lr=1e-2)


# ------------------------------------------------------------------------------------------------ training


def test_few_steps_reduce_loss_and_metrics_format(tmp_path):
    summary = train(config_from_args(parse_args(tiny_args(tmp_path, epochs=4))))
    lines = (tmp_path / "metrics.jsonl").read_text().strip().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["epoch"] for r in records] == [0, 1, 2, 3]
    for r in records:
        for key in ("epoch", "train_loss", "lr", "test_acc1", "test_acc5", "test_ema_acc1", "images_per_sec"):
            assert key in r, key
        assert 0.0 <= r["test_acc1"] <= r["test_acc5"] <= 100.0
        assert r["images_per_sec"] > 0 and r["lr"] > 0
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert summary["best_acc1"] == max(r["test_acc1"] for r in records)
    assert (tmp_path / "checkpoint.pth").is_file() and (tmp_path / "best.pth").is_file()
    assert not list(tmp_path.glob(".*.tmp.*"))  # atomic writes leave no temporary file
    ckpt = load_checkpoint(str(tmp_path / "checkpoint.pth"))  # weights_only=True
    assert ckpt["epoch"] == 3 and ckpt["model_ema"] is not None and len(ckpt["rng"]) == 1
    for key in ("model", "optimizer", "scheduler", "scaler", "global_step", "config", "best"):
        assert key in ckpt


def test_compiled_training_on_the_cpu(tmp_path):
    """``train.compile=true`` on the CPU: ppma's recipe (``ppma.compile.compile_model``, training graphs, then
    no-grad graphs for the evaluation) trains, evaluates and saves the plain module's weights."""
    torch._dynamo.reset()
    summary = train(config_from_args(parse_args(tiny_args(tmp_path, epochs=1, extra=["--set", "train.compile=true"]))))
    record = json.loads((tmp_path / "metrics.jsonl").read_text().strip().splitlines()[-1])
    assert math.isfinite(record["train_loss"]) and 0.0 <= summary["best_acc1"] <= 100.0
    ckpt = load_checkpoint(str(tmp_path / "checkpoint.pth"))
    assert not any(k.startswith("_orig_mod.") for k in ckpt["model"])


def test_resume_is_bit_exact(tmp_path):
    """2 epochs in one go == 1 epoch, then --resume, then 1 more (CPU, num_workers=0)."""
    extra = ["--set", "aug.affine_degrees=10", "--set", "aug.smoothing=0.1"]  # RNG users: dropout, shuffling
    full, part = tmp_path / "full", tmp_path / "part"
    train(config_from_args(parse_args(tiny_args(full, epochs=2, extra=extra))))
    # The first half: the same 2-epoch run (same schedule), stopped after epoch 0.
    args = tiny_args(part, epochs=2, extra=extra)
    first = config_from_args(parse_args(args))
    first.train.stop_after_epoch = 0
    train(first)
    assert json.loads((part / "metrics.jsonl").read_text().splitlines()[-1])["epoch"] == 0
    with open(part / "metrics.jsonl", "a") as f:  # a stale line from a run that died after logging epoch 1
        f.write(json.dumps({"epoch": 1, "train_loss": -1.0}) + "\n")
    resumed = config_from_args(parse_args(args + ["--resume", str(part / "checkpoint.pth")]))
    assert resumed.train.resume == str(part / "checkpoint.pth")
    train(resumed)
    a, b = load_checkpoint(str(full / "checkpoint.pth")), load_checkpoint(str(part / "checkpoint.pth"))
    assert b["epoch"] == a["epoch"] == 1
    for name in ("model", "model_ema"):
        for key, value in a[name].items():
            assert torch.equal(value, b[name][key]), f"{name}.{key} differs after resume"
    fa = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    fb = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in fb] == [0, 1]  # the resumed run appended epoch 1
    assert [r["train_loss"] for r in fa] == [r["train_loss"] for r in fb]
    assert [r["test_acc1"] for r in fa] == [r["test_acc1"] for r in fb]


def write_image_folder(root, classes=4, per_class=3, size=20, split="val", seed=0):
    """``root/<split>/class_<c>/<i>.png``: random RGB images, ``classes * per_class`` of them (returned)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        d = root / split / f"class_{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(d / f"{i}.png")
    return classes * per_class


def assert_same_state(a, b, what: str) -> None:
    """Nested checkpoint entries (dicts, lists, tensors, numbers) equal, tensors bitwise."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{what} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: keys differ"
        for k in a:
            assert_same_state(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def imagenet_recipe_args(data, out, epochs=3) -> list[str]:
    """The ImageNet config (mixup 0.8, cutmix 1.0, RandAugment, random erasing, repeated augmentation x3, EMA,
    AdamW) on a tiny ImageFolder with a tiny model, two loader workers, fp32."""
    return ["--config", os.path.join(ROOT, "configs", "classification", "ppma_tiny_imagenet.yaml"),
            "--data", str(data), "--epochs", str(epochs), "--batch-size", "4", "--amp", "none", "--device", "cpu",
            "--num-workers", "2", "--output", str(out), "--no-progress",
            "--set", "data.img_size=24", "--set", "data.repeated_aug_round=4", "--set", "sched.warmup_epochs=1",
            "--set", "ema.decay=0.9", "--set", "train.num_threads=1", *model_args()]


def test_resume_is_bit_exact_under_the_imagenet_recipe(tmp_path):
    """README "Training": --resume continues bit for bit, under the real recipe: mixup 0.8 / cutmix 1.0,
    repeated augmentation x3, two loader workers, ``--resume auto``. Three epochs in one go == one epoch, stop,
    ``--resume auto`` for the other two: model, EMA, optimizer, scheduler and the logged losses identical."""
    from ppma.train.cli.train import main

    data = tmp_path / "data"
    write_image_folder(data, classes=4, per_class=4, size=28, split="train")
    write_image_folder(data, classes=4, per_class=2, size=28, split="val", seed=1)
    cfg = config_from_args(parse_args(imagenet_recipe_args(data, tmp_path / "x")))
    assert (cfg.aug.mixup, cfg.aug.cutmix, cfg.data.repeated_aug, cfg.data.num_workers) == (0.8, 1.0, 3, 2)
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(imagenet_recipe_args(data, full)) == 0
    assert main(imagenet_recipe_args(data, part) + ["--set", "train.stop_after_epoch=0"]) == 0
    assert load_checkpoint(str(part / "checkpoint.pth"))["epoch"] == 0
    assert main(imagenet_recipe_args(data, part) + ["--resume", "auto"]) == 0
    a, b = load_checkpoint(str(full / "checkpoint.pth")), load_checkpoint(str(part / "checkpoint.pth"))
    assert a["epoch"] == b["epoch"] == 2
    for key in ("model", "model_ema", "optimizer", "scheduler", "global_step", "best"):
        assert_same_state(a[key], b[key], key)
    fa = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    fb = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in fb] == [0, 1, 2]
    assert [r["train_loss"] for r in fa] == [r["train_loss"] for r in fb]
    assert [r["test_ema_acc1"] for r in fa] == [r["test_ema_acc1"] for r in fb]


def _kill_run(proc, run_id: str) -> None:
    """Kill torchrun (its process group) and every worker of this run: torchrun starts each worker in a
    session of its own, so they are found by ``PPMA_TEST_RUN_ID`` in their environment (Linux /proc)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"PPMA_TEST_RUN_ID={run_id}".encode() in f.read().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def test_ddp_two_cpu_processes(tmp_path):
    """torchrun with 2 gloo processes for a few steps; distributed eval covers the whole val set once."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "ppma.train", *tiny_args(tmp_path, epochs=2, extra=["--device", "cpu"])]
    run_id = uuid.uuid4().hex
    env["PPMA_TEST_RUN_ID"] = run_id  # inherited by the workers, to find them
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        _kill_run(proc, run_id)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail("2-process run timed out:\n" + stdout[-3000:] + stderr[-3000:])
    finally:
        _kill_run(proc, run_id)  # never leave a worker behind
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "world 2" in stdout
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    ckpt = load_checkpoint(str(tmp_path / "checkpoint.pth"))
    assert len(ckpt["rng"]) == 2  # one RNG state per process
    assert not any(k.startswith("module.") for k in ckpt["model"])
    # distributed evaluation is exact: re-evaluate the saved model in one process and compare
    from ppma.train.build import build_model
    from ppma.train.data import build_datasets
    from ppma.train.engine import evaluate

    cfg = TrainConfig.from_dict(ckpt["config"])
    model = build_model(cfg.model, ckpt["num_classes"], ckpt["in_chans"])
    model.load_state_dict(ckpt["model"])
    _, val, _ = build_datasets(cfg, need_train=False)
    ev = evaluate(model, val, torch.device("cpu"), batch_size=5)
    assert ev["acc1"] == pytest.approx(records[-1]["test_acc1"])


def _torchrun(args, timeout=150, kill_when=None):
    """``torchrun --nproc_per_node=2 -m ppma.train *args`` (gloo, CPU); ``kill_when``: a callable polled every
    50 ms, True: SIGKILL the launcher and both workers (then the return code is None). Returns (rc, output)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    run_id = uuid.uuid4().hex
    env["PPMA_TEST_RUN_ID"] = run_id  # inherited by the workers, to find them
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ppma.train",
           *args]
    log = open(os.path.join(os.path.dirname(args[args.index("--output") + 1]), f"torchrun-{run_id}.log"), "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    killed = False
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                _kill_run(proc, run_id)
                log.seek(0)
                pytest.fail("2-process run timed out:\n" + log.read()[-4000:])
            if kill_when is not None and kill_when():
                _kill_run(proc, run_id)
                killed = True
                break
            time.sleep(0.05)
        proc.wait(timeout=30)
    finally:
        _kill_run(proc, run_id)  # never leave a worker behind
    log.seek(0)
    out = log.read()
    log.close()
    return (None if killed else proc.returncode), out


def test_ddp_killed_and_resumed_is_bit_exact(tmp_path):
    """Two gloo processes killed (SIGKILL, launcher and workers) once an epoch's checkpoint exists, then
    ``--resume auto``: the final model, EMA, optimizer and logged losses equal those of an uninterrupted run."""
    epochs = 3
    full, part = tmp_path / "full", tmp_path / "part"
    extra = ["--device", "cpu", "--set", "data.synthetic_train_size=96"]
    rc, out = _torchrun(tiny_args(full, epochs=epochs, extra=extra))
    assert rc == 0, out[-4000:]
    ckpt = part / "checkpoint.pth"
    rc, out = _torchrun(tiny_args(part, epochs=epochs, extra=extra), kill_when=ckpt.is_file)
    assert rc is None, "the run ended before it could be killed:\n" + out[-2000:]
    killed_at = load_checkpoint(str(ckpt))["epoch"]
    assert killed_at < epochs - 1, f"killed after the last epoch ({killed_at}): nothing left to resume"
    rc, out = _torchrun(tiny_args(part, epochs=epochs, extra=[*extra, "--resume", "auto"]))
    assert rc == 0, out[-4000:]
    assert f"at epoch {killed_at + 1}" in out and "resumed from" in out, out[-2000:]
    a, b = load_checkpoint(str(full / "checkpoint.pth")), load_checkpoint(str(ckpt))
    assert a["epoch"] == b["epoch"] == epochs - 1
    for key in ("model", "model_ema", "optimizer", "scheduler", "global_step", "rng"):
        assert_same_state(a[key], b[key], key)
    fa = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    fb = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in fb] == list(range(epochs))
    assert [r["train_loss"] for r in fa] == [r["train_loss"] for r in fb]
    assert [r["test_acc1"] for r in fa] == [r["test_acc1"] for r in fb]


# ------------------------------------------------------------------------------------------------ data


def test_digits_split_and_affine():
    from ppma.train.data import BatchAffine, build_digits

    train_set, test_set = build_digits(img_size=24)
    assert (len(train_set), len(test_set)) == (1437, 360)
    assert train_set.images.shape[1:] == (1, 24, 24) and test_set.images.shape[1:] == (1, 24, 24)
    # stratified: every class has 35-37 test images
    counts = torch.bincount(test_set.targets, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    # fixed split: the same call gives the same tensors
    _, again = build_digits(img_size=24)
    assert torch.equal(again.images, test_set.images)
    x = train_set.images[:8]
    assert BatchAffine()(x) is x  # inactive: identity
    aug = BatchAffine(degrees=10, translate=0.1, scale=(0.9, 1.1), shear=5, fill=float(x.min()))
    torch.manual_seed(0)
    y1 = aug(x)
    torch.manual_seed(0)
    y2 = aug(x)
    assert y1.shape == x.shape and torch.equal(y1, y2) and not torch.equal(y1, x)
    # pixels moved in from outside take the background value: a blank image stays blank
    blank = torch.full_like(x, float(x.min()))
    torch.testing.assert_close(aug(blank), blank)
