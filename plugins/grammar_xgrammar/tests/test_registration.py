"""How the plugin registers (without needing the xgrammar library): its name, its priority
over llguidance (the default where installed), and check()'s reason when the library is missing;
the checks are engine_testing.grammar_checks', shared with the other grammar plugins."""

from __future__ import annotations

import engine_grammar_xgrammar
from engine_testing.grammar_checks import GrammarRegistrationChecks


class TestXGrammarRegistration(GrammarRegistrationChecks):
    plugin, name, priority = engine_grammar_xgrammar, "xgrammar", 20  # above llguidance's 10
