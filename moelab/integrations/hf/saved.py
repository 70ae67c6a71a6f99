"""Saving a Hugging Face model whose routers were swapped, and loading it back.

:func:`save_swapped` writes a folder that is at once

- a plain transformers folder of the original architecture (``config.json``,
  ``model.safetensors``, ``generation_config.json``): every tensor of the model under its
  original name and shape. The swapped routers are stored as the HF router modules they
  replaced: the HF ``weight`` holds the moelab Router's current weight for the E real
  experts, GPT-OSS's router ``bias`` its scorer bias (zeros when the Router has none) and
  DeepSeek-V3's ``e_score_correction_bias`` its selection bias. So
  ``AutoModelForCausalLM.from_pretrained(folder)`` loads it without a missing or an
  unexpected key, and gives the model with **the family's own routing** (softmax /
  sigmoid top-k) on the fine-tuned router weights: a sparse map, a temperature, null
  experts, a threshold rule or a selection bias of another family are not part of it.
  transformers cannot know that, so the save warns (a UserWarning naming
  :func:`load_swapped` and what differs) when a layer's swapped router does not route as
  that plain load would, checked on probe states
  (:meth:`~moelab.integrations.hf.swap.SwappedRouter.own_router`).
- the moelab routing, beside it: ``moelab_routers.json`` (the format version, moelab's
  version, the family, and per MoE layer the router's qualified name, its full
  RouterConfig and its non-tensor state, ``top_k`` and the cut ``truncation``) and
  ``moelab_routers.safetensors`` (every Router's state dict, keyed ``layer_NN.<name>``:
  the weight and scorer bias with their null-expert rows, the selection ``bias`` of
  loss-free balancing, the temperature schedule's ``tau`` / ``step`` / ``v`` /
  ``sigma_hat``, ReLU routing's ``l1_coef``).

:func:`load_swapped` loads the HF model, swaps its routers with the saved configs (layer
by layer) and loads the Routers' state strictly, after checking that the saved layers
match the model's: the same number of MoE layers, the same router names, the same tensor
names and shapes. Anything else is a ValueError that says what differs; nothing is ever
loaded in part.

Not saved (it does not outlive a step): a Router's ``l1_sparsity`` (the zero-gate
fraction the adaptive L1 last moved by, a non-persistent buffer that the next
:func:`~moelab.integrations.hf.swap.step_swapped` recomputes), a swapped router's latest
output (``SwappedRouter.last``, read by ``moelab_aux_loss``: run a forward first) and the
train / eval mode (``load_swapped`` returns the model in eval mode, as
``from_pretrained`` does). The optimiser's state is the caller's to save. The swap sets
``output_router_logits = False`` in the model's config, and the saved ``config.json``
says so.

The folder is built in a temporary sibling folder and renamed into place, so a crash
leaves the old folder or the new one, never half of one. ``path`` must be missing, empty,
or a previous save holding nothing but the files that save wrote (listed in its
``moelab_routers.json``); anything else is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moelab._io import write_json
from moelab.runs.folders import staged_folder

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ROUTERS_JSON",
    "ROUTERS_WEIGHTS",
    "load_swapped",
    "save_swapped",
]

FORMAT = "moelab-swapped-routers"
FORMAT_VERSION = 1
"""Version of ``moelab_routers.json``; :func:`load_swapped` reads this and older ones."""
ROUTERS_JSON = "moelab_routers.json"
ROUTERS_WEIGHTS = "moelab_routers.safetensors"

_NOT_SAVED = {
    "l1_sparsity": "ReLU routing's zero-gate fraction of the latest step (a non-persistent "
    "buffer); the next step_swapped recomputes it",
    "last": "the swapped router's latest RouterOutput; run a forward before moelab_aux_loss",
    "training": "the train / eval mode; load_swapped returns the model in eval mode",
}


# ------------------------------------------------------------------ the folder


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if not p.name.startswith("."))


def _check_path(path: Path) -> None:
    """FileExistsError unless ``path`` is missing, empty or a previous save that holds
    only the files it wrote. Dot files count (a ``.git`` of a cloned model repository):
    saving replaces the whole folder."""
    if not path.exists():
        return
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file, not a folder: give a folder to save into")
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return
    written: set[str] = set()
    doc = read_json_or_none(path / ROUTERS_JSON)
    if isinstance(doc, dict) and doc.get("format") == FORMAT:
        written = set(doc.get("files", []))
    foreign = [n for n in names if n not in written]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        what = (
            "files its previous save_swapped did not write"
            if written
            else "files save_swapped did not write"
        )
        raise FileExistsError(
            f"{path} holds {what} ({shown}); saving replaces the whole folder: give an "
            "empty or new folder, or move those files out"
        )


def read_json_or_none(path: Path) -> Any:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


# ------------------------------------------------------------------ save


def _swapped_sites(model: nn.Module) -> list[tuple[str, Any]]:
    from moelab.integrations.hf.swap import SwappedRouter

    return [(n, m) for n, m in model.named_modules() if isinstance(m, SwappedRouter)]


def _reference_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict (on the meta device: names, shapes, dtypes) of the unswapped
    architecture, built from the model's config: what a plain from_pretrained expects."""
    with torch.device("meta"):
        ref = type(model)._from_config(copy.deepcopy(model.config), dtype=model.dtype)
    return ref.state_dict()


def _hf_tensor(name: str, key: str, swapped: Any, like: torch.Tensor) -> torch.Tensor:
    """The value of the HF router tensor ``key`` (of the router ``name``) from the
    swapped router: its moelab Router's first E rows (the real experts; null-expert rows
    have no HF place); a token id -> experts table (DeepSeek-V4's ``tid2eid``) the one
    the model had at the swap (:attr:`SwappedRouter.own_table`)."""
    router = swapped.router
    n = int(like.shape[0])  # the HF rows: the E real experts (LongCat: E + its zero experts)
    if key == "weight" or key.endswith(".weight"):  # the gate: weight, classifier.weight, ...
        value = router.weight[:n]
    elif key == "bias":  # GPT-OSS: the scores' bias
        sb = router.scorer_bias
        value = sb[:n] if sb is not None else torch.zeros(n, device=router.weight.device)
    elif key == "e_score_correction_bias":  # DeepSeek-V3 and others: the choice's bias
        value = router.bias[:n]
    elif key == "tid2eid" and getattr(swapped, "own_table", None) is not None:
        value = swapped.own_table
    else:
        raise ValueError(
            f"the HF router {name} has a tensor {key!r} that save_swapped does not know how "
            "to fill from a moelab Router; only its gate weight, bias, "
            "e_score_correction_bias and token table tid2eid are mapped"
        )
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(
            f"{name}.{key}: the moelab Router gives shape {tuple(value.shape)}, the model "
            f"expects {tuple(like.shape)}"
        )
    return value.detach().to(like.dtype).clone().contiguous()


def _hf_state(model: nn.Module, sites: list[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """The model's state dict in the original architecture's names: the swapped routers'
    entries replaced by the HF router tensors they stand for."""
    prefixes = tuple(f"{name}." for name, _ in sites)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}
    ref = _reference_state(model)
    for name, swapped in sites:
        for key, like in ref.items():
            if key.startswith(f"{name}."):
                state[key] = _hf_tensor(name, key[len(name) + 1 :], swapped, like)
    missing = sorted(set(ref) - set(state))
    extra = sorted(set(state) - set(ref))
    if missing or extra:
        raise ValueError(
            "the swapped model's tensors do not match its architecture's: "
            f"missing {missing[:5]}, unexpected {extra[:5]}"
        )
    return state


def _router_state(index: int, router: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors keyed layer_NN.<name>, the non-tensor entries)`` of one Router's state
    dict (the latter: its ``_extra_state``, top_k and truncation)."""
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, Any] = {}
    for key, value in router.state_dict().items():
        if isinstance(value, torch.Tensor):
            tensors[f"layer_{index:02d}.{key}"] = value.detach().cpu().clone().contiguous()
        else:
            other[key] = value
    return tensors, other


_TRAINING_KEYS = frozenset(
    (
        "init_std", "aux_weight", "aux_probs", "aux_count", "z_loss_weight", "entropy_loss_weight",
        "aux_scope", "bias_rate", "bias_update", "bias_ema", "l1_rate", "l1_init",
        "null_target", "noise_std", "jitter", "sample_extra", "temperature", "schedule",
        "lipschitz_target", "tau_min", "tau_final", "anneal_steps",
    )
)  # fmt: skip
"""RouterConfig keys that do not change an eval-mode forward by themselves (losses,
training noise, the schedules of state that :func:`_differences` reads itself)."""


@torch.no_grad()
def _routes_as_own(swapped: Any, bias_saved: bool) -> bool:
    """Whether the swapped router chooses the experts and gate weights that a plain load
    of the saved folder does (:meth:`SwappedRouter.own_router`), in eval mode on probe
    states (float32, 1e-5); True when the own rule is not known."""
    from moelab.integrations.hf.rules import probe_states, probe_token_ids
    from moelab.integrations.hf.swap import SwappedRouter

    if getattr(swapped, "own", None) is None:  # unknown (a router swapped by an older moelab)
        return True
    plain = swapped.own_router(bias_saved)
    if plain is None:
        return True
    mine = swapped.router
    x = probe_states(mine.weight.detach().float())
    table = getattr(swapped, "own_table", None)
    ids = None if table is None else probe_token_ids(int(table.shape[0])).to(x.device)
    was = mine.training
    mine.eval()
    try:
        routed = [
            SwappedRouter(r, swapped.family, swapped.form).route(x, ids)[1:] for r in (mine, plain)
        ]
    finally:
        mine.train(was)
    width = max(mine.weight.shape[0], plain.weight.shape[0])
    dense = [
        torch.zeros(x.shape[0], width, dtype=torch.float32, device=x.device).scatter_add(
            1, ids, weights.float()
        )
        for weights, ids in routed
    ]
    return torch.allclose(dense[0], dense[1], rtol=1e-5, atol=1e-5)


def _differences(swapped: Any, bias_saved: bool) -> list[str]:
    """``key=value`` of what makes the swapped router route otherwise than its layer's own
    rule: its RouterConfig keys that differ from :attr:`SwappedRouter.own` (not those of
    :data:`_TRAINING_KEYS`), a temperature, a ``top_k`` or a cut set on the Router, a
    selection bias the plain folder lacks."""
    own, router = swapped.own, swapped.router
    theirs = dataclasses.asdict(own)
    differ = [
        f"{k}={v!r}"
        for k, v in dataclasses.asdict(router.config).items()
        if k not in _TRAINING_KEYS and theirs.get(k) != v
    ]
    named = {d.split("=")[0] for d in differ}
    tau = router.temperature.value
    if tau != 1.0:
        differ.append(f"temperature {tau:.4g}")
    if "top_k" not in named and router.top_k != own.router_top_k:
        differ.append(f"top_k={router.top_k!r}")
    if "truncation" not in named and router.truncation != own.truncation:
        differ.append(f"truncation={router.truncation!r}")
    own_bias = swapped.own_bias
    if not bias_saved and own_bias is not None:
        if not torch.equal(router.bias[: own_bias.shape[0]].detach().cpu(), own_bias.cpu()):
            differ.append("the selection bias (bias_rate)")
    return differ


def _warn_plain_load(
    model: nn.Module, sites: list[tuple[str, Any]], hf_keys: set[str], path: Path, stack: int
) -> None:
    """A UserWarning when a plain ``from_pretrained`` of the saved folder would route
    otherwise than the swapped routers (``hf_keys``: the names of the tensors saved in
    the model's layout): only load_swapped restores them."""
    import warnings

    off = []
    for name, swapped in sites:
        bias_saved = f"{name}.e_score_correction_bias" in hf_keys
        if not _routes_as_own(swapped, bias_saved):
            off.append(_differences(swapped, bias_saved) or ["its routing"])
    if not off:
        return
    keys = list(dict.fromkeys(k for d in off for k in d))
    shown = ", ".join(keys[:6]) + (", ..." if len(keys) > 6 else "")
    family = getattr(model.config, "model_type", None) or type(model).__name__
    warnings.warn(
        f"{path}: the moelab routers of {len(off)} of the {len(sites)} MoE layers route "
        f"otherwise than {family}'s own routing ({shown}); transformers' "
        f"from_pretrained({str(path)!r}) loads their weights with {family}'s own routing "
        f"instead: load the folder with moelab.integrations.hf.saved.load_swapped (or read "
        f"it with moelab stats / eval / analyze --hf), which routes as saved",
        UserWarning,
        stacklevel=stack + 1,
    )


def save_swapped(model: nn.Module, path: str | Path, **save_pretrained_kwargs: Any) -> Path:
    """Save a model with swapped routers (:func:`~moelab.integrations.hf.swap.swap_routers`)
    to the folder ``path`` (see the module docstring for what the folder holds and why);
    returns the path. ``save_pretrained_kwargs`` go to transformers' ``save_pretrained``
    (``max_shard_size``, ...), except ``state_dict`` (the model's own is saved) and
    ``push_to_hub`` (save first, then upload the folder). ``model.save_pretrained(path)``
    of a swapped model calls this.

    A plain transformers ``from_pretrained(path)`` gives the family's own routing: when
    that is not how the swapped routers route (another map, cut, top_k, temperature, ...;
    the keys that differ from the family's), the save warns (a UserWarning naming
    :func:`load_swapped`, which restores them).

    Raises:
        ValueError: a model without swapped routers, or a keyword this cannot take.
        FileExistsError: ``path`` holds files a previous save did not write.
    """
    return _save_swapped(model, path, 2, save_pretrained_kwargs)


def _save_swapped(
    model: nn.Module, path: str | Path, stack: int, save_pretrained_kwargs: dict[str, Any]
) -> Path:
    """:func:`save_swapped`; ``stack``: the caller's frame for the warning, counted from
    this function's caller."""
    from safetensors.torch import save_file

    from moelab import __version__

    sites = _swapped_sites(model)
    if not sites:
        raise ValueError(
            "the model has no swapped router: save it with model.save_pretrained(path), "
            "or call swap_routers(model, ...) first"
        )
    for key in ("state_dict", "push_to_hub"):
        if save_pretrained_kwargs.get(key):
            raise ValueError(
                f"save_swapped does not take {key}=: it saves the model's own state "
                "locally (upload the finished folder yourself)"
            )
    if not save_pretrained_kwargs.get("is_main_process", True):
        return Path(path)  # another rank saves
    path = Path(path)
    _check_path(path)
    hf_state = _hf_state(model, sites)
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for index, (name, swapped) in enumerate(sites):
        router_tensors, other = _router_state(index, swapped.router)
        tensors.update(router_tensors)
        layers.append(
            {
                "layer": index,
                "name": name,
                "config": dataclasses.asdict(swapped.router.config),
                "state": other,
                "tensors": {k.split(".", 1)[1]: list(v.shape) for k, v in router_tensors.items()},
            }
        )
    with staged_folder(path, f".{path.name}.saving-{os.getpid()}") as staged:
        type(model).save_pretrained(  # the class's method, not the swap's replacement
            model, staged, state_dict=hf_state, **save_pretrained_kwargs
        )
        save_file(tensors, str(staged / ROUTERS_WEIGHTS), metadata={"format": FORMAT})
        files = sorted([*_entries(staged), ROUTERS_JSON])
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "moelab": __version__,
            "family": getattr(model.config, "model_type", None),
            "architecture": type(model).__name__,
            "layers": layers,
            "not_saved": _NOT_SAVED,
            "files": files,
        }
        write_json(staged / ROUTERS_JSON, doc, indent=1)
    _warn_plain_load(model, sites, set(hf_state), path, stack + 1)
    return path


# ------------------------------------------------------------------ load


def _read_routers(path: Path) -> dict[str, Any]:
    doc = read_json_or_none(path / ROUTERS_JSON)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a folder written by save_swapped ({ROUTERS_JSON} is missing or "
            "not moelab's): load a plain transformers folder with from_pretrained, and "
            "swap its routers with swap_routers"
        )
    version = doc.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"{path / ROUTERS_JSON} has format version {version!r}, this moelab reads up to "
            f"{FORMAT_VERSION}: upgrade moelab (the folder was written by moelab "
            f"{doc.get('moelab')})"
        )
    layers = doc.get("layers")
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        raise ValueError(f"{path / ROUTERS_JSON}: 'layers' must be a list of objects")
    return doc


def _saved_keys(entry: dict[str, Any], d_model: int, n_experts: int) -> dict[str, Any]:
    """The swap keys of one saved layer: its RouterConfig, with the keys an older moelab
    did not write at the values it routed with; ValueError if its width or expert count
    is not the model's."""
    from moelab.routing.config import RouterConfig, canonical_keys, implied_by_saved

    keys = canonical_keys(entry["config"])
    if (keys.get("d_model"), keys.get("n_experts")) != (d_model, n_experts):
        raise ValueError(
            f"router {entry['name']}: saved for d_model={keys.get('d_model')}, "
            f"n_experts={keys.get('n_experts')}; the model's router is ({n_experts}, "
            f"{d_model})"
        )
    try:
        keys.update(implied_by_saved(keys, RouterConfig(**keys)))
    except TypeError as err:
        raise ValueError(
            f"router {entry['name']}: its saved config has keys this moelab does not know "
            f"({err}); upgrade moelab"
        ) from err
    return {k: v for k, v in keys.items() if k not in ("d_model", "n_experts")}


def _layer_mismatch(doc: dict[str, Any], sites: list[Any]) -> str | None:
    saved = [x.get("name") for x in doc["layers"]]
    found = [s.name for s in sites]
    if len(saved) != len(found):
        return (
            f"{ROUTERS_JSON} holds {len(saved)} MoE layers, the model has {len(found)} "
            f"({', '.join(found[:4])}{', ...' if len(found) > 4 else ''})"
        )
    pairs = enumerate(zip(saved, found, strict=True))
    differ = [f"layer {i}: saved {a!r}, model {b!r}" for i, (a, b) in pairs if a != b]
    if differ:
        return "the router names differ: " + "; ".join(differ[:4])
    return None


def _check_tensors(saved: dict[str, torch.Tensor], routers: list[Any]) -> None:
    """ValueError naming every difference between the saved router tensors and the
    swapped Routers' state dicts (names and shapes)."""
    problems: list[str] = []
    seen: set[str] = set()
    for index, swapped in enumerate(routers):
        prefix = f"layer_{index:02d}."
        want = {
            k: tuple(v.shape)
            for k, v in swapped.router.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
        have = {k[len(prefix) :]: tuple(v.shape) for k, v in saved.items() if k.startswith(prefix)}
        seen.update(prefix + k for k in have)
        for k in sorted(set(want) - set(have)):
            problems.append(f"{prefix}{k} missing")
        for k in sorted(set(have) - set(want)):
            problems.append(f"{prefix}{k} unexpected")
        for k in sorted(set(want) & set(have)):
            if want[k] != have[k]:
                problems.append(f"{prefix}{k} has shape {have[k]}, the Router {want[k]}")
    problems += [f"{k} belongs to no layer" for k in sorted(set(saved) - seen)]
    if problems:
        raise ValueError(
            f"{ROUTERS_WEIGHTS} does not match the Routers its {ROUTERS_JSON} describes: "
            + "; ".join(problems[:6])
            + (f" (and {len(problems) - 6} more)" if len(problems) > 6 else "")
        )


def load_swapped(path: str | Path, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a folder written by :func:`save_swapped`: the transformers model
    (``AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)``, offline and
    from safetensors; custom code in ``config.json`` is refused unless
    ``trust_remote_code=True``, as :mod:`~moelab.integrations.hf.folder` does) with its
    routers swapped for moelab Routers of the saved configs, holding the saved state
    (weights, selection bias, temperature state, top_k and cut). The model is in eval
    mode. Nothing is loaded in part: the saved layers must match the model's in number,
    router names and tensor names and shapes.

    Raises:
        ValueError: not a folder of save_swapped, a newer format, or saved routers that do
            not match the model (saying what differs).
    """
    from safetensors.torch import load_file

    from moelab.integrations.hf.families import import_transformers, moe_routers
    from moelab.integrations.hf.folder import check_code, check_weights, read_json
    from moelab.integrations.hf.swap import swap_with_layer_keys

    path = Path(path)
    doc = _read_routers(path)
    kwargs = {"local_files_only": True, "use_safetensors": True, **from_pretrained_kwargs}
    trust = bool(kwargs.setdefault("trust_remote_code", False))
    where = f"load_swapped {path}"
    check_code(path, where, read_json(path / "config.json", where), trust)
    check_weights(path, where)
    tf = import_transformers()
    model = tf.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    family = getattr(model.config, "model_type", None)
    if family != doc.get("family"):
        raise ValueError(
            f"{ROUTERS_JSON} was saved for the family {doc.get('family')!r}; the folder's "
            f"model is {family!r}"
        )
    from moelab.integrations.hf.swap_rules import null_experts

    zero = null_experts(model)
    sites = moe_routers(model)
    mismatch = _layer_mismatch(doc, sites)
    if mismatch:
        raise ValueError(f"{path}: {mismatch}; the moelab routers cannot be loaded into it")
    layer_keys = [
        # the rows of a LongCat router hold its zero-computation experts after the E real
        _saved_keys(entry, int(site.weight.shape[1]), int(site.weight.shape[0]) - zero)
        for entry, site in zip(doc["layers"], sites, strict=True)
    ]
    weights = path / ROUTERS_WEIGHTS
    if not weights.is_file():
        raise ValueError(f"{path} has {ROUTERS_JSON} but no {ROUTERS_WEIGHTS}: save again")
    saved = load_file(str(weights))
    routers = swap_with_layer_keys(model, {}, layer_keys)
    _check_tensors(saved, routers)
    for index, (entry, swapped) in enumerate(zip(doc["layers"], routers, strict=True)):
        prefix = f"layer_{index:02d}."
        state: dict[str, Any] = {
            k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)
        }
        state.update(entry.get("state") or {})
        swapped.router.load_state_dict(state, strict=True)
    return model


def _register() -> None:
    from moelab.integrations.hf import swap

    swap.SAVE = _save_swapped


_register()
