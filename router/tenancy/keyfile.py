"""The key file served: reloaded when its stat (inode, size, mtime) changes, so a Secret update or an
edit needs no restart; and the per-key model scope. The file's format and parser are in
router/config/keys.py.
"""

from __future__ import annotations

import hmac
import logging
import os

import yaml

from splitserve.router.config import ApiKey, ConfigError
from splitserve.router.config.keys import digest, parse_keys
from splitserve.router.errors import APIError

log = logging.getLogger(__name__)


class KeyFile:
    """The keys of one file, re-read whenever the file changes (a bad new file keeps the old keys).
    `check(keys)` may refuse a file's keys with a ConfigError, as a parse error does (the gateway's
    check_shared_quotas: a file that gains limits at run time is refused as one at start is)."""

    def __init__(self, path: str, check=None):
        self.path = path
        self.check = check
        self._stamp: tuple | None = None
        self.keys: tuple[tuple[str, ApiKey], ...] = ()
        self.reload_error: str | None = None
        self._maybe_reload(strict=True)

    def _maybe_reload(self, strict: bool = False) -> None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if strict:
                raise ConfigError(f"gateway.api_keys_file={self.path!r}: {exc.strerror}") from None
            return
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        try:
            with open(self.path, encoding="utf-8") as f:
                keys = parse_keys(yaml.safe_load(f), self.path)
            if self.check is not None:
                self.check(k for _, k in keys)
        except (ConfigError, yaml.YAMLError, OSError) as exc:
            if strict:
                raise ConfigError(str(exc)) from None
            log.error("the key file %s was not reloaded (its previous keys stay): %s", self.path, exc)
            self.reload_error = str(exc)
            if not isinstance(exc, OSError):  # its content is wrong: read it again once it changes
                self._stamp = stamp
            return
        self.keys, self._stamp, self.reload_error = keys, stamp, None

    def lookup(self, token: str) -> ApiKey | None:
        self._maybe_reload()
        presented = digest(token).encode()
        found = None
        for hexdigest, key in self.keys:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(presented, hexdigest.encode()):
                found = key
        return found


def check_scope(key: ApiKey, model: str) -> None:
    if key.models is not None and model not in key.models:
        raise APIError(
            404,
            f"the model {model!r} does not exist or this API key has no access to it",
            param="model",
            code="model_not_found",
        )
