"""Speculative decoding in the core: the settings (settings.py), which drafts to verify
(policy.py: acceptance and cost, so speculation pays or stays off) and the verify step
(verify.py: one target forward over every running request's drafts, the tokens sampled
position by position exactly as without drafts, the KV of rejected drafts left to be
overwritten) and the model-based drafter that plugins build on (draft_model.py:
``ModelDrafter``). Drafters are plugins (``register_speculative_algorithms``)."""

from engine.speculative.draft_model import (ModelDrafter, PooledDrafter, check_chain_flags,
                                            tree_label, tree_shape)
from engine.speculative.settings import NGRAM_WINDOW, SpecConfigError, SpecSettings, spec_settings

__all__ = ["NGRAM_WINDOW", "ModelDrafter", "PooledDrafter", "SpecConfigError", "SpecSettings",
           "check_chain_flags", "spec_settings", "tree_label", "tree_shape"]
