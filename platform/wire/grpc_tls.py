"""Mutual TLS for the Worker gRPC API (router -> workers, decode -> prefill workers).

Every party holds a certificate signed by the service's CA, the CA file, and its key. A worker
with TLS on serves only TLS and requires a client certificate signed by that CA
(`require_client_auth`), so a caller without one is refused in the handshake, before any RPC.
Clients verify the worker's certificate against the same CA and check the name
`server_name` (default `splitserve-worker`) rather than the address they dial: pod IPs change,
the service identity does not.

In Kubernetes the three files come from a Secret mount (cert-manager's `tls.crt`, `tls.key`,
`ca.crt`); `splitserve up` calls `generate_dev_pki` for a throwaway CA and one leaf certificate
shared by the router and both workers, so the secure path is the tested path; that leaf names
both roles (`splitserve-worker`, `splitserve-router`). In Kubernetes the operator issues one
certificate per role instead (operator/pki.py) and workers check the caller's role.
"""

from __future__ import annotations

import datetime
import os
import pathlib
from dataclasses import dataclass

import grpc

DEFAULT_SERVER_NAME = "splitserve-worker"
ROUTER_NAME = "splitserve-router"  # the router role's SAN (workers/grpc_guard.py checks callers' roles)


class TlsConfigError(ValueError):
    pass


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str
    ca: str
    server_name: str = DEFAULT_SERVER_NAME

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if not path:
                raise TlsConfigError(f"TLS needs all of cert, key and ca; {name} is empty")
            if not os.path.isfile(path):
                raise TlsConfigError(f"TLS {name} file {path!r} does not exist")
        if not self.server_name:
            raise TlsConfigError("TLS server_name must not be empty")

    def read(self) -> tuple[bytes, bytes, bytes]:
        return (
            pathlib.Path(self.cert).read_bytes(),
            pathlib.Path(self.key).read_bytes(),
            pathlib.Path(self.ca).read_bytes(),
        )


def tls_from(cert: str = "", key: str = "", ca: str = "", server_name: str = "") -> TlsFiles | None:
    """TlsFiles when any file is named (then all three must be), else None (plaintext)."""
    if not (cert or key or ca):
        return None
    return TlsFiles(cert, key, ca, server_name or DEFAULT_SERVER_NAME)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def aio_channel(address: str, tls: TlsFiles | None, options: list | tuple = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to a worker: plaintext without `tls`, mutual TLS with it."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    cert, key, ca = tls.read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.aio.secure_channel(
        address, creds, options=[*options, ("grpc.ssl_target_name_override", tls.server_name)]
    )


def generate_dev_pki(directory: str | os.PathLike, server_name: str = DEFAULT_SERVER_NAME, days: int = 7) -> TlsFiles:
    """A throwaway CA and one leaf (server and client auth, SANs `server_name`, `splitserve-router`,
    localhost, 127.0.0.1) in `directory` (files mode 0600): for local runs and tests, never production."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "splitserve throwaway CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [
        x509.DNSName(server_name),
        x509.DNSName(ROUTER_NAME),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = {
        "ca.crt": ca_cert.public_bytes(pem),
        "tls.crt": cert.public_bytes(pem),
        "tls.key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    }
    for name, data in files.items():
        path = out / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return TlsFiles(str(out / "tls.crt"), str(out / "tls.key"), str(out / "ca.crt"), server_name)
