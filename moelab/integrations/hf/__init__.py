"""Routing inside Hugging Face transformers (>= 5) mixture-of-experts models (extra ``hf``).

transformers is imported lazily, with the offline switches set first
(:func:`~moelab.integrations.hf.families.import_transformers`).

- :mod:`.folder`: what is read from a model folder, checked before transformers sees it
  (no custom code unless ``trust_remote_code``, safetensors and tokenizer.json only);
- :mod:`.families`: the supported families, their routing semantics, :func:`moe_routers`;
- :mod:`.rules`: the written-out rules of the families without a row of their own,
  checked on the router (:func:`~.rules.infer_rule`).
- :mod:`.stats`: routing statistics with forward hooks on the routers, and the budget sweep.
- :mod:`.swap`: the router swap and fine-tuning; :mod:`.saved`: saving a swapped model
  (``save_swapped``, ``load_swapped``).
- :mod:`.replay`: routing replay of the models' own routers (:func:`record_hf`,
  :func:`replay_hf`), in the record format of :mod:`moelab.diagnostics.replay`.
- :mod:`.export`: a moelab run written as a transformers folder (``moelab export``):
  native qwen2_moe, or moelab's own model as remote code (:mod:`.remote`).
"""

from moelab.integrations.hf import saved as _saved  # noqa: F401 - swapped models' save_pretrained
from moelab.integrations.hf.families import (
    FAMILIES,
    Family,
    RouterSite,
    UnsupportedModelError,
    family_of,
    moe_routers,
    route,
    route_site,
    stats_probs,
    top_k,
)
from moelab.integrations.hf.replay import record_hf, replay_hf

__all__ = [
    "FAMILIES",
    "Family",
    "RouterSite",
    "UnsupportedModelError",
    "family_of",
    "moe_routers",
    "record_hf",
    "replay_hf",
    "route",
    "route_site",
    "stats_probs",
    "top_k",
]
