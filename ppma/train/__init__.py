"""Training, evaluation, benchmarking and visualisation for PPMA classifiers (docs/model.md §6.1).

The library: ``config`` (the typed config schema, :func:`~ppma.train.config.load_config`), ``trainer``
(:func:`~ppma.train.trainer.train` in named steps), ``engine`` (one training epoch, evaluation), ``build``
(model, optimiser, schedule, loss), ``data``, ``checkpoint``, ``distributed``, ``benchmark``, ``visualize``.
The command-line tools are in ``ppma.train.cli``: ``ppma-train`` (= ``python -m ppma.train``), ``ppma-eval``,
``ppma-benchmark`` and ``ppma-visualize``.
Needs the ``train`` extras (timm, torchvision, scikit-learn, matplotlib, omegaconf); ``import ppma`` does not.
"""
