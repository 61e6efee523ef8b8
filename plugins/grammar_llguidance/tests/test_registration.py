"""How the plugin registers (without needing the llguidance library): its name, its priority
below xgrammar's (the default where both are installed), and check()'s reason when the library
is missing; the checks are engine_testing.grammar_checks', shared with the other grammar
plugins."""

from __future__ import annotations

import engine_grammar_llguidance
from engine_testing.grammar_checks import GrammarRegistrationChecks


class TestLLGuidanceRegistration(GrammarRegistrationChecks):
    plugin, name, priority = engine_grammar_llguidance, "llguidance", 10  # below xgrammar's 20
