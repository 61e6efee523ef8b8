"""One request's constraint: the shared compile it waits for, then its own matcher."""

from __future__ import annotations

from engine.grammar.compiler import GrammarCompiler, result
from engine.interfaces import Constraint, GrammarError


class RequestGrammar:
    def __init__(self, compiler: GrammarCompiler, constraint: Constraint):
        self.compiler, self.constraint = compiler, constraint
        self.future = compiler.submit(constraint)
        self.matcher = None  # made when the request is first admitted
        self.error: str | None = None

    @property
    def compiling(self) -> bool:
        return not self.future.done()

    def start(self) -> bool:
        """Once compiled: make the matcher (first time only). False when the compile failed
        (``error`` says why); the request must then be failed, not run."""
        if self.matcher is not None:
            return True
        try:
            self.matcher = self.compiler.backend.matcher(result(self.future, self.constraint))
        except GrammarError as e:
            self.error = (f"{e.field or self.constraint.kind}: grammar backend "
                          f"'{self.compiler.name}' cannot compile it: {e}")
            return False
        except Exception as e:  # noqa: BLE001 - a backend bug fails this request, not the step
            self.error = (f"grammar backend '{self.compiler.name}' failed on "
                          f"{self.constraint.field or self.constraint.kind}: "
                          f"{type(e).__name__}: {e}")
            return False
        return True

    def accept(self, token: int) -> bool:
        if self.matcher.accept(token):
            return True
        self.error = (f"grammar backend '{self.compiler.name}' rejected token {token}, which the "
                      f"sampler picked under its own mask (a bug in the backend or the mask); "
                      f"the request was stopped")
        return False

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()
