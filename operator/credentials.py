"""The Secrets a secure-by-default InferenceService needs and nobody else supplies: its KV-transfer
secret and, without a TLS Secret or cert-manager issuer in the spec, its CA and one certificate
per pool (pki.py). Run by reconcile.py before render, on every reconcile:

    spec.security.insecure         -> nothing (the status says Secure=False)
    no kvTransfer.authSecret       -> Secret <name>-kv {secret: 32 random bytes, hex}; created once, kept
    no router.apiKeys, and not router.allowUnauthenticated
                                   -> Secret <name>-api-keys {keys.yaml: the gateway's key file with one
                                      key, id admin, role admin, stored as its SHA-256; admin-key: that key, for the
                                      service's owner to read}; created once, kept (edit it to add keys)
    no spec.tls                    -> Secret <name>-ca  {tls.crt, tls.key, previous.crt}
                                      Secret <name>-<component>-tls {tls.crt, tls.key, ca.crt} for each
                                      pool and the router (kubernetes.io/tls, cert-manager's key names):
                                      worker certificates for the pools, a client-only router one
                                      (pki.py); a leaf of the wrong role is re-issued

A Secret is written only when it is missing, unreadable or due for renewal (pki.needs_renewal),
so a reconcile with nothing to renew makes no write. Every Secret carries the common labels and a
controller owner reference: Kubernetes deletes them with the InferenceService. The result, a
fingerprint per component, goes into the pod templates (render_pods), so a renewed certificate
rolls its pool; between rotations the fingerprint, and so the template, does not change.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import secrets
from typing import Any

import yaml

from splitserve.operator import pki
from splitserve.operator.context import Context
from splitserve.operator.kube import KindInfo, path
from splitserve.planner.kube import KubeClient

SECRET = KindInfo("v1", "Secret", "secrets")
KV_SECRET_KEY = "secret"
MIN_KV_SECRET_BYTES = 16
API_KEYS_FILE_KEY = "keys.yaml"
ADMIN_KEY_KEY = "admin-key"
ADMIN_KEY_ID = "admin"


def kv_secret_name(ctx: Context) -> str:
    return ctx.child("kv")


def api_keys_secret_name(ctx: Context) -> str:
    return ctx.child("api-keys")


def manages_api_keys(ctx: Context) -> bool:
    return ctx.spec.router.api_keys is None and not ctx.spec.router.allow_unauthenticated


def ca_secret_name(ctx: Context) -> str:
    return ctx.child("ca")


def tls_secret_name(ctx: Context, component: str) -> str:
    return ctx.child(f"{component}-tls")


def manages_kv_secret(ctx: Context) -> bool:
    return ctx.spec.is_secure and ctx.spec.kv_transfer.auth_secret is None


def manages_tls(ctx: Context) -> bool:
    return ctx.spec.is_secure and ctx.spec.tls is None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _data(secret: dict[str, Any] | None, key: str) -> bytes:
    raw = ((secret or {}).get("data") or {}).get(key)
    try:
        return base64.b64decode(raw) if raw else b""
    except ValueError:
        return b""


def _write(
    kube: KubeClient,
    ctx: Context,
    name: str,
    component: str,
    data: dict[str, bytes],
    type_: str,
    live: dict[str, Any] | None,
) -> None:
    encoded = {k: _b64(v) for k, v in data.items()}
    if live is None:
        kube.create(
            path(SECRET, ctx.namespace),
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": type_,
                "metadata": ctx.meta(name, component),
                "data": encoded,
            },
        )
    else:
        kube.merge_patch(path(SECRET, ctx.namespace, name), {"metadata": ctx.meta(name, component), "data": encoded})


def ensure_kv_secret(kube: KubeClient, ctx: Context) -> None:
    name = kv_secret_name(ctx)
    live = kube.get(path(SECRET, ctx.namespace, name))
    if len(_data(live, KV_SECRET_KEY).strip()) >= MIN_KV_SECRET_BYTES:
        return
    _write(kube, ctx, name, "kv", {KV_SECRET_KEY: secrets.token_hex(32).encode()}, "Opaque", live)


def ensure_api_keys(kube: KubeClient, ctx: Context) -> None:
    """The generated key file: one admin key, created once; a file someone edited is left alone."""
    name = api_keys_secret_name(ctx)
    live = kube.get(path(SECRET, ctx.namespace, name))
    if _data(live, API_KEYS_FILE_KEY).strip():
        return
    key = "sk-" + secrets.token_urlsafe(32)
    key_file = yaml.safe_dump(
        {"keys": [{"id": ADMIN_KEY_ID, "sha256": hashlib.sha256(key.encode()).hexdigest(), "role": "admin"}]}
    )
    _write(
        kube, ctx, name, "api-keys", {API_KEYS_FILE_KEY: key_file.encode(), ADMIN_KEY_KEY: key.encode()}, "Opaque", live
    )


def _ensure_ca(kube: KubeClient, ctx: Context, now: datetime.datetime) -> tuple[pki.KeyPair, bytes]:
    """The current CA and the trust bundle (current CA, then the previous one while it is valid)."""
    name = ca_secret_name(ctx)
    live = kube.get(path(SECRET, ctx.namespace, name))
    current = pki.KeyPair(_data(live, "tls.crt"), _data(live, "tls.key"))
    previous = _data(live, "previous.crt")
    if not current.cert or not current.key or pki.needs_renewal(current.cert, now):
        previous = current.cert if current.cert and pki.is_valid_at(current.cert, now) else b""
        current = pki.make_ca(f"{ctx.namespace}/{ctx.name}", now)
        _write(
            kube,
            ctx,
            name,
            "ca",
            {"tls.crt": current.cert, "tls.key": current.key, "previous.crt": previous},
            "Opaque",
            live,
        )
    bundle = current.cert + (previous if previous and pki.is_valid_at(previous, now) else b"")
    return current, bundle


def _ensure_leaf(
    kube: KubeClient, ctx: Context, component: str, ca: pki.KeyPair, bundle: bytes, now: datetime.datetime
) -> str:
    name = tls_secret_name(ctx, component)
    live = kube.get(path(SECRET, ctx.namespace, name))
    leaf = pki.KeyPair(_data(live, "tls.crt"), _data(live, "tls.key"))
    role = "router" if component == "router" else "worker"
    if (
        not leaf.cert
        or not leaf.key
        or pki.needs_renewal(leaf.cert, now)
        or not pki.is_signed_by(leaf.cert, ca.cert)
        or pki.role_of(leaf.cert) != role
    ):
        leaf = pki.issue_leaf(ca, ctx.child(component), now, role=role)
    elif _data(live, "ca.crt") == bundle:
        return _fingerprint(leaf.cert, bundle)
    _write(
        kube,
        ctx,
        name,
        component,
        {"tls.crt": leaf.cert, "tls.key": leaf.key, "ca.crt": bundle},
        "kubernetes.io/tls",
        live,
    )
    return _fingerprint(leaf.cert, bundle)


def _fingerprint(cert: bytes, bundle: bytes) -> str:
    return hashlib.sha256(cert + bundle).hexdigest()[:16]


def ensure_credentials(kube: KubeClient, ctx: Context, now: datetime.datetime) -> dict[str, str]:
    """Create or renew the Secrets this InferenceService's security needs (see the module doc);
    returns component -> certificate fingerprint for the pod templates ({} without managed TLS)."""
    if manages_kv_secret(ctx):
        ensure_kv_secret(kube, ctx)
    if manages_api_keys(ctx):
        ensure_api_keys(kube, ctx)
    if not manages_tls(ctx):
        return {}
    ca, bundle = _ensure_ca(kube, ctx, now)
    return {component: _ensure_leaf(kube, ctx, component, ca, bundle, now) for component in (*ctx.pools, "router")}
