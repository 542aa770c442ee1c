"""API keys and JWT: the auth config file (``--auth-config``, :func:`load_auth_config`),
credentials (:class:`Authenticator`) and the grants of a principal.

Nothing here logs or returns a key or token: failures carry a reason word
(:data:`REASONS`) and, when known, the key's configured name.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.core.errors import ErrorCode, InferError
from pdserve.frontends.traffic.apis import CATEGORIES, INFERENCE, METADATA
from pdserve.frontends.traffic.ratelimit import RateLimitConfigError, parse_rate

if TYPE_CHECKING:
    from jwt import PyJWK
    from jwt.types import Options

#: Reason words of authentication failures (metric label ``reason``).
REASONS = (
    "missing",
    "malformed",
    "unknown_key",
    "expired",
    "not_yet_valid",
    "wrong_audience",
    "wrong_issuer",
    "bad_signature",
    "invalid_token",
    "forbidden_api",
    "forbidden_model",
    "restricted",
)

DEFAULT_APIS = frozenset({INFERENCE, METADATA})
DEFAULT_JWT_ALGORITHMS = ("RS256", "ES256", "EdDSA")
#: distinct tokens whose scrypt verification result is remembered.
_SCRYPT_CACHE = 4096


class AuthConfigError(ValueError):
    """The auth config file (or its JWKS file) is missing, unreadable or malformed."""


class AuthError(InferError):
    """A refused credential: ``UNAUTHENTICATED`` (401) or ``PERMISSION_DENIED`` (403).

    Attributes:
        why: the reason word (:data:`REASONS`), for metrics.
        principal: the key / token name when the credential was valid, else "".
    """

    def __init__(self, message: str, code: ErrorCode, why: str, principal: str = "") -> None:
        super().__init__(message, code, reason="REJECTED")
        self.why = why
        self.principal = principal
        if code is ErrorCode.UNAUTHENTICATED:
            self.http_headers = [(b"www-authenticate", b'Bearer realm="pdserve"')]


def unauthenticated(message: str, why: str) -> AuthError:
    """401 / ``UNAUTHENTICATED``."""
    return AuthError(message, ErrorCode.UNAUTHENTICATED, why)


def forbidden(message: str, why: str, principal: str = "") -> AuthError:
    """403 / ``PERMISSION_DENIED``."""
    return AuthError(message, ErrorCode.PERMISSION_DENIED, why, principal)


@dataclass
class Principal:
    """Who a request is and what it may do.

    Attributes:
        name: the key's configured name / the token's ``name_claim`` ("anonymous").
        models: fnmatch patterns of the models it may use (inference, metadata, config).
        apis: API categories it may use.
        rate_limit: its own rate limit (``limits`` string), or None.
        kind: ``key`` | ``jwt`` | ``anonymous``.
    """

    name: str
    models: tuple[str, ...]
    apis: frozenset[str]
    rate_limit: str | None = None
    kind: str = "key"
    _model_ok: dict[str, bool] = field(default_factory=dict, repr=False)

    def may_use_model(self, model: str) -> bool:
        """Whether ``model`` matches one of :attr:`models` (memoised per name)."""
        ok = self._model_ok.get(model)
        if ok is None:
            ok = any(fnmatch.fnmatchcase(model, p) for p in self.models)
            if len(self._model_ok) < 10_000:
                self._model_ok[model] = ok
        return ok


@dataclass(frozen=True)
class ApiKey:
    """One configured key: ``sha256`` digest or scrypt parameters, and its grants."""

    principal: Principal
    sha256: bytes = b""
    scrypt: tuple[bytes, int, int, int, bytes] | None = None


@dataclass
class JwtSettings:
    """The ``jwt`` section, with the keys of its JWKS file loaded."""

    jwks_file: Path
    keys: dict[str, PyJWK]  # by kid
    default_key: PyJWK | None  # the only key, when the set has one (tokens without kid)
    audience: str | list[str] | None
    issuer: str | None
    leeway: float
    algorithms: list[str]
    name_claim: str
    models_claim: str
    apis_claim: str
    rate_limit: str | None


@dataclass
class AuthConfig:
    """A parsed auth config file.

    Attributes:
        path: the file; ``files``: it and the files it names (watched for reload).
        keys: the API keys; ``jwt``: the JWT settings or None; ``anonymous``: the
            grants of requests without credential (None: every such request is 401).
        rate_limits: the ``rate_limits`` section, unparsed (``ratelimit`` reads it).
    """

    path: Path
    keys: list[ApiKey]
    jwt: JwtSettings | None
    anonymous: Principal | None
    rate_limits: dict[str, Any]
    files: list[Path]

    @property
    def enabled(self) -> bool:
        """True when requests need a credential (keys or jwt configured)."""
        return bool(self.keys) or self.jwt is not None


# -- loading -------------------------------------------------------------------------


def _read_document(path: Path) -> dict[str, object]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise AuthConfigError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        if path.suffix == ".json":
            doc = json.loads(text)
        else:
            import yaml  # PyYAML: the `traffic` extra

            doc = yaml.safe_load(text)
    except ImportError as e:
        raise AuthConfigError(
            f"{path}: reading YAML needs PyYAML (pip install 'pdserve[traffic]'): {e}"
        ) from None
    except Exception as e:  # noqa: BLE001 - yaml.YAMLError / JSONDecodeError: a bad file
        raise AuthConfigError(f"{path} is not valid YAML/JSON: {type(e).__name__}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise AuthConfigError(f"{path}: the top level must be a mapping")
    unknown = set(doc) - {"keys", "jwt", "anonymous", "rate_limits"}
    if unknown:
        raise AuthConfigError(
            f"{path}: unknown section(s) {', '.join(sorted(map(str, unknown)))}; "
            "expected keys, jwt, anonymous, rate_limits"
        )
    return doc


def _str_list(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AuthConfigError(f"{where} must be a list of strings")
    return tuple(value)


def _apis(value: object, where: str) -> frozenset[str]:
    names = _str_list(value, where)
    for name in names:
        if name not in CATEGORIES and name != "*":
            raise AuthConfigError(
                f"{where}: unknown API {name!r}; expected one of {', '.join(CATEGORIES)} or '*'"
            )
    return frozenset(CATEGORIES) if "*" in names else frozenset(names)


def _rate(value: object, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise AuthConfigError(f"{where} must be a string such as '100/second'")
    try:
        parse_rate(value)
    except RateLimitConfigError as e:
        raise AuthConfigError(f"{where}: {e}") from None
    return value


def _key(entry: object, i: int, env: dict[str, str]) -> ApiKey:
    where = f"keys[{i}]"
    if not isinstance(entry, dict):
        raise AuthConfigError(f"{where} must be a mapping")
    unknown = set(entry) - {"name", "hash", "env", "models", "apis", "rate_limit"}
    if unknown:
        raise AuthConfigError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise AuthConfigError(f"{where}: 'name' must be a non-empty string")
    principal = Principal(
        name=name,
        models=_str_list(entry.get("models", ["*"]), f"{where}.models"),
        apis=_apis(entry.get("apis", sorted(DEFAULT_APIS)), f"{where}.apis"),
        rate_limit=_rate(entry.get("rate_limit"), f"{where}.rate_limit"),
    )
    if ("hash" in entry) == ("env" in entry):
        raise AuthConfigError(f"{where} ({name}): give exactly one of 'hash' and 'env'")
    if "env" in entry:
        var = entry["env"]
        if not isinstance(var, str) or not var:
            raise AuthConfigError(f"{where} ({name}): 'env' must name an environment variable")
        secret = env.get(var)
        if not secret:
            raise AuthConfigError(
                f"{where} ({name}): environment variable {var} is not set or empty"
            )
        return ApiKey(principal, sha256=hashlib.sha256(secret.encode("utf-8")).digest())
    spec = entry["hash"]
    if not isinstance(spec, str):
        raise AuthConfigError(f"{where} ({name}): 'hash' must be a string")
    scheme, _, rest = spec.partition(":")
    try:
        if scheme == "sha256":
            digest = bytes.fromhex(rest)
            if len(digest) != 32:
                raise ValueError("not 32 bytes")
            return ApiKey(principal, sha256=digest)
        if scheme == "scrypt":
            salt, n, r, p, h = rest.split(":")
            return ApiKey(
                principal, scrypt=(bytes.fromhex(salt), int(n), int(r), int(p), bytes.fromhex(h))
            )
    except ValueError:
        pass
    raise AuthConfigError(
        f"{where} ({name}): 'hash' must be sha256:<64 hex digits> or "
        "scrypt:<salt hex>:<n>:<r>:<p>:<hash hex>"
    )


def load_jwks(path: Path) -> tuple[dict[str, PyJWK], PyJWK | None]:
    """The keys of a JWKS file: ``({kid: PyJWK}, the only key or None)``.

    Raises:
        AuthConfigError: missing, unreadable, not JSON, or no usable key.
    """
    try:
        import jwt
    except ImportError as e:
        raise AuthConfigError(f"JWT needs PyJWT (pip install 'pdserve[traffic]'): {e}") from None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise AuthConfigError(f"JWKS file {path}: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
        jwks = jwt.PyJWKSet.from_dict(doc)
    except (ValueError, TypeError, KeyError, jwt.PyJWTError) as e:
        raise AuthConfigError(f"JWKS file {path} is not a usable JWK set: {e}") from None
    keys = {k.key_id: k for k in jwks.keys if k.key_id}
    only = jwks.keys[0] if len(jwks.keys) == 1 else None
    return keys, only


def _jwt(section: object, base: Path) -> JwtSettings:
    if not isinstance(section, dict):
        raise AuthConfigError("jwt must be a mapping")
    unknown = set(section) - {
        "jwks_file",
        "audience",
        "issuer",
        "leeway_secs",
        "algorithms",
        "name_claim",
        "models_claim",
        "apis_claim",
        "rate_limit",
    }
    if unknown:
        raise AuthConfigError(f"jwt: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    jwks_name = section.get("jwks_file")
    if not isinstance(jwks_name, str) or not jwks_name:
        raise AuthConfigError("jwt.jwks_file must name the JWKS file")
    jwks_file = (base / jwks_name).resolve()
    keys, only = load_jwks(jwks_file)
    audience = section.get("audience")
    if audience is not None and not isinstance(audience, str | list):
        raise AuthConfigError("jwt.audience must be a string or a list of strings")
    issuer = section.get("issuer")
    if issuer is not None and not isinstance(issuer, str):
        raise AuthConfigError("jwt.issuer must be a string")
    leeway = section.get("leeway_secs", 0)
    if not isinstance(leeway, int | float) or leeway < 0:
        raise AuthConfigError("jwt.leeway_secs must be a number >= 0")
    algorithms = list(
        _str_list(section.get("algorithms", list(DEFAULT_JWT_ALGORITHMS)), "jwt.algorithms")
    )
    if any(a.lower() == "none" for a in algorithms):
        raise AuthConfigError("jwt.algorithms must not include 'none'")
    return JwtSettings(
        jwks_file=jwks_file,
        keys=keys,
        default_key=only,
        audience=audience,
        issuer=issuer,
        leeway=float(leeway),
        algorithms=algorithms,
        name_claim=str(section.get("name_claim", "sub")),
        models_claim=str(section.get("models_claim", "pdserve_models")),
        apis_claim=str(section.get("apis_claim", "pdserve_apis")),
        rate_limit=_rate(section.get("rate_limit"), "jwt.rate_limit"),
    )


def load_auth_config(path: Path | str, env: dict[str, str] | None = None) -> AuthConfig:
    """Read and check an auth config file (and its JWKS file).

    The file (YAML or JSON, chosen by its content; ``.json`` files are JSON) holds::

        keys:                          # API keys, never in plain text
          - name: team-a               # the name logs and metrics show (never the key)
            hash: sha256:<64 hex>      # sha256 of the key, or
                                       # scrypt:<salt hex>:<n>:<r>:<p>:<hash hex>
            models: ["resnet*", bert]  # fnmatch patterns of the models it may use (default ["*"])
            apis: [inference, metadata]  # API categories it may use (default: these two)
            rate_limit: 100/second     # optional, per key ("N/second|minute|hour|day", "N per M s")
          - name: ops
            env: PDSERVE_OPS_KEY       # or: the key is the value of this environment variable
            apis: [inference, metadata, model-config, model-repository, statistics,
                   trace, logging, shared-memory]
        jwt:                           # JSON Web Tokens, checked with PyJWT
          jwks_file: jwks.json         # the public keys (a JWKS document), relative to this file
          audience: pdserve            # required "aud" (optional)
          issuer: https://idp.example/ # required "iss" (optional)
          leeway_secs: 30              # clock skew allowed on exp / nbf / iat (default 0)
          algorithms: [RS256]          # accepted algorithms (default RS256, ES256, EdDSA)
          name_claim: sub              # the name logs and metrics show (default sub)
          models_claim: pdserve_models # claim: list of model patterns (absent: none)
          apis_claim: pdserve_apis     # claim: list of API categories (absent: inference, metadata)
          rate_limit: 50/second        # optional, per token name
        anonymous:                     # what a request without credential may do
          models: []                   # (default: nothing; health is always open)
          apis: []
        rate_limits:                   # see pdserve.frontends.traffic.ratelimit
          global: 1000/second
          models: {"resnet*": 200/second}

    Args:
        env: environment for ``env:`` keys (default ``os.environ``).

    Raises:
        AuthConfigError: naming the file and the field at fault (never a key).
    """
    path = Path(path).resolve()
    doc = _read_document(path)
    environ = dict(os.environ) if env is None else env
    raw_keys = doc.get("keys") or []
    if not isinstance(raw_keys, list):
        raise AuthConfigError(f"{path}: keys must be a list")
    keys = [_key(entry, i, environ) for i, entry in enumerate(raw_keys)]
    names = [k.principal.name for k in keys]
    if len(set(names)) != len(names):
        raise AuthConfigError(f"{path}: two keys have the same name")
    jwt_settings = _jwt(doc["jwt"], path.parent) if doc.get("jwt") is not None else None
    anonymous = None
    anon = doc.get("anonymous")
    if anon is not None:
        if not isinstance(anon, dict) or set(anon) - {"models", "apis", "rate_limit"}:
            raise AuthConfigError(
                f"{path}: anonymous must be a mapping of models, apis, rate_limit"
            )
        anonymous = Principal(
            name="anonymous",
            models=_str_list(anon.get("models", []), "anonymous.models"),
            apis=_apis(anon.get("apis", []), "anonymous.apis"),
            rate_limit=_rate(anon.get("rate_limit"), "anonymous.rate_limit"),
            kind="anonymous",
        )
    rate_limits = doc.get("rate_limits") or {}
    if not isinstance(rate_limits, dict):
        raise AuthConfigError(f"{path}: rate_limits must be a mapping")
    files = [path] + ([jwt_settings.jwks_file] if jwt_settings is not None else [])
    return AuthConfig(path, keys, jwt_settings, anonymous, rate_limits, files)


# -- checking credentials ------------------------------------------------------------


def bearer_token(authorization: str | None, access_token: str | None) -> str | None:
    """The token of ``Authorization: Bearer <t>`` (case-insensitive scheme) or of the
    ``triton-access-token`` header; None when neither is present.

    Raises:
        AuthError(UNAUTHENTICATED, "malformed"): an ``Authorization`` header that is
            not ``Bearer <token>``.
    """
    if authorization is not None:
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or " " in token:
            raise unauthenticated(
                "malformed Authorization header: expected 'Bearer <token>'", "malformed"
            )
        return token
    if access_token is not None:
        token = access_token.strip()
        if not token:
            raise unauthenticated("empty triton-access-token header", "malformed")
        return token
    return None


class Authenticator:
    """Checks credentials against one :class:`AuthConfig` (replaced on reload).

    A credential comes in ``Authorization: Bearer <token>`` or ``triton-access-token:
    <token>`` (HTTP headers; the gRPC metadata of the same names, or
    ``triton-grpc-protocol-triton-access-token``). A token with two dots is a JWT when
    ``jwt`` is configured, else an API key. Keys are compared as sha256 digests with
    :func:`hmac.compare_digest` against every configured key (no early exit); scrypt
    keys are verified once per distinct token and the result remembered (bounded).
    """

    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._scrypt_seen: OrderedDict[bytes, Principal | None] = OrderedDict()

    def authenticate(self, token: str | None) -> Principal:
        """The principal of ``token`` (None: no credential given).

        Raises:
            AuthError(UNAUTHENTICATED): no credential (and no anonymous grants), or a
                malformed, expired, wrongly addressed, badly signed or unknown one.
        """
        cfg = self.config
        if token is None:
            if cfg.anonymous is not None:
                return cfg.anonymous
            raise unauthenticated(
                "authentication required: send 'Authorization: Bearer <key or token>'",
                "missing",
            )
        if cfg.jwt is not None and token.count(".") == 2:
            return self._jwt(token, cfg.jwt)
        return self._api_key(token)

    def _api_key(self, token: str) -> Principal:
        raw = token.encode("utf-8", "surrogateescape")
        digest = hashlib.sha256(raw).digest()
        found: Principal | None = None
        scrypt_keys = []
        for key in self.config.keys:
            if key.scrypt is not None:
                scrypt_keys.append(key)
            elif hmac.compare_digest(digest, key.sha256) and found is None:
                found = key.principal
        if found is None and scrypt_keys:
            found = self._scrypt(digest, raw, scrypt_keys)
        if found is None:
            raise unauthenticated("invalid credential: unknown API key", "unknown_key")
        return found

    def _scrypt(self, digest: bytes, raw: bytes, keys: list[ApiKey]) -> Principal | None:
        cache = self._scrypt_seen
        if digest in cache:
            cache.move_to_end(digest)
            return cache[digest]
        found = None
        for key in keys:
            assert key.scrypt is not None
            salt, n, r, p, expected = key.scrypt
            try:
                got = hashlib.scrypt(raw, salt=salt, n=n, r=r, p=p, dklen=len(expected))
            except ValueError:
                continue
            if hmac.compare_digest(got, expected) and found is None:
                found = key.principal
        cache[digest] = found
        if len(cache) > _SCRYPT_CACHE:
            cache.popitem(last=False)
        return found

    def _jwt(self, token: str, s: JwtSettings) -> Principal:
        import jwt

        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise unauthenticated("invalid credential: malformed JWT", "malformed") from None
        kid = header.get("kid")
        key = s.keys.get(kid) if kid else s.default_key
        if key is None:
            raise unauthenticated(
                "invalid credential: JWT signed with an unknown key", "unknown_key"
            )
        options: Options = {"require": ["exp"]}
        if s.audience is None:
            options["verify_aud"] = False
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=s.algorithms,
                audience=s.audience,
                issuer=s.issuer,
                leeway=s.leeway,
                options=options,
            )
        except jwt.ExpiredSignatureError:
            raise unauthenticated("invalid credential: JWT expired", "expired") from None
        except jwt.ImmatureSignatureError:
            raise unauthenticated(
                "invalid credential: JWT not yet valid", "not_yet_valid"
            ) from None
        except jwt.InvalidAudienceError:
            raise unauthenticated("invalid credential: JWT audience", "wrong_audience") from None
        except jwt.InvalidIssuerError:
            raise unauthenticated("invalid credential: JWT issuer", "wrong_issuer") from None
        except jwt.InvalidSignatureError:
            raise unauthenticated("invalid credential: JWT signature", "bad_signature") from None
        except jwt.DecodeError:
            raise unauthenticated("invalid credential: malformed JWT", "malformed") from None
        except jwt.PyJWTError as e:
            # missing required claim, disallowed algorithm...: name the class only
            raise unauthenticated(
                f"invalid credential: JWT rejected ({type(e).__name__})", "invalid_token"
            ) from None
        name = claims.get(s.name_claim)
        models = claims.get(s.models_claim, [])
        apis = claims.get(s.apis_claim, sorted(DEFAULT_APIS))
        try:
            return Principal(
                name=str(name) if name is not None else "jwt",
                models=_str_list(models, f"JWT claim {s.models_claim}"),
                apis=frozenset(
                    a for a in _str_list(apis, f"JWT claim {s.apis_claim}") if a in CATEGORIES
                )
                | (frozenset(CATEGORIES) if apis == "*" or "*" in apis else frozenset()),
                rate_limit=s.rate_limit,
                kind="jwt",
            )
        except AuthConfigError as e:
            raise unauthenticated(f"invalid credential: {e}", "invalid_token") from None
