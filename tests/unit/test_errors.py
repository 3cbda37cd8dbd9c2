"""One exception tree: every exception class elasticctl defines derives from ElasticctlError."""

import importlib
import inspect
import pkgutil

import elasticctl
from elasticctl.errors import ConfigError, ElasticctlError

FRAMEWORKS = ("lightning", "transformers", "accelerate")

# Control flow, not an error: a BaseException so that a script's `except Exception` cannot swallow it.
NOT_ERRORS = {"elasticctl.train.worker.executor._Boundary"}


def _exception_classes():
    for module_info in pkgutil.walk_packages(elasticctl.__path__, "elasticctl."):
        try:
            module = importlib.import_module(module_info.name)
        except ModuleNotFoundError as exc:
            # A framework integration whose framework (an extra) is not installed here.
            if module_info.name.startswith("elasticctl.integrations.") and exc.name and \
                    exc.name.split(".")[0] in FRAMEWORKS:
                continue
            raise
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == module.__name__:
                yield f"{value.__module__}.{value.__qualname__}", value


def test_every_exception_class_is_an_elasticctl_error():
    classes = dict(_exception_classes())
    assert "elasticctl.train.script.PeerLeaving" in classes and "elasticctl.rendezvous.member.JoinCancelled" in classes
    outside = sorted(name for name, cls in classes.items()
                     if not issubclass(cls, ElasticctlError) and name not in NOT_ERRORS)
    assert outside == []


def test_the_bases_torch_and_scripts_rely_on_are_kept():
    from elasticctl.train.script import PeerLeaving

    assert issubclass(ConfigError, ValueError)  # torch's rendezvous contract: a bad setting is a ValueError
    assert issubclass(PeerLeaving, RuntimeError)
