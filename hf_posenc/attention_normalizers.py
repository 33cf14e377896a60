"""The attention-normalizer catalogue: how raw scores ``b_ij`` become attention weights ``a_ij``.

Source: Su Jianlin, "A hidden flaw of relative position encodings" (kexue.fm/archives/9105, "F" below). With softmax
every row of weights sums to 1, so n identical tokens under a relative-only scheme give n identical outputs; every
other normalizer here (and the Toeplitz gate, an option of each) lets the row sums vary with the position, except
``ssmax``, a softmax of rescaled scores (equal scores stay equal).

A normalizer sees scores whose masked keys (padding, causal) are already ``finfo.min``, and must give them a weight
of exactly 0; the attention composition guarantees every row it sees has a visible key, and sets rows without one
to 0 itself. Weights are computed in at least float32 whatever the model dtype.

Initialisation (F: "with the standard Attention + FFN block, l2 needs a smaller initial variance of W_V, W_O").
At init the scores are near 0, so the weights of a row of ``n`` keys are near uniform and the output is
``(sum_j a_j) v`` for equal values (``||a||_2 std(v)`` for independent ones). Softmax gives ``sum_j a_j = 1``
(``||a||_2 = 1/sqrt(n)``); a normalizer whose output is ``r(n)`` times softmax's scales W_V and W_O each by
``r(n)^(-1/2)``, with ``n = max_positions`` (the longest row), so the attention output at full length starts at
softmax's scale. ``value_init_scale()`` gives that factor per normalizer.
"""

from __future__ import annotations

from .normalizer_interface import AttentionNormalizer
from .softmax_free_normalizers import L2, Exp, ReLU2, Sigmoid, StickBreaking, SwishL2
from .softmax_normalizers import Differential, ScalableSoftmax, Softmax, Softpick


ATTENTION_NORMALIZERS: dict[str, type[AttentionNormalizer]] = {
    normalizer.name: normalizer
    for normalizer in (
        Softmax,
        L2,
        Exp,
        ReLU2,
        SwishL2,
        Sigmoid,
        ScalableSoftmax,
        Softpick,
        StickBreaking,
        Differential,
    )
}
