"""The one exception tree of elasticctl; the CLI maps it to one-sentence errors."""


def quote(value: object, limit: int = 80) -> str:
    """``'value'`` for a one-line message: control characters escaped, long values shortened."""
    text = str(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    return repr(text) if not text.isprintable() else f"'{text}'"


PATH_MAX = 4096  # Linux's longest path: a path the user typed is shown whole, to be found


def quote_path(path: object) -> str:
    """``'path'`` for a one-line message: whole (shortened only past :data:`PATH_MAX`), control
    characters escaped."""
    return quote(path, limit=PATH_MAX)


class ElasticctlError(Exception):
    """Base of every error elasticctl raises on purpose; its message is one sentence.

    Every exception class elasticctl defines derives from it (tests/unit/test_errors.py checks),
    with one exception: the runtime's private step-boundary signal (train/worker/executor.py
    ``_Boundary``) is a BaseException, so that a script's ``except Exception`` cannot swallow it.
    """


class ConfigError(ElasticctlError, ValueError):
    """A user-supplied value (flag, endpoint, rendezvous option) is invalid.

    Also a ``ValueError``: torch's rendezvous contract expects one for a bad setting.
    """


class EtcdUnavailableError(ElasticctlError):
    """No etcd endpoint answered within the retry window."""


class EtcdServerError(ElasticctlError):
    """The embedded etcd server could not be found, started, or kept running."""


class EtcdRequestError(ElasticctlError):
    """etcd answered but refused the request (bad credentials, permission, bad argument)."""


class LeaseNotFoundError(EtcdRequestError):
    """etcd no longer knows the lease a write was bound to: it expired or was revoked."""
