"""The shape legend: one meaning per letter across moelab.

moelab names a tensor by its shape: ``probs_TE`` is (tokens, experts), ``ids_TK``
(tokens, slots), ``x_BSD`` (batch, sequence, model width). A 0-d tensor has no suffix; a
digit is a dimension of that literal size (``total_T1``: a kept dimension of size 1,
``a_T2``: two coefficients). Each letter means one thing everywhere (:data:`LETTERS`); a
module whose names carry shape suffixes says which letters it uses in one line of its
docstring, ``Shape suffixes: T, E, K (moelab.shapes).``, and a new file takes its letters
from here.

Some parameter and buffer names are checkpoint keys of saved runs (or read by the code of
exported Hugging Face folders) and keep the letters they were saved with
(:data:`KEPT_NAMES`); a local variable never uses a letter in another sense.
"""

from __future__ import annotations

__all__ = ["KEPT_NAMES", "LETTERS"]

LETTERS: dict[str, str] = {
    "B": "batch (sequences of a batch)",
    "S": "sequence positions (flattened with B into T)",
    "T": "tokens: batch and sequence flattened, T = B * S (the tokens of one router call)",
    "D": "model width (d_model)",
    "F": "hidden width of one expert or of the dense feed-forward (d_ff)",
    "H": "query heads",
    "Z": "key/value heads of grouped-query attention (H = Z * (H // Z))",
    "C": "width of one attention head (D // H)",
    "V": "vocabulary (token ids)",
    "E": "experts (the E real ones)",
    "M": "null experts (a router with M null experts scores E + M)",
    "K": "selection slots per token (top_k, or the cap of a truncating rule)",
    "J": "all slots, T * K flattened (token-major j = t * K + k unless the code says otherwise)",
    "N": "rows sent to the experts (the computed slots), sorted by expert",
    "O": "capacity: tokens per expert (expert choice's top tokens of each expert)",
    "A": "candidates of sampled top-K (the top K + c, sample_extra = c)",
    "G": "expert groups of group-limited choice (n_groups)",
    "P": "experts per group (E / G)",
    "U": "kept groups (topk_groups)",
    "L": "MoE layers (a learned per-layer budget k_L)",
    "R": "ranks of the expert-parallel group",
    "X": "experts on one rank (E / R)",
    "Q": "rows one rank's experts receive from the group",
    "W": "rows sampled from T (the temperature study's nearest-neighbour search)",
    "Y": "point pairs of the temperature study's Lipschitz check",
}
"""Each shape letter and the dimension it names."""

KEPT_NAMES: dict[str, str] = {
    "w_gate_HD": "SharedExperts' stacked gate projections: H is the N shared experts' "
    "hidden width, N * F (a checkpoint key)",
    "w_up_HD": "SharedExperts' stacked up projections: H as in w_gate_HD (a checkpoint key)",
    "w_down_DH": "SharedExperts' down projections side by side: H as in w_gate_HD (a "
    "checkpoint key)",
    "w_MCD": "a constant null expert's mixing matrices: C is its two mixing coefficients "
    "(a checkpoint key)",
}
"""Parameter names saved in checkpoints whose letters predate :data:`LETTERS`: each
name and what its letters mean."""
