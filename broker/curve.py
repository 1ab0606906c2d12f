"""CurveZMQ on tcp:// endpoints: key files, the broker's authenticator, and the one call
each socket makes when it is created.

The rule everywhere: a tcp:// frontend or backend speaks Curve when keys are configured
(loopback too, so one configuration serves every host); ipc:// never does (the runtime
folder's permissions guard it), and the control socket stays on ipc or loopback.

Key files are zmq.auth certificates: ``NAME.key`` holds a public key (hand it out;
the broker authorizes the ``*.key`` files of one folder) and ``NAME.key_secret`` the
pair (mode 0600; a secret file others can read is refused). The broker's authorizer
reads its folder again whenever a file in it changes, at the next handshake, so adding
a worker's key lets it in without a restart; connections already made stay (Curve
checks a key at the handshake only).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import zmq
import zmq.auth

from zeroserve.broker.process import RateLimitedLog
from zeroserve.broker.runtime import is_exposed

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter

logger = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
DOMAINS = ("frontend", "backend")   # ZAP domains: which broker socket a handshake is for
# client-side handshake failures, from a socket monitor, and what they mean for us
REFUSALS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the broker refused this client's CurveZMQ key "
                                     "(its public key is not in the broker's authorized keys)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the CurveZMQ handshake failed (is the broker's "
                                          "public key the right one?)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed (the broker speaks CurveZMQ "
                                         "and this client does not, or the other way round)",
}
REFUSAL_EVENTS = 0
for _event in REFUSALS:
    REFUSAL_EVENTS |= _event


class CurveError(ValueError):
    """A key file or a setting that cannot work; the message names the file."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes   # z85, 40 characters
    secret: bytes


@dataclass(frozen=True)
class ClientKeys:
    """What a worker, a gateway or a direct client needs to reach a Curve broker."""
    server_public: bytes
    own: KeyPair


# -- key files ---------------------------------------------------------------
def _certificate(public: bytes, secret: bytes | None, name: str) -> str:
    kind = "Secret" if secret else "Public"
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lines = [f"#   ZeroMQ CURVE {kind} Certificate, {name}, written by zeroserve on {when}",
             "#   " + ("Keep this file to its owner (mode 0600)." if secret else
                      "Copy it to the broker's authorized-keys folder (or, for the "
                      "broker's key, to its clients)."),
             "", "metadata", f'    name = "{name}"', "curve",
             f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, mode)  # created with its mode: never readable by others
    except FileExistsError:
        raise CurveError(f"{path} exists; pass --force to replace it") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), mode)  # an existing file replaced with --force keeps none of its own
        f.write(text)


def generate(folder: Path, name: str, force: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0644) and ``NAME.key_secret`` (0600) into ``folder``."""
    if not name or "/" in name or name.startswith("."):
        raise CurveError(f"bad key name {name!r}: a plain file name, such as broker or "
                         "worker-gpu1")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    public_path, secret_path = folder / f"{name}{PUBLIC_SUFFIX}", folder / f"{name}{SECRET_SUFFIX}"
    _write(secret_path, _certificate(public, secret, name), 0o600, force)
    _write(public_path, _certificate(public, None, name), 0o644, force)
    return public_path, secret_path


def _read(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"cannot read CurveZMQ key file {path}: {exc}") from None
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise CurveError(f"{path} holds no valid z85 CurveZMQ key (40 characters)")
    return public, secret


def load_public(path: Path) -> bytes:
    """The public key of a ``.key`` file (a ``.key_secret`` file holds it too)."""
    return _read(path)[0]


def load_pair(path: Path) -> KeyPair:
    """A key pair from a ``.key_secret`` file that only its owner can read."""
    public, secret = _read(path)
    if secret is None:
        raise CurveError(f"{path} holds a public key only; give the {SECRET_SUFFIX} file")
    mode = path.stat().st_mode
    if mode & 0o077:
        raise CurveError(f"secret key file {path} is open to others (mode "
                         f"{stat.S_IMODE(mode):o}); chmod 600 it")
    return KeyPair(public, secret)


# -- the broker's side -------------------------------------------------------
class AuthorizedKeys:
    """The credentials provider of the ZAP handler: a key is let in when a ``*.key`` file
    of the folder holds it, or when it is the broker's own (``zeroserve serve``'s local
    workers use the broker's pair). The folder is read again when its listing or a
    file's mtime or size changes, checked at each handshake (they are rare)."""

    def __init__(self, folder: Path | None, always: set[bytes], refused: "Counter") -> None:
        self.folder = folder
        self.always = set(always)
        self.refused = refused
        self._keys: set[bytes] = set()
        self._signature: Any = None
        self._lock = threading.Lock()
        self._log = RateLimitedLog(logger, per_s=1.0)
        self.refresh()

    def _scan(self) -> Any:
        if self.folder is None:
            return None
        try:
            return tuple(sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size)
                                for e in os.scandir(self.folder)
                                if e.name.endswith(PUBLIC_SUFFIX)))
        except OSError as exc:
            return ("error", str(exc))

    def refresh(self) -> None:
        signature = self._scan()
        if signature == self._signature:
            return
        keys: set[bytes] = set()
        for path in sorted(self.folder.glob(f"*{PUBLIC_SUFFIX}")) if self.folder else []:
            try:
                keys.add(load_public(path))
            except CurveError as exc:  # one bad file must not lock every client out
                logger.warning("authorized keys: skipped %s", exc)
        self._keys, self._signature = keys, signature
        if self.folder is not None:
            logger.info("authorized keys: %d from %s", len(keys), self.folder)

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by the authenticator's thread for each Curve handshake."""
        with self._lock:
            self.refresh()
            allowed = key in self._keys or key in self.always
        if not allowed:
            self.refused.labels(domain or "unknown").inc()
            self._log.log(logging.WARNING, "refused a CurveZMQ client on the %s: its public "
                          "key %s is not authorized", domain, key.decode(errors="replace"))
        return allowed


class ServerSecurity:
    """The broker's key pair and the ZAP authenticator (a thread on the broker's
    context, started with the first secured socket, before it binds: a Curve socket
    with no ZAP handler on its context would let any key in)."""

    def __init__(self, pair: KeyPair, authorized: Path | None) -> None:
        from prometheus_client import Counter  # the broker's; clients import this module too

        self.pair = pair
        self.refused = Counter("zeroserve_curve_refused", "CurveZMQ handshakes refused "
                               "because the client key is not authorized", ["socket"],
                               registry=None)
        self.keys = AuthorizedKeys(authorized, {pair.public}, self.refused)
        self._auth: Any = None

    def register(self, registry: "CollectorRegistry") -> None:
        registry.register(self.refused)

    def secure(self, sock: zmq.Socket[Any], endpoint: str, domain: str) -> bool:
        if not endpoint.startswith("tcp://"):
            return False
        if self._auth is None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(sock.context, log=logger.getChild("zap"))
            self._auth.start()
            for name in DOMAINS:  # the authenticator matches domains exactly
                self._auth.configure_curve_callback(name, credentials_provider=self.keys)
        sock.curve_secretkey = self.pair.secret
        sock.curve_publickey = self.pair.public
        sock.curve_server = True
        sock.zap_domain = domain.encode()
        return True

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def secure_server(sock: zmq.Socket[Any], security: ServerSecurity | None, endpoint: str,
                  domain: str) -> None:
    """Make a broker socket speak Curve when it binds tcp:// and the broker has keys.
    Call it before ``bind``."""
    if security is not None:
        security.secure(sock, endpoint, domain)


def server_security(args: Any) -> ServerSecurity | None:
    """From ``--curve-secret-key`` and ``--curve-authorized-keys``; raises CurveError."""
    secret = getattr(args, "curve_secret_key", None)
    folder = getattr(args, "curve_authorized_keys", None)
    if not secret:
        if folder:
            raise CurveError("--curve-authorized-keys needs --curve-secret-key (the "
                             "broker's own key pair)")
        return None
    if folder and not Path(folder).is_dir():
        raise CurveError(f"authorized keys folder {folder} is not a folder")
    return ServerSecurity(load_pair(Path(secret)), Path(folder) if folder else None)


# -- the connecting side -----------------------------------------------------
def check_client(keys: ClientKeys | None, endpoint: str) -> None:
    """Refuse a broker beyond loopback without keys: it speaks Curve only there, and a
    plain connection would wait for it in silence."""
    if keys is None and is_exposed(endpoint):
        raise CurveError(f"{endpoint} is beyond loopback, where the broker speaks "
                         "CurveZMQ only: give the broker's public key and this "
                         "client's key pair (--curve-server-key, --curve-secret-key)")


def secure_client(sock: zmq.Socket[Any], keys: ClientKeys | None, endpoint: str) -> None:
    """Make a worker's, gateway's or client's socket speak Curve on tcp:// (raises
    CurveError as check_client does, and closes the socket then). Call it before
    ``connect``."""
    try:
        check_client(keys, endpoint)
    except CurveError:
        sock.close(linger=0)
        raise
    if keys is None or not endpoint.startswith("tcp://"):
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.own.public
    sock.curve_secretkey = keys.own.secret


def client_keys(args: Any) -> ClientKeys | None:
    """From ``--curve-server-key`` and ``--curve-secret-key``; raises CurveError."""
    server = getattr(args, "curve_server_key", None)
    own = getattr(args, "curve_secret_key", None)
    if not server and not own:
        return None
    if not (server and own):
        raise CurveError("CurveZMQ needs both --curve-server-key (the broker's public key) "
                         "and --curve-secret-key (this process's key pair)")
    return ClientKeys(load_public(Path(server)), load_pair(Path(own)))


def refusal(event: Mapping[str, Any]) -> str | None:
    """What a client socket's monitor event says about a refused handshake, if it does."""
    return REFUSALS.get(int(event.get("event", 0)))


# -- ``zeroserve keys`` ----------------------------------------------------
def run_keys(args: Any) -> int:
    """``zeroserve keys generate NAME [--dir DIR] [--force]``."""
    import sys

    try:
        public, secret = generate(Path(args.dir), args.name, args.force)
    except (CurveError, OSError) as exc:
        print(f"zeroserve keys: {exc}", file=sys.stderr)
        return 2
    print(f"public key  {public}  ({load_public(public).decode()})")
    print(f"key pair    {secret}  (mode 0600: keep it on this host)")
    return 0
