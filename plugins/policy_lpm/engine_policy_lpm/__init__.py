"""Schedule policy 'lpm': longest cached prefix first (SGLang's default)."""

from engine import hookimpl


def _factory(config):
    from engine_policy_lpm.policy import LPMPolicy

    return LPMPolicy()


@hookimpl
def register_schedule_policies(register):
    register("lpm", _factory, cache_aware=True)
