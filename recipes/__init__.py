"""hf_posenc's application: the recipes, one script each, installed as the package ``hf_posenc_recipes``.

``pretrain.py``, ``compare.py`` (the main job), ``extrapolate.py``, ``glue.py``, ``probe.py`` and ``retrofit.py`` are
the recipes; each runs as a script (``python recipes/pretrain.py --help``, ``accelerate launch recipes/pretrain.py
...``), as ``hf-posenc <recipe>`` (:mod:`hf_posenc_recipes.cli`, the front door) and as ``python -m
hf_posenc_recipes <recipe>``. Beside them: ``long_context.py`` and ``tasks.py`` (the long-context tasks that compare
and extrapolate run), ``reporting.py`` (what compare, extrapolate and the tasks share: run names, table cells, model
labels), ``common.py`` (the accelerator, threads, inputs, the Hub), ``parsers/`` (every recipe's flags, standard
library only), ``registry.py`` (the recipes by name), ``catalogue.py`` (scheme names and options without torch),
``data/emma.txt.xz`` (the embedded corpus) and ``metrics/glue`` (GLUE's metrics as an ``evaluate`` module).
"""
