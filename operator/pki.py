"""The operator's own small CA, for InferenceServices that name no TLS Secret and no cert-manager
issuer (spec.security, secure by default).

Objects (one set per InferenceService, all ECDSA P-256, SHA-256 signatures):

    CA      self-signed, CA_DAYS valid, path length 0; renewed when less than a third of
            its lifetime is left (then every leaf is re-issued by the new CA)
    leaf    one per component, by role. A worker pool's (prefill, decode): SANs `splitserve-worker`
            (the name every client checks, platform/wire/grpc_tls.py) and the pool's own name; server
            and client auth (a decode worker calls prefill workers). The router's: SANs
            `splitserve-router` and its own name, client auth only, so it can neither serve as a
            worker nor call a worker's Prefill (workers check the caller's role, grpc_guard.py);
            LEAF_DAYS valid, renewed when less than a third of its lifetime is left, or when the
            CA that signed it is no longer the current one

Trust across a CA rotation: a leaf Secret's `ca.crt` holds the current CA followed by the
previous one while that is still valid, so pods restarted onto the new certificates and pods
still running the old ones trust each other during the rolling update.

Everything takes `now` as an argument (no clock read here), so the rotation tests move time
forward instead of waiting for it.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "splitserve-worker"
CA_DAYS = 365
LEAF_DAYS = 90
RENEW_FRACTION = 1 / 3  # renew when less than this fraction of the lifetime is left
BACKDATE = datetime.timedelta(minutes=5)  # tolerate clock skew between the operator and the pods
PEM = serialization.Encoding.PEM


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM (PKCS#8) private key."""

    cert: bytes
    key: bytes

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.cert).hexdigest()[:16]


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _usage(ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=ca,
        crl_sign=ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(service: str, now: datetime.datetime, days: int = CA_DAYS) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"splitserve CA of {service}"[:64])])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(ca=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(PEM), _key_pem(key))


ROUTER_NAME = "splitserve-router"
ROLES = ("worker", "router")


def issue_leaf(
    ca: KeyPair, pool_name: str, now: datetime.datetime, days: int = LEAF_DAYS, role: str = "worker"
) -> KeyPair:
    """A certificate for one component of `role` (see the module docstring), signed by `ca` (never
    valid past the CA itself)."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    role_name = SERVER_NAME if role == "worker" else ROUTER_NAME
    usages = (
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        if role == "worker"
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    ca_cert = ca.certificate
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(ca=False), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(role_name), x509.DNSName(pool_name)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(PEM), _key_pem(key))


def role_of(cert_pem: bytes) -> str | None:
    """The role a leaf certificate names in its SANs (None: unreadable, or neither or both)."""
    try:
        sans = (
            x509.load_pem_x509_certificate(cert_pem)
            .extensions.get_extension_for_class(x509.SubjectAlternativeName)
            .value.get_values_for_type(x509.DNSName)
        )
    except (ValueError, x509.ExtensionNotFound):
        return None
    roles = {r for r, n in (("worker", SERVER_NAME), ("router", ROUTER_NAME)) if n in sans}
    return roles.pop() if len(roles) == 1 else None


def needs_renewal(cert_pem: bytes, now: datetime.datetime) -> bool:
    """Whether less than RENEW_FRACTION of the certificate's lifetime is left (or it is unreadable)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return True
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return now >= end - (end - start) * RENEW_FRACTION


def is_signed_by(cert_pem: bytes, ca_pem: bytes) -> bool:
    try:
        x509.load_pem_x509_certificate(cert_pem).verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


def is_valid_at(cert_pem: bytes, now: datetime.datetime) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return False
    return cert.not_valid_before_utc <= now < cert.not_valid_after_utc
