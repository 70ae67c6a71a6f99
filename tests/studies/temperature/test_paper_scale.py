"""The temperature study's paper scale against what *Stable Token Routing in Sparse
Mixture-of-Experts Models via Temperature-Controlled Gating* states (its section or table
next to each number), parameter counts as `moelab params` prints them."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from moelab.cli import main
from moelab.studies import run_study
from moelab.train import TrainConfig
from moelab.train.loop import lr_at

# --- what the paper states ----------------------------------------------------------
N_LAYERS = 12  # Section 5 "12 layers and width 768"; Table 3 "Layers, width, heads"
D_MODEL = 768  # Section 5; Table 3
N_HEADS = 12  # Table 3
N_EXPERTS = 8  # Section 5 "E = 8 experts"; Table 3 "Experts per MoE layer: 8"
MOE_BLOCKS = "every other block"  # Section 5 "replacing every other feed-forward block"; Table 3
TOP_K = 2  # Section 5 "top-2 routing"; Table 3 "Routing: top-2"
SWITCH_TOP_K = 1  # Table 1 "Switch, top-1"
CAPACITY_FACTOR = 1.25  # Table 3 "capacity factor 1.25"
BETAS = (0.9, 0.95)  # Table 3 "Adam, beta = (0.9, 0.95)"
LR = 6e-4  # Table 3 "6 x 10^-4, cosine decay"
BATCH = 256  # Table 3 "Batch size 256 x 1,024 tokens"
SEQ_LEN = 1024  # Table 3
STEPS = 60_000  # Section 5 "trained for 60,000 steps"; Table 3
AUX_WEIGHT = 1e-2  # eq. 6 and Table 3 "Balance weight alpha: 10^-2"
L_STAR = 4.0  # Table 3 "Target constant L*: 4"
TAU_MIN = 0.25  # Table 3 "Minimum temperature tau_min: 0.25"
FIXED_TAUS = {"fixed-0.5": 0.5, "fixed-2.0": 2.0}  # Table 1 rows
ACTIVE_M = 125  # Section 5 "about 125 million active parameters"; Table 1 "Params 125M"


@pytest.fixture(scope="module")
def paper(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper")
    doc = run_study("temperature", out, scale="paper", progress=False)
    arms = {
        name: json.loads((out / "paper" / f"{name}.json").read_text())
        for name in ("dense", "switch", "fixed-0.5", "fixed-2.0", "lipschitz")
    }
    return out, doc, arms


def _printed_params(config: dict) -> dict:
    """`moelab params --preset P --set ... --json` for the arm's model."""
    sets = [f"model.{k}={v}" for k, v in config["model"].items() if k != "router"]
    sets += [f"router.{k}={v}" for k, v in config["model"].get("router", {}).items()]
    argv = ["params", "--preset", config["preset"], "--json"]
    for s in sets:
        argv += ["--set", s]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())


def test_paper_scale_trains_nothing_and_writes_commands(paper):
    out, doc, _ = paper
    assert doc["trained"] is False and not (out / "runs").exists()
    commands = (out / "paper" / "commands.sh").read_text().splitlines()
    assert sum(c.startswith("torchrun") for c in commands) == 5


def test_architecture_optimiser_and_schedule_as_stated(paper):
    _, _, arms = paper
    for name, arm in arms.items():
        config = TrainConfig.from_dict(arm["config"])
        mc = config.model_config()
        assert (mc.n_layers, mc.d_model, mc.n_heads) == (N_LAYERS, D_MODEL, N_HEADS)
        assert mc.max_seq_len >= SEQ_LEN
        assert (config.batch_size, config.seq_len, config.steps) == (BATCH, SEQ_LEN, STEPS)
        assert config.lr == LR and tuple(config.betas) == BETAS
        assert config.weight_decay == 0.0  # Adam, not AdamW
        # cosine decay: half-way between warm-up and the end, halfway between lr and min_lr
        mid = config.warmup_steps + (config.steps - config.warmup_steps - 1) / 2
        assert lr_at(int(mid), config) == pytest.approx((LR + config.min_lr) / 2, rel=1e-3)
        assert lr_at(config.steps - 1, config) == pytest.approx(config.min_lr)
        if name == "dense":
            assert mc.moe_indices == []
            continue
        assert mc.n_experts == N_EXPERTS
        assert mc.moe_indices == list(range(1, N_LAYERS, 2)), MOE_BLOCKS
        rc = mc.router_config()
        assert rc.top_k == (SWITCH_TOP_K if name == "switch" else TOP_K)
        assert rc.capacity_factor == CAPACITY_FACTOR and rc.aux_weight == AUX_WEIGHT
        assert rc.map == "softmax" and rc.gate_rule == "map"  # eq. 1 and eq. 2
        if name in FIXED_TAUS:
            assert (rc.schedule, rc.temperature) == ("fixed", FIXED_TAUS[name])
        if name == "lipschitz":
            assert (rc.schedule, rc.lipschitz_target, rc.tau_min) == ("lipschitz", L_STAR, TAU_MIN)


def test_every_arm_has_the_stated_125m_active_parameters_as_moelab_params_prints(paper):
    _, _, arms = paper
    for name, arm in arms.items():
        printed = _printed_params(arm["config"])
        assert printed["active"] == arm["params"]["active"]
        # "125M" (Table 1) covers [124.5M, 125.5M)
        assert round(printed["active"] / 1e6) == ACTIVE_M, (name, printed["active"])
    # the top-2 arms spend the parameters per token that Switch spends on one expert
    assert arms["lipschitz"]["params"]["active"] == arms["switch"]["params"]["active"]
    assert arms["lipschitz"]["params"]["total"] < arms["switch"]["params"]["total"]


def test_every_value_names_its_source(paper):
    _, doc, arms = paper
    sources = doc["sources"]
    for key, text in sources.items():
        assert text.startswith("stated: ") or text.startswith("moelab's choice"), key
    stated = {k for k, v in sources.items() if v.startswith("stated")}
    for key in (
        "model.n_layers",
        "model.d_model",
        "model.n_heads",
        "model.n_experts",
        "model.moe_layers",
        "router.top_k",
        "router.capacity_factor",
        "router.aux_weight",
        "batch_size",
        "seq_len",
        "steps",
        "lr",
        "betas",
        "switch:router.top_k",
        "fixed-0.5:router.temperature",
        "fixed-2.0:router.temperature",
        "lipschitz:router.schedule",
        "lipschitz:router.lipschitz_target",
        "lipschitz:router.tau_min",
    ):
        assert key in stated, key
    for key in ("min_lr", "warmup_steps", "grad_clip", "model.d_ff", "model.vocab_size"):
        assert sources[key].startswith("moelab's choice"), key
    # an arm's own sources replace the shared ones in its ARM.json
    assert arms["fixed-0.5"]["sources"]["router.temperature"].startswith("stated")
    assert math.isclose(arms["lipschitz"]["config"]["model"]["router"]["tau_min"], TAU_MIN)
