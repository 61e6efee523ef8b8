"""Speculative decoding in the core: the settings (settings.py), which drafts to verify
(policy.py: acceptance and cost, so speculation pays or stays off) and the verify step
(verify.py: one target forward over every running request's drafts, the tokens sampled
position by position exactly as without drafts, the KV of rejected drafts left to be
overwritten). Drafters are plugins (``register_speculative_algorithms``)."""

from engine.speculative.settings import SpecConfigError, SpecSettings, spec_settings

__all__ = ["SpecConfigError", "SpecSettings", "spec_settings"]
