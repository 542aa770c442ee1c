"""Test helpers for traffic control (issue 12): API key hashes, an RSA JWKS, tokens."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

#: One RSA key for the whole session (generating one takes ~50 ms).
_PRIVATE = rsa.generate_private_key(public_exponent=65537, key_size=2048)
_OTHER = rsa.generate_private_key(public_exponent=65537, key_size=2048)
KID = "test-key-1"


def sha256_hash(key: str) -> str:
    """The ``hash`` field of an API key: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def scrypt_hash(key: str, salt: bytes = b"pdserve-test-salt", n: int = 1024) -> str:
    """The ``hash`` field of an API key: ``scrypt:<salt>:<n>:<r>:<p>:<hash>``."""
    h = hashlib.scrypt(key.encode(), salt=salt, n=n, r=8, p=1, dklen=32)
    return f"scrypt:{salt.hex()}:{n}:8:1:{h.hex()}"


def write_jwks(path: Path, kid: str = KID) -> Path:
    """Write a JWKS document holding the test key's public half."""
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(_PRIVATE.public_key()))
    jwk.update({"kid": kid, "use": "sig", "alg": "RS256"})
    path.write_text(json.dumps({"keys": [jwk]}))
    return path


def token(
    *,
    sub: str = "alice",
    aud: str | None = "pdserve",
    iss: str | None = "https://idp.test/",
    exp_in: float = 300,
    models: Any = ("*",),
    apis: Any = ("inference", "metadata"),
    kid: str = KID,
    other_key: bool = False,
    extra: dict[str, Any] | None = None,
) -> str:
    """A signed RS256 JWT with the given claims (``exp_in`` seconds from now)."""
    now = int(time.time())
    claims: dict[str, Any] = {"sub": sub, "iat": now, "exp": now + int(exp_in)}
    if aud is not None:
        claims["aud"] = aud
    if iss is not None:
        claims["iss"] = iss
    if models is not None:
        claims["pdserve_models"] = list(models)
    if apis is not None:
        claims["pdserve_apis"] = list(apis)
    claims.update(extra or {})
    key = _OTHER if other_key else _PRIVATE
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid})
