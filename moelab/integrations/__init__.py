"""Bridges to other tools, each an optional extra (importing moelab never needs them):
:mod:`moelab.integrations.hf` (Hugging Face transformers MoE models, extra ``hf``),
:mod:`moelab.integrations.lm_eval` (lm-evaluation-harness, extra ``eval``), and moelab's
routers inside the training engines, :mod:`moelab.integrations.torchtitan` (extra
``torchtitan``) and :mod:`moelab.integrations.olmo_core` (extra ``olmo``); see
docs/engines.md. The rules on router keys those bridges and the Hugging Face swap share
(checks, merge over the engine's keys, refusals) are :mod:`moelab.integrations.router_keys`,
which needs no engine."""
