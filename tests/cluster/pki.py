"""Certificates for the test control plane, made with the openssl command line.

Every run gets a fresh CA, so two clusters on one machine never trust each other. Keys are ECDSA P-256: they
are generated in milliseconds (RSA would add seconds to every start on 2 cores) and every component accepts
them.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess

__all__ = ["ClientIdentity", "Pki", "make_pki"]

DAYS = "3650"


@dataclasses.dataclass(frozen=True)
class ClientIdentity:
    """A client certificate: `cn` is the user name, `org` the group (both as the API server sees them)."""

    name: str
    cn: str
    org: str | None = None


@dataclasses.dataclass(frozen=True)
class Pki:
    directory: pathlib.Path

    @property
    def ca_cert(self) -> pathlib.Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> pathlib.Path:
        return self.directory / "ca.key"

    @property
    def service_account_key(self) -> pathlib.Path:
        return self.directory / "sa.key"

    @property
    def service_account_pub(self) -> pathlib.Path:
        return self.directory / "sa.pub"

    def cert(self, name: str) -> pathlib.Path:
        return self.directory / f"{name}.crt"

    def key(self, name: str) -> pathlib.Path:
        return self.directory / f"{name}.key"


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _new_key(path: pathlib.Path) -> None:
    _openssl(
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        str(path),
        cwd=path.parent,
    )
    path.chmod(0o600)


def _signed_cert(pki: Pki, name: str, subject: str, extensions: str) -> None:
    directory = pki.directory
    _new_key(pki.key(name))
    ext_file = directory / f"{name}.ext"
    ext_file.write_text(extensions)
    csr = directory / f"{name}.csr"
    _openssl("req", "-new", "-key", str(pki.key(name)), "-subj", subject, "-out", str(csr), cwd=directory)
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(pki.ca_cert),
        "-CAkey",
        str(pki.ca_key),
        "-CAcreateserial",
        "-days",
        DAYS,
        "-extfile",
        str(ext_file),
        "-out",
        str(pki.cert(name)),
        cwd=directory,
    )
    csr.unlink()
    ext_file.unlink()


def make_pki(directory: pathlib.Path, *, servers: dict[str, list[str]], clients: list[ClientIdentity]) -> Pki:
    """Writes a CA, serving certs (name -> subjectAltName entries), client certs and a service-account key."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    _new_key(pki.ca_key)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        str(pki.ca_key),
        "-subj",
        "/CN=kembed-test-ca",
        "-days",
        DAYS,
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        "-out",
        str(pki.ca_cert),
        cwd=directory,
    )
    for name, alt_names in servers.items():
        _signed_cert(
            pki,
            name,
            f"/CN={name}",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage=serverAuth\nsubjectAltName={','.join(alt_names)}\n",
        )
    for client in clients:
        subject = f"/CN={client.cn}" + (f"/O={client.org}" if client.org else "")
        _signed_cert(
            pki,
            client.name,
            subject,
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
        )
    _new_key(pki.service_account_key)
    _openssl(
        "pkey",
        "-in",
        str(pki.service_account_key),
        "-pubout",
        "-out",
        str(pki.service_account_pub),
        cwd=directory,
    )
    return pki
