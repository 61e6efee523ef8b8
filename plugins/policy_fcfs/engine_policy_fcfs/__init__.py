"""Schedule policy 'fcfs': waiting requests in arrival order."""

from engine import hookimpl


def _factory(config):
    from engine_policy_fcfs.policy import FCFSPolicy

    return FCFSPolicy()


@hookimpl
def register_schedule_policies(register):
    register("fcfs", _factory, cache_aware=False)
