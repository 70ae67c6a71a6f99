"""Kept for Hugging Face folders exported before the checkpoint format moved to
:mod:`moelab.runs` (December 2026): the ``modeling_moelab.py`` that ``moelab export
--format remote`` wrote into them imports ``set_extra_states`` from here. The checkpoint
format lives in :mod:`moelab.runs.checkpoints`, the trainer's saving and restoring in
:mod:`moelab.train.checkpointing`; nothing in moelab imports this module."""

from __future__ import annotations

from moelab.runs.checkpoints import set_extra_states

__all__ = ["set_extra_states"]
