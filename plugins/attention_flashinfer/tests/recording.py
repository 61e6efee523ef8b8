"""Recording stand-ins for the tests' call checks: a reference wrapper class or function that
logs every call's arguments under a name, then runs as before."""


def recording(cls, calls, name):
    def record(method):
        base = getattr(cls, method)

        def call(self, *args, **kwargs):
            calls.setdefault(f"{name}.{method}", []).append((args, kwargs))
            return base(self, *args, **kwargs)
        return call
    return type(cls.__name__, (cls,), {m: record(m) for m in ("__init__", "plan", "run")})


def recording_function(fn, calls, name):
    def call(*args, **kwargs):
        calls.setdefault(name, []).append((args, kwargs))
        return fn(*args, **kwargs)
    return call
