"""Bridges to other tools, each an optional extra (importing moelab never needs them):
:mod:`moelab.integrations.hf` (Hugging Face transformers MoE models, extra ``hf``)."""
