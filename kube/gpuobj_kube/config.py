"""Where the API server is and how to authenticate, with credentials borrowed from the `kubernetes` package.

Why borrowed: kubeconfig users come as tokens, token files, client certificates, `exec`
plugins (EKS `aws eks get-token`, GKE `gke-gcloud-auth-plugin`, AKS `kubelogin`) and
`auth-provider`s, in one file or several (`KUBECONFIG=a:b`), or as an in-cluster
ServiceAccount whose projected token rotates. The `kubernetes` package's loaders handle
all of that as client-go does (kopf, for one, piggybacks on them the same way). We keep our own REST
verbs (kube/gpuobj_kube/client.py) and ask this module for one thing per request: the
Authorization header, refreshed when it expires and re-read after a 401.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# The kubernetes package is imported where credentials are loaded, not with this module: its errors and
# types are imported by the client library and the agent, which run without it where nothing talks to the
# API server (the GPU check's image has no kubernetes package, docs/gpu.md).
if TYPE_CHECKING:
    from kubernetes.client import Configuration

# Refresh a credential this long before its stated expiry, so no request goes out with a token about to lapse.
EXPIRY_SKEW = dt.timedelta(seconds=30)
# A credential without a stated expiry (a token file, an in-cluster token) is re-read this often anyway.
REREAD_PERIOD = dt.timedelta(seconds=60)


class KubeConfigError(RuntimeError):
    """No usable cluster configuration or credentials: the message says which file, context or plugin."""


@dataclass(frozen=True)
class Credentials:
    """One snapshot of what a request needs. `expiry` is when it must be loaded again."""

    server: str
    namespace: str
    authorization: str | None  # the whole header value: "Bearer ..." or "Basic ..."
    ca_path: str | None
    cert_path: str | None
    key_path: str | None
    insecure: bool
    expiry: dt.datetime | None

    @property
    def bearer_token(self) -> str | None:
        if self.authorization and self.authorization.startswith("Bearer "):
            return self.authorization.removeprefix("Bearer ")
        return None

    def expired(self, now: dt.datetime | None = None) -> bool:
        return self.expiry is not None and (now or _utcnow()) >= self.expiry - EXPIRY_SKEW


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class KubeConfig:
    """The API server and a credential source that refreshes on expiry and on demand (after a 401).

    `load` is the loader to call again; it runs the exec plugin or re-reads the token file.
    """

    def __init__(self, load: Callable[[], Credentials], *, source: str) -> None:
        self._load = load
        self.source = source
        self._lock = threading.Lock()
        self._creds = load()
        self._loaded_at = _utcnow()
        self._ssl: ssl.SSLContext | None = None

    @classmethod
    def static(
        cls, server: str, *, authorization: str | None = None, ca_path: str | None = None, namespace: str = "default"
    ) -> KubeConfig:
        """Fixed credentials for a known server (tests, tools): nothing to load again."""
        creds = Credentials(server.rstrip("/"), namespace, authorization, ca_path, None, None, False, None)
        return cls(lambda: creds, source=f"static {server}")

    # -- what callers read
    @property
    def server(self) -> str:
        return self._creds.server

    @property
    def namespace(self) -> str:
        return self._creds.namespace

    @property
    def ca_path(self) -> str | None:
        return self._creds.ca_path

    @property
    def cert_path(self) -> str | None:
        return self._creds.cert_path

    @property
    def key_path(self) -> str | None:
        return self._creds.key_path

    @property
    def insecure(self) -> bool:
        return self._creds.insecure

    @property
    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = _ssl_context(self._creds)
        return self._ssl

    def needs_refresh(self) -> bool:
        """Expired, or older than REREAD_PERIOD when the credential states no expiry."""
        now = _utcnow()
        if self._creds.expiry is None:
            return now - self._loaded_at >= REREAD_PERIOD
        return self._creds.expired(now)

    def credentials(self) -> Credentials:
        """Current credentials, loaded again when they need it."""
        with self._lock:
            if self.needs_refresh():
                self._reload_locked()
            return self._creds

    def authorization(self) -> str | None:
        return self.credentials().authorization

    def bearer(self) -> str | None:
        """The bearer token (without scheme), for libraries that want it alone."""
        return self.credentials().bearer_token

    def invalidate(self) -> None:
        """The API server answered 401: load the credentials again (new exec run, token file re-read)."""
        with self._lock:
            self._reload_locked()

    def _reload_locked(self) -> None:
        creds = self._load()
        if (creds.ca_path, creds.cert_path, creds.key_path, creds.insecure) != (
            self._creds.ca_path,
            self._creds.cert_path,
            self._creds.key_path,
            self._creds.insecure,
        ):
            self._ssl = None
        self._creds = creds
        self._loaded_at = _utcnow()


def _ssl_context(creds: Credentials) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=creds.ca_path) if creds.ca_path else ssl.create_default_context()
    if creds.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if creds.cert_path and creds.key_path:
        ctx.load_cert_chain(creds.cert_path, creds.key_path)
    return ctx


class _CaptureErrors(logging.Handler):
    """The `kubernetes` package logs (and swallows) a failing exec plugin; we want its words in our error."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _captured_errors() -> Iterator[_CaptureErrors]:
    handler = _CaptureErrors()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def _from_configuration(cfg: Configuration, *, namespace: str, expiry: dt.datetime | None) -> Credentials:
    return Credentials(
        server=cfg.host.rstrip("/"),
        namespace=namespace,
        authorization=_normalized_authorization(cfg.get_api_key_with_prefix("BearerToken")),
        ca_path=cfg.ssl_ca_cert or None,
        cert_path=cfg.cert_file or None,
        key_path=cfg.key_file or None,
        insecure=not cfg.verify_ssl,
        expiry=expiry.astimezone(dt.UTC) if expiry is not None else None,
    )


def _normalized_authorization(header: str | None) -> str | None:
    """ "Bearer <token>" with a canonical scheme and no stray whitespace (in-cluster tokens come as "bearer ...\\n")."""
    if not header or not header.strip():
        return None
    scheme, _, value = header.strip().partition(" ")
    scheme = {"bearer": "Bearer", "basic": "Basic"}.get(scheme.lower(), scheme)
    return f"{scheme} {value.strip()}" if value.strip() else None


def _kubeconfig_paths(path: str | os.PathLike[str] | None) -> str:
    if path:
        return os.fspath(path)
    return os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")


def _load_kubeconfig(paths: str, context: str | None) -> Credentials:
    from kubernetes.client import Configuration
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.config.kube_config import ENV_KUBECONFIG_PATH_SEPARATOR, KubeConfigLoader, KubeConfigMerger

    files = [p for p in paths.split(ENV_KUBECONFIG_PATH_SEPARATOR) if p]
    readable = [p for p in files if Path(p).expanduser().is_file()]
    if not readable:
        tried = ", ".join(files) or "(empty path)"
        raise KubeConfigError(f"no kubeconfig found at {tried} (set KUBECONFIG or --kubeconfig)")
    with _captured_errors() as errors:
        try:
            merged = KubeConfigMerger(ENV_KUBECONFIG_PATH_SEPARATOR.join(readable))
            if merged.config is None:
                raise KubeConfigError(f"kubeconfig {paths} holds no configuration")
            loader = KubeConfigLoader(config_dict=merged.config, active_context=context, config_base_path=None)
            cfg = Configuration()
            loader.load_and_set(cfg)
        except ConfigException as exc:
            raise KubeConfigError(f"kubeconfig {paths}, context {context or '(current)'}: {exc}") from None
        except (KeyError, TypeError, ValueError, OSError) as exc:  # a malformed file the loader did not check
            raise KubeConfigError(f"kubeconfig {paths} is malformed: {type(exc).__name__}: {exc}") from None
    ctx = loader.current_context["context"]
    user = loader._user  # the resolved user section (None when the context names no user)
    creds = _from_configuration(
        cfg, namespace=ctx.get("namespace") or "default", expiry=getattr(loader, "expiry", None)
    )
    wants_credentials = user is not None and any(k in user for k in ("exec", "auth-provider", "token", "tokenFile"))
    if wants_credentials and not creds.authorization and not creds.cert_path:
        why = "; ".join(errors.messages) or "it produced no token and no client certificate"
        raise KubeConfigError(f"kubeconfig {paths}: user of context {loader.current_context['name']!r}: {why}")
    return creds


def from_kubeconfig(path: str | os.PathLike[str] | None = None, context: str | None = None) -> KubeConfig:
    """Credentials from a kubeconfig (`path`, else $KUBECONFIG — several files joined by ':' — else ~/.kube/config)."""
    paths = _kubeconfig_paths(path)
    return KubeConfig(lambda: _load_kubeconfig(paths, context), source=f"kubeconfig {paths}")


def _load_in_cluster(token_file: Path, ca_file: Path, namespace_file: Path) -> Credentials:
    from kubernetes.client import Configuration
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.config.incluster_config import InClusterConfigLoader

    cfg = Configuration()
    try:
        InClusterConfigLoader(
            token_filename=str(token_file), cert_filename=str(ca_file), try_refresh_token=False
        ).load_and_set(cfg)
    except ConfigException as exc:
        raise KubeConfigError(f"in-cluster configuration: {exc}") from None
    namespace = namespace_file.read_text().strip() if namespace_file.is_file() else "default"
    return _from_configuration(cfg, namespace=namespace, expiry=None)  # re-read every REREAD_PERIOD


def in_cluster(sa_dir: Path | None = None) -> KubeConfig:
    """The pod's ServiceAccount: KUBERNETES_SERVICE_HOST/PORT and the projected token, re-read as it rotates."""
    if sa_dir is None:
        from kubernetes.config.incluster_config import SERVICE_TOKEN_FILENAME

        sa_dir = Path(SERVICE_TOKEN_FILENAME).parent
    if not os.environ.get("KUBERNETES_SERVICE_HOST") or not (sa_dir / "token").is_file():
        raise KubeConfigError("not running in a cluster (no KUBERNETES_SERVICE_HOST or ServiceAccount token)")
    return KubeConfig(
        lambda: _load_in_cluster(sa_dir / "token", sa_dir / "ca.crt", sa_dir / "namespace"), source="in-cluster"
    )


def load(kubeconfig: str | os.PathLike[str] | None = None) -> KubeConfig:
    """An explicit kubeconfig, else $KUBECONFIG, else in-cluster, else ~/.kube/config."""
    if kubeconfig or os.environ.get("KUBECONFIG"):
        return from_kubeconfig(kubeconfig)
    try:
        return in_cluster()
    except KubeConfigError:
        return from_kubeconfig()
