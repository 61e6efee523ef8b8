"""The live advisor: the tuning guides' advice when the steps show a symptom they describe."""

from engine import hookimpl

ENGINE_HOOKS_VERSION = "1.0"


@hookimpl
def engine_started(engine):
    from engine_advisor.advisor import start

    start(engine)


@hookimpl
def step_finished(stats):
    from engine_advisor.advisor import observe

    observe(stats)
