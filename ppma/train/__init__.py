"""Training, evaluation, benchmarking and visualisation for PPMA classifiers.

Command-line entry points: ``ppma-train`` (``ppma.train.main``), ``ppma-eval`` (``ppma.train.evaluate``),
``ppma-benchmark`` (``ppma.train.benchmark``) and ``ppma-visualize`` (``ppma.train.visualize``).
Needs the ``train`` extras (timm, torchvision, scikit-learn, matplotlib); ``import ppma`` does not.
"""
